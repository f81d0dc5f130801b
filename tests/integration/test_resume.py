"""Checkpoint and exact resume: a run stopped after step 2 and resumed to step 4 on an empty node (its folder
mirrored to storage by URI) matches an uninterrupted 4-step run to 1e-6 in every loss and reward (same next batch,
same samples, same optimizer state, same KL reference). Real Ray actors, two DeepSpeed ZeRO-2 ranks, both sync
transports. The storage is a real S3-compatible server on 127.0.0.1 (moto's server mode, `pip install
"moto[server]>=5.2.5"`, pyarrow's S3 filesystem) when moto is installed, a file:// folder otherwise. The
uninterrupted run is made once and shared: the tests that change a run folder work on a copy of it. A resume
without a checkpoint starts fresh (the shared run itself: resume=true in a folder holding an earlier run's records
but no checkpoint, which it must not append to; that was a run of its own), a corrupt latest checkpoint falls back
to the previous one, and a storage URI that cannot be written is refused before Ray starts."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402
from baselines import baseline  # noqa: E402
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
    It starts with resume=true in a folder that holds an earlier 3-step run's records (real records of
    configs/tiny_cpu.yaml: the recorded baseline's first 3) but no checkpoint: the case of a resume without a
    checkpoint, which must start fresh and not append to those records. (The same path as an empty folder's, where
    find_good also finds no checkpoints folder, plus the records to drop.)"""
    out = tmp_path_factory.mktemp("resume_full")
    earlier = out / "full"
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in baseline("tiny_cpu_20steps")["steps"][:3]))
    (earlier / "rollouts.jsonl").write_text("".join(json.dumps({"step": s, "sources": [[0, s]], "groups_filtered": 0}) + "\n"
                                                    for s in (1, 2, 3)))
    return out, _run(out, "full", 4, "resume=true")


def _copy(full, tmp_path) -> Path:
    """The shared run's folder, copied under tmp_path (a test that changes it works on its own copy)."""
    shutil.copytree(full[0] / "full", tmp_path / "full")
    return tmp_path


def test_resume_without_checkpoint_starts_fresh(full):
    # the shared run asked to resume in a folder with an earlier run's records but no checkpoint: a fresh start,
    # whose records replace the earlier ones (appended, they would read steps 1, 2, 3, 1, 2, 3, 4)
    assert [r["step"] for r in full[1]] == [1, 2, 3, 4]
    assert json.loads((full[0] / "full" / "summary.json").read_text())["resumed_from"] is None
    rollouts = [json.loads(l)["step"] for l in (full[0] / "full" / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts == [1, 2, 3, 4]


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


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    """Where the storage test's runs go: a bucket `rlhf` on moto's S3 server on a free port of 127.0.0.1 (the
    AWS_* variables set in the driver, which uploads and downloads on one node) when moto is installed, else a
    file:// folder (pyarrow's local filesystem: the code path of s3:// and gs://)."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        yield f"file://{tmp_path_factory.mktemp('bucket')}/runs"
        return
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from pyarrow import fs
    fs.S3FileSystem(endpoint_override=f"http://127.0.0.1:{port}", allow_bucket_creation=True).create_dir("rlhf")
    yield "s3://rlhf/runs"
    server.kill()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_checkpoints_round_trip_through_a_storage_uri_onto_an_empty_node(tmp_path, full, storage, monkeypatch):
    """experiment.output_dir as a URI (s3:// on moto's server, or file://): the run writes into a local mirror and
    uploads each committed checkpoint (its HF export and the KL reference included) and its records. Stopped after
    step 2, it is resumed to step 4 from a machine whose local folder is empty (another node): the resume downloads
    the checkpoint `latest` names, verifies it against the uploaded manifest and continues exactly: steps 1-2 as
    recorded before the stop, steps 1-4 equal to the uninterrupted run's to 1e-6."""
    uri = storage
    monkeypatch.setenv("RLHF_ORCH_LOCAL_RUNS", str(tmp_path / "node1"))
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={uri}",
                      "experiment.name=remote", "experiment.steps=2", *COMMON])
    assert rc == 0
    store = Store(f"{uri}/remote")
    assert store.read("checkpoints/latest") == b"step2\n" and store.read("checkpoints/reference.pt") is not None
    assert store.read("checkpoints/step2/hf/model.safetensors") is not None and store.read("metrics.jsonl") is not None
    assert json.loads(store.read("summary.json"))["status"] == "finished"
    [local1] = [p for p in (tmp_path / "node1").iterdir()]   # the mirror folder named after the URI
    ckpt = local1 / "remote" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step2"
    assert (ckpt / "step2" / "hf" / "model.safetensors").exists() and (ckpt / "reference.pt").exists()
    first = [json.loads(l) for l in (local1 / "remote" / "metrics.jsonl").read_text().splitlines()]
    monkeypatch.setenv("RLHF_ORCH_LOCAL_RUNS", str(tmp_path / "node2"))   # another node: nothing local
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={uri}",
                      "experiment.name=remote", "experiment.steps=4", "resume=true", *COMMON])
    assert rc == 0
    [local] = [p for p in (tmp_path / "node2").iterdir()]
    resumed = [json.loads(l) for l in (local / "remote" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[:2] == first
    keys = ["train/loss", "train/kl", "train/grad_norm", "rollout/reward_mean", "rollout/tokens", "sync/digest"]
    for a, b in zip(full[1], resumed):
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-6, (a["step"], k, a[k], b[k])
    records = [json.loads(line) for line in store.read("metrics.jsonl").decode().splitlines()]   # the uploaded ones
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(r["sync/checksum_ok"] == 1.0 for r in records)
    summary = json.loads(store.read("summary.json"))
    assert summary["resumed_from"] == 2 and summary["status"] == "finished"
    assert store.read("checkpoints/latest") == b"step4\n"
    # What is in storage verifies on its own: downloaded to a third folder, every file matches the manifest.
    store.get_tree("checkpoints/step4", tmp_path / "node3" / "checkpoints" / "step4")
    (tmp_path / "node3" / "checkpoints" / "latest").write_text("step4\n")
    assert find_good(tmp_path / "node3" / "checkpoints") == ("step4", [])
    assert sorted(store.dirs("checkpoints")) == ["step2", "step4"]   # trainer.keep_checkpoints 3


def test_a_storage_uri_that_cannot_be_written_is_refused_before_ray(tmp_path, capsys):
    assert launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "experiment.output_dir=nosuch://bucket/x",
                        "experiment.name=bad_uri", *COMMON]) == 2
    assert "experiment.storage_uri: cannot open 'nosuch://bucket/x/bad_uri'" in capsys.readouterr().err
