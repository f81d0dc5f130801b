"""Where a run writes (relative output_dir under `ray job submit`) and one live run per run folder (RunLock):
a held lock refuses a second run, a SIGKILLed owner's lock is taken over with a warning, a released one silently."""
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlhf_orch.errors import ConfigError
from rlhf_orch.run_dir import LOCK_NAME, OUTPUT_ENV, RAY_JOB_ENV, RunLock, ray_job_id, resolve_output_dir

JOB_ENV = {RAY_JOB_ENV: json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_x.zip"},
                                    "metadata": {"job_submission_id": "raysubmit_abc"}}), "HOME": "/home/u"}
RAY_CWD = "/tmp/ray/session_2026-11-25_01-00-00_1_1/runtime_resources/working_dir_files/_ray_pkg_x"


def test_local_run_keeps_relative_path():
    assert resolve_output_dir("runs", {"HOME": "/home/u"}, "/work/main") == ("runs", None)
    assert resolve_output_dir("runs", {OUTPUT_ENV: "/data", "HOME": "/home/u"}, "/work/main") == ("runs", None)
    assert ray_job_id({}, "/work/main") is None


def test_ray_job_relative_path_goes_to_home_root():
    out, why = resolve_output_dir("runs", JOB_ENV, RAY_CWD)
    assert out == "/home/u/rlhf_orch_runs/runs"
    assert "raysubmit_abc" in why and "runs" in why


def test_ray_job_env_var_root_and_absolute_path():
    out, why = resolve_output_dir("runs/x", {**JOB_ENV, OUTPUT_ENV: "/data/rl"}, RAY_CWD)
    assert out == "/data/rl/runs/x" and OUTPUT_ENV in why
    assert resolve_output_dir("/abs/runs", {**JOB_ENV, OUTPUT_ENV: "/data/rl"}, RAY_CWD) == ("/abs/runs", None)
    with pytest.raises(ConfigError, match=OUTPUT_ENV):
        resolve_output_dir("runs", {**JOB_ENV, OUTPUT_ENV: "rel"}, RAY_CWD)


def test_job_detected_by_cwd_alone_or_env_alone():
    assert ray_job_id({}, RAY_CWD) == "unknown"
    assert ray_job_id(JOB_ENV, "/somewhere") == "raysubmit_abc"
    assert ray_job_id({RAY_JOB_ENV: "not json"}, "/somewhere") == "unknown"
    assert ray_job_id({}, "/home/u/runtime_resources_notes") is None
    assert resolve_output_dir("runs", {"HOME": "/home/u"}, RAY_CWD)[0] == "/home/u/rlhf_orch_runs/runs"


def _holder(run_dir, ready):
    """A separate process that takes the lock, says so, and sleeps."""
    code = textwrap.dedent(f"""
        import pathlib, time
        from rlhf_orch.run_dir import RunLock
        RunLock({str(run_dir)!r}, "x").acquire()
        pathlib.Path({str(ready)!r}).write_text("ok")
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 60
    while not ready.exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    return proc


def test_live_owner_refuses_second_run_and_killed_owner_is_taken_over(tmp_path, caplog):
    run_dir = tmp_path / "exp"
    proc = _holder(run_dir, tmp_path / "ready")
    try:
        with pytest.raises(ConfigError) as e:
            RunLock(run_dir, "exp").acquire()
        msg = str(e.value)
        assert f"pid {proc.pid}" in msg and "experiment.name" in msg and "resume=true" in msg
        os.kill(proc.pid, signal.SIGKILL)     # the kernel drops its flock; its record stays in the file
        proc.wait(timeout=10)
        with caplog.at_level(logging.WARNING, logger="rlhf_orch.run_dir"):
            lock = RunLock(run_dir, "exp").acquire()
        assert lock.took_over["pid"] == proc.pid and f"pid {proc.pid}" in caplog.text
        assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == os.getpid()
        lock.release()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_release_lets_the_next_run_in_without_warning_and_same_process_cannot_double_take(tmp_path, caplog):
    run_dir = tmp_path / "exp"
    with RunLock(run_dir, "exp"):
        with pytest.raises(ConfigError, match="in use by pid"):   # a second launch.main in this process
            RunLock(run_dir, "exp").acquire()
    assert (run_dir / LOCK_NAME).read_text() == ""
    with caplog.at_level(logging.WARNING, logger="rlhf_orch.run_dir"):
        lock = RunLock(run_dir, "exp").acquire()
    assert lock.took_over is None and "taking over" not in caplog.text
    lock.release()


def test_job_output_override_reads_file_and_overrides_before_loading(tmp_path):
    from rlhf_orch.run_dir import job_output_override
    cfg = tmp_path / "c.yaml"
    cfg.write_text("experiment:\n  name: a\n")
    env = {**JOB_ENV, OUTPUT_ENV: "/data/rl"}
    assert job_output_override(cfg, [], {"HOME": "/home/u"}, "/work") == (None, None)     # not a job
    ov, why = job_output_override(cfg, [], env, RAY_CWD)                                   # the schema default
    assert ov == 'experiment.output_dir="/data/rl/runs"' and why
    assert job_output_override(cfg, ["experiment.output_dir=out/x"], env, RAY_CWD)[0] == \
        'experiment.output_dir="/data/rl/out/x"'
    assert job_output_override(cfg, ["experiment.output_dir=/abs"], env, RAY_CWD) == (None, None)
    cfg.write_text("experiment:\n  output_dir: mine\n")
    assert job_output_override(cfg, [], env, RAY_CWD)[0] == 'experiment.output_dir="/data/rl/mine"'
    from rlhf_orch.config.loader import load_config                                        # the override loads
    real = Path(__file__).resolve().parents[2] / "configs/tiny_cpu.yaml"
    ov, _ = job_output_override(real, [], {**env, OUTPUT_ENV: str(tmp_path)}, RAY_CWD)
    assert load_config(real, [ov]).experiment.output_dir == str(tmp_path / "runs")


def test_launch_refuses_a_second_live_run_of_the_same_name_before_ray(tmp_path, capsys):
    import ray
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    import launch
    with RunLock(tmp_path / "twin", "twin"):   # the first run, alive
        rc = launch.main(["--config", str(root / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                          "experiment.name=twin"])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert rc == 2 and len(err) == 1 and f"pid {os.getpid()}" in err[0] and "experiment.name" in err[0]
    assert not ray.is_initialized(), "no actor may start while another run holds the folder"
    assert not (tmp_path / "twin" / "metrics.jsonl").exists()
