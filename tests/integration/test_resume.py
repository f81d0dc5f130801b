"""Checkpoint and exact resume: a run stopped after step 2 and resumed to step 4 matches an uninterrupted
4-step run to 1e-6 in every loss and reward (same next batch, same samples, same optimizer state, same
KL reference). Real Ray actors, two DeepSpeed ZeRO-2 ranks, both sync transports. The uninterrupted run is made
once and shared: the tests that change a run folder work on a copy of it."""
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
COMMON = ["trainer.warm_start_steps=3", "ray.num_cpus=2", "trainer.checkpoint_every=2", "metrics.trackers=[jsonl]",
          "metrics.plots=false", "metrics.ray_metrics=false", "algorithm.kl_coef=0.05"]


def _run(out: Path, name, steps, *extra):
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={out}",
                      f"experiment.name={name}", f"experiment.steps={steps}", *COMMON, *extra])
    assert rc == 0
    return [json.loads(l) for l in (out / name / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """One uninterrupted 4-step run (checkpoints at steps 2 and 4) that the tests below read, or copy and change.
    It starts with resume=true in an empty folder: the first case of a resume without a checkpoint."""
    out = tmp_path_factory.mktemp("resume_full")
    return out, _run(out, "full", 4, "resume=true")


def _copy(full, tmp_path) -> Path:
    """The shared run's folder, copied under tmp_path (a test that changes it works on its own copy)."""
    shutil.copytree(full[0] / "full", tmp_path / "full")
    return tmp_path


def test_interrupted_and_resumed_run_matches_uninterrupted(tmp_path, full):
    full = full[1]
    first = _run(tmp_path, "split", 2)
    ckpt = tmp_path / "split" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step2"
    assert (ckpt / "step2" / "hf" / "model.safetensors").exists() and (ckpt / "reference.pt").exists()
    resumed = _run(tmp_path, "split", 4, "resume=true")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[:2] == first
    keys = ["train/loss", "train/kl", "train/grad_norm", "rollout/reward_mean", "rollout/tokens", "sync/digest"]
    for a, b in zip(full, resumed):
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-6, (a["step"], k, a[k], b[k])
    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert summary["resumed_from"] == 2


def test_resume_without_checkpoint_starts_fresh(tmp_path, full):
    # the shared run asked to resume in an empty folder: a fresh start
    assert [r["step"] for r in full[1]] == [1, 2, 3, 4]
    assert json.loads((full[0] / "full" / "summary.json").read_text())["resumed_from"] is None
    # an earlier run's records in the folder, but no checkpoint: a fresh start must not append to them
    out = _copy(full, tmp_path)
    shutil.rmtree(out / "full" / "checkpoints")
    recs = _run(out, "full", 1, "resume=true", "trainer.warm_start_steps=0")
    assert [r["step"] for r in recs] == [1]


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, full):
    out = _copy(full, tmp_path)
    ckpt = out / "full" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step4" and (ckpt / "step4" / "manifest.json").exists()
    victim = next(p for p in sorted((ckpt / "step4").rglob("*.pt")) if p.stat().st_size > 1000)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF                      # one flipped byte: a disk or copy error
    victim.write_bytes(bytes(data))
    recs = _run(out, "full", 5, "resume=true")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    summary = json.loads((out / "full" / "summary.json").read_text())
    assert summary["resumed_from"] == 2
    [note] = [n for n in summary["resume_notes"] if "step4" in n]
    assert "sha256 mismatch" in note and victim.name in note and "using step2" in note
