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
from rlhf_orch.checkpoint import find_good  # noqa: E402
from rlhf_orch.storage import Store  # noqa: E402

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


def test_checkpoints_round_trip_through_a_storage_uri_onto_an_empty_node(tmp_path, full, monkeypatch):
    """experiment.output_dir as a URI (file:// through pyarrow.fs, as s3:// or gs:// would be): the run writes into a
    local mirror and uploads each committed checkpoint and its records. A resume from a machine whose local folder is
    empty (another node) downloads the checkpoint `latest` names, verifies it against the uploaded manifest and
    continues exactly: steps 3-4 equal the uninterrupted run's to 1e-6."""
    uri = f"file://{tmp_path}/bucket/runs"
    monkeypatch.setenv("RLHF_ORCH_LOCAL_RUNS", str(tmp_path / "node1"))
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={uri}",
                      "experiment.name=remote", "experiment.steps=2", *COMMON])
    assert rc == 0
    remote = tmp_path / "bucket" / "runs" / "remote"
    assert (remote / "checkpoints" / "latest").read_text().strip() == "step2"
    assert (remote / "checkpoints" / "reference.pt").exists() and (remote / "metrics.jsonl").exists()
    assert json.loads((remote / "summary.json").read_text())["status"] == "finished"
    monkeypatch.setenv("RLHF_ORCH_LOCAL_RUNS", str(tmp_path / "node2"))   # another node: nothing local
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={uri}",
                      "experiment.name=remote", "experiment.steps=4", "resume=true", *COMMON])
    assert rc == 0
    [local] = [p for p in (tmp_path / "node2").iterdir()]   # the mirror folder named after the URI
    resumed = [json.loads(l) for l in (local / "remote" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full[1], resumed):
        for k in ["train/loss", "train/kl", "train/grad_norm", "rollout/reward_mean", "sync/digest"]:
            assert abs(a[k] - b[k]) <= 1e-6, (a["step"], k, a[k], b[k])
    assert json.loads((remote / "summary.json").read_text())["resumed_from"] == 2
    assert (remote / "checkpoints" / "latest").read_text().strip() == "step4"
    # What is in storage verifies on its own: downloaded to a third folder, every file matches the manifest.
    store = Store(f"{uri}/remote")
    store.get_tree("checkpoints/step4", tmp_path / "node3" / "checkpoints" / "step4")
    (tmp_path / "node3" / "checkpoints" / "latest").write_text("step4\n")
    assert find_good(tmp_path / "node3" / "checkpoints") == ("step4", [])
    assert sorted(store.dirs("checkpoints")) == ["step2", "step4"]   # trainer.keep_checkpoints 3


def test_a_storage_uri_that_cannot_be_written_is_refused_before_ray(tmp_path, capsys):
    assert launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "experiment.output_dir=nosuch://bucket/x",
                        "experiment.name=bad_uri", *COMMON]) == 2
    assert "experiment.storage_uri: cannot open 'nosuch://bucket/x/bad_uri'" in capsys.readouterr().err
