"""A run whose output_dir is an S3 bucket, against a real S3-compatible server on 127.0.0.1 (moto's server mode,
`pip install "moto[server]>=5.2.5"`; skipped without it): checkpoints and records uploaded through pyarrow's S3
filesystem, then a resume from an empty local folder (another node) that downloads the checkpoint, verifies it
against the uploaded manifest and goes on. (test_resume.py proves the same path exact to 1e-6 with file://.)"""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402
from rlhf_orch.checkpoint import find_good  # noqa: E402
from rlhf_orch.storage import Store  # noqa: E402

pytest.importorskip("moto.server")
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
COMMON = ["trainer.warm_start_steps=3", "ray.num_cpus=2", "trainer.checkpoint_every=2", "metrics.trackers=[jsonl]",
          "metrics.plots=false", "metrics.ray_metrics=false", "experiment.name=s3run"]


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on a free port of 127.0.0.1, and a bucket `rlhf` in it."""
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
    yield port
    server.kill()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_a_run_checkpoints_to_s3_and_resumes_from_it_on_an_empty_node(tmp_path, s3_endpoint, monkeypatch):
    config = str(ROOT / "configs/tiny_cpu.yaml")
    monkeypatch.setenv("RLHF_ORCH_LOCAL_RUNS", str(tmp_path / "node1"))
    assert launch.main(["--config", config, "experiment.output_dir=s3://rlhf/runs", "experiment.steps=2",
                        *COMMON]) == 0
    store = Store("s3://rlhf/runs/s3run")
    assert store.read("checkpoints/latest") == b"step2\n" and store.read("checkpoints/reference.pt") is not None
    monkeypatch.setenv("RLHF_ORCH_LOCAL_RUNS", str(tmp_path / "node2"))   # another node: nothing local
    assert launch.main(["--config", config, "experiment.output_dir=s3://rlhf/runs", "experiment.steps=3",
                        "resume=true", *COMMON]) == 0
    assert store.read("checkpoints/latest") == b"step3\n" and store.dirs("checkpoints") == ["step2", "step3"]
    records = [json.loads(line) for line in store.read("metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["sync/checksum_ok"] == 1.0 for r in records)
    summary = json.loads(store.read("summary.json"))
    assert summary["resumed_from"] == 2 and summary["status"] == "finished"
    store.get_tree("checkpoints/step3", tmp_path / "node3" / "checkpoints" / "step3")   # what S3 holds verifies
    (tmp_path / "node3" / "checkpoints" / "latest").write_text("step3\n")
    assert find_good(tmp_path / "node3" / "checkpoints") == ("step3", [])
