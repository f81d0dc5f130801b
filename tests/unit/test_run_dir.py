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
    assert ov == 'experiment.output_dir="/data/rl/runs/raysubmit_abc"' and "raysubmit_abc" in why   # its own folder
    assert job_output_override(cfg, ["experiment.output_dir=out/x"], env, RAY_CWD)[0] == \
        'experiment.output_dir="/data/rl/out/x"'
    assert job_output_override(cfg, ["experiment.output_dir=/abs"], env, RAY_CWD) == (None, None)
    cfg.write_text("experiment:\n  output_dir: mine\n")
    assert job_output_override(cfg, [], env, RAY_CWD)[0] == 'experiment.output_dir="/data/rl/mine"'
    from rlhf_orch.config.loader import load_config                                        # the override loads
    real = Path(__file__).resolve().parents[2] / "configs/tiny_cpu.yaml"
    ov, _ = job_output_override(real, [], {**env, OUTPUT_ENV: str(tmp_path)}, RAY_CWD)
    assert load_config(real, [ov]).experiment.output_dir == str(tmp_path / "runs" / "raysubmit_abc")
    # a job whose id is unknown (only the cwd says it is a job) keeps the plain folder
    assert job_output_override(None, [], {OUTPUT_ENV: "/data/rl"}, RAY_CWD)[0] == \
        'experiment.output_dir="/data/rl/runs"'


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


def _earlier_run(run_dir: Path, status: str = "finished") -> dict:
    """A finished (or stopped) run's outputs, as launch.py leaves them; {relative path: bytes} to compare later."""
    (run_dir / "plots").mkdir(parents=True)
    (run_dir / "checkpoints" / "step2").mkdir(parents=True)
    files = {"metrics.jsonl": b'{"step": 1}\n{"step": 2}\n', "summary.json": json.dumps({"status": status}).encode(),
             "plots/reward.png": b"png", "checkpoints/step2/rl_state.json": b"{}", LOCK_NAME: b""}
    for rel, data in files.items():
        (run_dir / rel).write_bytes(data)
    return files


def _contents(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def test_fresh_run_in_a_folder_with_an_earlier_runs_outputs_is_refused_and_nothing_changes(tmp_path):
    from rlhf_orch.run_dir import claim_run_dir, earlier_outputs
    assert claim_run_dir(tmp_path / "missing", resume=False, overwrite=False) == []   # a new folder
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / LOCK_NAME).write_text("")                                   # only the lock: not an output
    assert earlier_outputs(tmp_path / "empty") == [] and claim_run_dir(tmp_path / "empty", False, False) == []
    run_dir = tmp_path / "exp"
    files = _earlier_run(run_dir, "stopped")
    with pytest.raises(ConfigError) as e:
        claim_run_dir(run_dir, resume=False, overwrite=False)
    msg = str(e.value)
    assert "\n" not in msg and str(run_dir) in msg and "a stopped run" in msg and "metrics.jsonl" in msg
    for fix in ("experiment.name", "resume=true", "experiment.overwrite=true", "delete the folder"):
        assert fix in msg, fix
    assert _contents(run_dir) == files
    assert claim_run_dir(run_dir, resume=True, overwrite=False) == []                 # resume: continues what is there
    assert _contents(run_dir) == files


def test_overwrite_deletes_the_earlier_outputs_but_not_the_held_lock_and_contradicts_resume(tmp_path, caplog):
    from rlhf_orch.run_dir import claim_run_dir
    run_dir = tmp_path / "exp"
    _earlier_run(run_dir)
    (tmp_path / "elsewhere").mkdir()
    (run_dir / "link").symlink_to(tmp_path / "elsewhere")        # a link is removed, never what it points at
    with RunLock(run_dir, "exp"), caplog.at_level(logging.WARNING, logger="rlhf_orch.run_dir"):
        deleted = claim_run_dir(run_dir, resume=False, overwrite=True)
        assert deleted == ["checkpoints", "link", "metrics.jsonl", "plots", "summary.json"]
        assert [p.name for p in run_dir.iterdir()] == [LOCK_NAME]
        assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == os.getpid()   # still ours
    assert "experiment.overwrite=true" in caplog.text and str(run_dir) in caplog.text
    assert (tmp_path / "elsewhere").is_dir()
    with pytest.raises(ConfigError, match="experiment.overwrite.*resume=true"):
        claim_run_dir(run_dir, resume=True, overwrite=True)


def _launch(tmp_path, *overrides):
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    import launch
    return launch, lambda: launch.main(["--config", str(root / "configs/tiny_cpu.yaml"),
                                        f"experiment.output_dir={tmp_path}", "experiment.name=again", *overrides])


def test_launch_refuses_a_fresh_run_over_a_finished_one_before_ray(tmp_path, capsys):
    import ray
    run_dir = tmp_path / "again"
    files = _earlier_run(run_dir)
    _, main = _launch(tmp_path)
    rc = main()
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert rc == 2 and len(err) == 1, err
    assert str(run_dir) in err[0] and "a finished run" in err[0] and "resume=true" in err[0]
    assert "experiment.overwrite=true" in err[0]
    assert not ray.is_initialized(), "no actor may start over an earlier run's outputs"
    assert _contents(run_dir) == files                           # metrics, summary, plots, checkpoints untouched
    RunLock(run_dir, "again").acquire().release()                # the refused run let the folder go


def test_launch_with_overwrite_or_resume_reaches_the_run_with_the_folder_as_promised(tmp_path, monkeypatch):
    """The run itself stubbed: overwrite=true starts it in an emptied folder, resume=true with everything in place."""
    run_dir = tmp_path / "again"
    files = _earlier_run(run_dir)
    launch, _ = _launch(tmp_path)
    seen = []
    monkeypatch.setattr(launch, "_supervise", lambda cfg, rd, *a: seen.append((cfg.resume, _contents(rd))) or 0)
    assert _launch(tmp_path, "resume=true")[1]() == 0
    resume, contents = seen.pop()
    assert resume and {k: v for k, v in contents.items() if k != LOCK_NAME} == \
        {k: v for k, v in files.items() if k != LOCK_NAME}
    assert _launch(tmp_path, "experiment.overwrite=true")[1]() == 0
    resume, contents = seen.pop()
    assert not resume and list(contents) == [LOCK_NAME]          # only this run's lock: the earlier outputs are gone
    assert [p.name for p in run_dir.iterdir()] == [LOCK_NAME]
