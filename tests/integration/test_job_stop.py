"""`ray job submit --working-dir .` then `ray job stop`, for real: a head started here with `ray start --head --block`
(every port free-picked, on 127.0.0.1, its own temp dir), a job from this checkout with RLHF_ORCH_OUTPUT_DIR in its
runtime env and the default relative experiment.output_dir. The run's outputs must land under RLHF_ORCH_OUTPUT_DIR,
never in Ray's copy of the working dir, and after the stop (SIGTERM from Ray's job supervisor) summary.json says
"stopped", the plots exist and the last completed step's checkpoint verifies against its manifest."""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from rlhf_orch.checkpoint import checkpoint_dir, find_good  # noqa: E402

pytestmark = pytest.mark.integration
ARGS = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "trainer.warm_start_steps=0",
        "experiment.name=jobstop", "experiment.steps=500", "experiment.log_samples_every=0",
        "engines.0.decode_delay_s=0.01", "engines.1.decode_delay_s=0.01"]   # no experiment.output_dir: "runs"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _kill_session(temp_dir: str) -> None:
    """Whatever of this head is still alive (`ray stop` would stop every Ray on the machine)."""
    procs = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and any(temp_dir in a for a in p.cmdline()):
                procs.append(p)
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def test_ray_job_stop_leaves_summary_plots_and_checkpoint_outside_working_dir(tmp_path, monkeypatch):
    import secrets
    # `ray start` turns token authentication on by default: a fresh token for this head, known to head and client.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    from ray.job_submission import JobStatus, JobSubmissionClient
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")   # short: Ray's unix socket paths live under it
    out_root = tmp_path / "out"
    gcs, dash, agent_http, agent_grpc, metrics, client, nm, om, renv = _free_ports(9)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", GLOO_SOCKET_IFNAME="lo", TOKENIZERS_PARALLELISM="false")
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1",
         f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--metrics-export-port={metrics}", f"--ray-client-server-port={client}", f"--node-manager-port={nm}",
         f"--object-manager-port={om}", f"--runtime-env-agent-port={renv}", "--num-cpus=2"],
        env=env, stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT)
    try:
        address = f"http://127.0.0.1:{dash}"
        deadline = time.time() + 90
        while True:
            assert head.poll() is None, (tmp_path / "head.log").read_text()[-3000:]
            try:
                jobs = JobSubmissionClient(address)
                break
            except Exception:
                assert time.time() < deadline, (tmp_path / "head.log").read_text()[-3000:]
                time.sleep(1)
        job = jobs.submit_job(
            entrypoint=" ".join(["python", "launch.py", "--config", "configs/tiny_cpu.yaml", *ARGS]),
            runtime_env={"working_dir": str(ROOT), "excludes": [".git", ".stage", ".whl", "runs", "build"],
                         "env_vars": {"RLHF_ORCH_OUTPUT_DIR": str(out_root), "RAY_JOB_STOP_WAIT_TIME_S": "60",
                                      "PYTHONUNBUFFERED": "1"}})
        run = out_root / "runs" / "jobstop"
        metrics_file = run / "metrics.jsonl"
        deadline = time.time() + 300
        while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 5):
            status = jobs.get_job_status(job)
            assert status in (JobStatus.PENDING, JobStatus.RUNNING), f"{status}:\n{jobs.get_job_logs(job)[-3000:]}"
            assert time.time() < deadline, f"no metrics under {run}:\n{jobs.get_job_logs(job)[-3000:]}"
            time.sleep(0.5)
        assert jobs.stop_job(job)
        deadline = time.time() + 120
        while jobs.get_job_status(job) not in (JobStatus.STOPPED, JobStatus.FAILED, JobStatus.SUCCEEDED):
            assert time.time() < deadline, jobs.get_job_logs(job)[-3000:]
            time.sleep(0.5)
        logs = jobs.get_job_logs(job)
        assert jobs.get_job_status(job) == JobStatus.STOPPED, logs[-3000:]
        assert f"outputs of this run: {run}" in logs and "Ray job" in logs, logs[-3000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "stopped" and "SIGTERM" in summary["error"], summary
        steps = [json.loads(l)["step"] for l in metrics_file.read_text().splitlines()]
        tag, notes = find_good(checkpoint_dir(run))
        assert tag == f"step{steps[-1]}" and not notes, (tag, notes, steps[-1])
        assert (run / "plots" / "timeline.png").exists() and (run / "plots" / "reward.png").exists()
        copies = list(Path(temp_dir).glob("session_*/runtime_resources/working_dir_files/*"))
        assert copies, "the job did not run from Ray's copy of the working dir: this test proves nothing"
        assert not [c for c in copies if (c / "runs").exists()], "outputs landed in Ray's copy of the working dir"
    finally:
        if head.poll() is None:
            head.terminate()        # --block: `ray start` stops what it started
            try:
                head.wait(timeout=30)
            except subprocess.TimeoutExpired:
                head.kill()
        _kill_session(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
