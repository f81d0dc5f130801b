"""A SIGKILLed driver leaves no Ray behind, and the same command with resume=true finishes the run exactly:
launch.py starts a local Ray; once the driver is killed mid-training (after its step-5 checkpoint) the watchdog
(driver/watchdog.py, started by driver/ray_session.py::init_ray) terminates every process of that Ray session
within seconds (without it the DashboardAgent and RuntimeEnvAgent live ~60 s more). The resumed run's 20 steps
match the synchronous-loop baseline (tests/data/tiny_cpu_20steps_baseline.json) to 1e-6.

The resumed run (in this process, its own local Ray, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER unset: what launch.py itself
does) is also the loopback check that was a 2-step run of its own in test_loopback.py: while it is up, a thread lists
every listening TCP socket of this process's descendants (GCS, raylet, dashboard and its agents, metrics, every actor's
core worker) and each must be bound to 127.0.0.1 or ::1 (the helpers and their own check are in test_loopback.py)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from baselines import baseline
from engine_hooks import engine_hooks
import launch

sys.path.insert(0, str(Path(__file__).parent))
from test_loopback import non_loopback, watch_listeners  # noqa: E402   (the loopback check's helpers)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration
START_TIMEOUT_S = 240     # first metrics line (a machine's first run also compiles a DeepSpeed op)
CLEANUP_TIMEOUT_S = 20


def _session_of(procs: list[psutil.Process]) -> str | None:
    for p in procs:
        try:
            for arg in p.cmdline():
                m = re.match(r"--session[-_]dir=(.+)", arg)
                if m:
                    return os.path.realpath(m.group(1))
        except psutil.Error:
            pass
    return None


def _leftovers(session_dir: str, seen: dict[int, float]) -> list[psutil.Process]:
    """Live processes of the session: seen under the driver (same pid and create time), naming the session
    dir on their command line, or holding a file under it open."""
    out = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if (abs(seen.get(p.pid, -10.0) - p.create_time()) < 1.0
                    or any(session_dir in a for a in p.cmdline())
                    or any(f.path.startswith(session_dir + os.sep) for f in p.open_files())):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _describe(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.name()} (parent {p.ppid()})")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return "; ".join(out)


def test_sigkilled_driver_leaves_no_ray_processes_and_the_resume_listens_on_loopback_only(tmp_path, monkeypatch):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RLHF_ORCH_WATCHDOG")}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", GLOO_SOCKET_IFNAME="lo", TOKENIZERS_PARALLELISM="false",
               **engine_hooks({"decode_delay_s": 0.02}, {"decode_delay_s": 0.02}))   # slower steps, same numbers
    common = [f"experiment.output_dir={tmp_path}", "experiment.name=killed", "experiment.steps=20",
              "trainer.checkpoint_every=5", "ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false",
              "metrics.plots=false"]
    cmd = [sys.executable, str(ROOT / "launch.py"), "--config", str(ROOT / "configs/tiny_cpu.yaml"), *common]
    log_path = tmp_path / "driver.log"
    metrics = tmp_path / "killed" / "metrics.jsonl"
    session_dir, seen, leftovers = None, {}, []
    with open(log_path, "wb") as log:
        driver = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 7):   # step 5 is checkpointed
            assert driver.poll() is None, f"driver exited ({driver.returncode}):\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no metrics after {START_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.1)
        children = psutil.Process(driver.pid).children(recursive=True)
        seen = {}
        for p in children:
            try:
                seen[p.pid] = p.create_time()
            except psutil.Error:
                pass
        session_dir = _session_of(children)
        assert session_dir, f"no Ray session among the driver's processes: {_describe(children)}"
        watchdogs = [p for p in children if "driver.watchdog" in " ".join(p.cmdline())]
        assert watchdogs, "no watchdog: driver/ray_session.py::init_ray must call driver.watchdog.start_watchdog()"

        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        assert len(metrics.read_text().splitlines()) < 20, "the run finished before the kill"
        killed = time.monotonic()
        while time.monotonic() - killed < CLEANUP_TIMEOUT_S:
            leftovers = _leftovers(session_dir, seen)
            if not leftovers:
                break
            time.sleep(0.5)
        assert not leftovers, (f"{CLEANUP_TIMEOUT_S}s after the driver's SIGKILL, processes of {session_dir} "
                               f"remain: {_describe(leftovers)}")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        if session_dir:   # whatever the outcome, leave no Ray behind for the next test
            rest = _leftovers(session_dir, seen)
            for p in rest:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(rest, timeout=5)

    # The same command with resume=true (in this process) continues from the last checkpoint, exactly. Its local Ray
    # is set up as launch.py itself does it, not as this shell exported (init_ray sets the variable only when unset),
    # and every socket its processes listen on is watched meanwhile.
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with watch_listeners() as seen:
        assert launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), *common, "resume=true"]) == 0
    names = {s.name for s in seen.values()}
    # It saw Ray itself and the actors' workers, not an empty list.
    assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names), names
    assert any(n.startswith("ray::") for n in names), names
    assert not non_loopback(list(seen.values())), non_loopback(list(seen.values()))
    base = baseline("tiny_cpu_20steps")
    records = [json.loads(l) for l in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    for want, got in zip(base["steps"], records):
        for key in base["keys"]:
            assert abs(want[key] - got[key]) <= 1e-6, (want["step"], key, want[key], got[key])
    assert json.loads((tmp_path / "killed" / "summary.json").read_text())["resumed_from"] >= 5
