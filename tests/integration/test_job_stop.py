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
from engine_hooks import engine_hooks  # noqa: E402
from rlhf_orch.checkpoint import checkpoint_dir, find_good  # noqa: E402

pytestmark = pytest.mark.integration
ARGS = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "trainer.warm_start_steps=0",
        "experiment.name=jobstop", "experiment.steps=500", "experiment.log_samples_every=0"]   # no output_dir: "runs"
HOOKS = engine_hooks({"decode_delay_s": 0.01}, {"decode_delay_s": 0.01})   # slower steps


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


def _ray_job(env: dict, address: str, *args: str, check: bool = True) -> str:
    """One `ray job ...` command, as a user types it. The CLI, not JobSubmissionClient in this process: Ray caches
    the auth token (and whether auth is on) per process, and this pytest process runs Ray without auth elsewhere."""
    r = subprocess.run(["ray", "job", args[0], f"--address={address}", *args[1:]], env=env, capture_output=True, text=True,
                       timeout=120)
    assert not check or r.returncode == 0, f"ray job {args[0]}: rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def _status(env: dict, address: str, job: str) -> str:
    out = _ray_job(env, address, "status", job, check=False)   # the CLI's own words for each state
    for status, words in (("STOPPED", "was stopped"), ("SUCCEEDED", "succeeded"), ("FAILED", "failed"),
                          ("PENDING", ": PENDING"), ("RUNNING", ": RUNNING")):
        if f"Job '{job}' {words}" in out or f"Status for job '{job}'{words}" in out:
            return status
    raise AssertionError(f"no status in:\n{out}")


def test_ray_job_stop_leaves_summary_plots_and_checkpoint_outside_working_dir(tmp_path):
    import secrets
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")   # short: Ray's unix socket paths live under it
    out_root = tmp_path / "out"
    gcs, dash, agent_http, agent_grpc, metrics, client, nm, om, renv = _free_ports(9)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    # `ray start` turns token authentication on by default: a fresh token for this head, known to head and CLI.
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", GLOO_SOCKET_IFNAME="lo", TOKENIZERS_PARALLELISM="false",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    env.pop("RAY_AUTH_TOKEN_PATH", None)
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
        while subprocess.run(["ray", "job", "list", f"--address={address}"], env=env, capture_output=True,
                             timeout=120).returncode != 0:
            assert head.poll() is None, (tmp_path / "head.log").read_text()[-3000:]
            assert time.time() < deadline, (tmp_path / "head.log").read_text()[-3000:]
            time.sleep(1)
        job = "jobstop-" + secrets.token_hex(4)
        runtime_env = {"excludes": [".git", ".stage", ".whl", "runs", "build"],
                       "env_vars": {"RLHF_ORCH_OUTPUT_DIR": str(out_root), "RAY_JOB_STOP_WAIT_TIME_S": "60",
                                    "PYTHONUNBUFFERED": "1", **HOOKS}}
        _ray_job(env, address, "submit", "--no-wait", f"--submission-id={job}", f"--working-dir={ROOT}",
                 f"--runtime-env-json={json.dumps(runtime_env)}", "--",
                 "python", "launch.py", "--config", "configs/tiny_cpu.yaml", *ARGS)
        logs = lambda: _ray_job(env, address, "logs", job, check=False)[-3000:]  # noqa: E731
        run = out_root / "runs" / job / "jobstop"   # the default output_dir: a folder of the job's own
        metrics_file = run / "metrics.jsonl"
        deadline = time.time() + 300
        while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 5):
            status = _status(env, address, job)
            assert status in ("PENDING", "RUNNING"), f"{status}:\n{logs()}"
            assert time.time() < deadline, f"no metrics under {run}:\n{logs()}"
            time.sleep(1)
        _ray_job(env, address, "stop", "--no-wait", job)
        deadline = time.time() + 120
        while (status := _status(env, address, job)) not in ("STOPPED", "FAILED", "SUCCEEDED"):
            assert time.time() < deadline, logs()
            time.sleep(1)
        text = _ray_job(env, address, "logs", job)
        assert status == "STOPPED", text[-3000:]
        assert f"outputs of this run: {run}" in text and "Ray job" in text, text[-3000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "stopped" and "SIGTERM" in summary["error"], summary
        assert summary["ray_job"] == job and summary["steps"] >= 5 and summary["verified_syncs"] == summary["syncs"]
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
