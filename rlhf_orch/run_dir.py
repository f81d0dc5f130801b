"""Where a run writes, and one run per run folder.

`resolve_output_dir`: under `ray job submit --working-dir .` the driver's cwd is Ray's temporary copy of the
working dir (`.../runtime_resources/working_dir_files/...`), deleted with the job's runtime env. A relative
`experiment.output_dir` there would put metrics and checkpoints where nobody finds them, so in a Ray job it
resolves under `$RLHF_ORCH_OUTPUT_DIR`, else `~/rlhf_orch_runs`; left at its default, in a folder named by the job's
submission id (`job_output_override`), so jobs of one config never share a run folder. Outside a Ray job a relative path stays relative
to the cwd, as it always was; an absolute path is never changed. Pure: env and cwd are passed in.

`RunLock`: `<run_dir>/.run.lock`, an flock held for the driver's whole life (the in-process restart loop keeps
it). The kernel drops it when the owner dies, SIGKILL included, so a killed driver's lock is stale at once and the
next run (`resume=true`) takes it over with a warning naming the old owner. A second live run of the same
experiment.name and output_dir fails before Ray starts. The file holds the owner's host, pid and start time, for
the messages only. Does not decide whether a run resumes or starts fresh (launch.py / the config do).

`claim_run_dir`: every run gets its own folder. A fresh run (resume=false) in a folder that already holds an earlier
run's outputs (finished, stopped, failed or killed) is refused before Ray starts, naming the folder and the fixes;
`experiment.overwrite=true` deletes those outputs first instead. resume=true continues the run in the folder.
Called with the lock held, so no other run can write there in between.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from rlhf_orch.config.loader import apply_override, read_yaml
from rlhf_orch.config.schema import ExperimentSection
from rlhf_orch.errors import ConfigError

logger = logging.getLogger(__name__)

OUTPUT_ENV = "RLHF_ORCH_OUTPUT_DIR"
DEFAULT_JOB_ROOT = "~/rlhf_orch_runs"
# Set by Ray's job supervisor (ray/dashboard/modules/job/job_supervisor.py, _get_driver_env_vars) on the
# entrypoint's environment only: {"runtime_env": ..., "metadata": {"job_submission_id": ...}}. Ray 2.60.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
LOCK_NAME = ".run.lock"


def upload_records(store, run_dir: Path) -> None:
    """The run's records (everything in its folder but the checkpoints and the lock) to `store`'s root
    (rlhf_orch/storage.Store): after each checkpoint and at the end of the run."""
    store.put_tree(Path(run_dir), "", skip=("checkpoints", LOCK_NAME), hashes=False)


def ray_job_id(env: dict, cwd: str) -> str | None:
    """The submission id when this process is a `ray job submit` driver, else None. Either sign is enough: the job
    supervisor's env var, or a cwd inside a Ray runtime-env folder (what `--working-dir` does)."""
    raw = env.get(RAY_JOB_ENV)
    if raw:
        try:
            meta = json.loads(raw).get("metadata") or {}
        except (ValueError, AttributeError):
            meta = {}
        return str(meta.get("job_submission_id") or "unknown")
    parts = Path(cwd).parts
    if "runtime_resources" in parts and "working_dir_files" in parts[parts.index("runtime_resources"):]:
        return "unknown"
    return None


def resolve_output_dir(output_dir: str, env: dict, cwd: str) -> tuple[str, str | None]:
    """(the output_dir to use, why it differs or None). Changes only a relative path inside a Ray job."""
    if os.path.isabs(os.path.expanduser(output_dir)):
        return output_dir, None
    job = ray_job_id(env, cwd)
    if job is None:
        return output_dir, None
    root = env.get(OUTPUT_ENV) or DEFAULT_JOB_ROOT
    src = f"${OUTPUT_ENV}" if env.get(OUTPUT_ENV) else DEFAULT_JOB_ROOT
    home = env.get("HOME") or os.path.expanduser("~")
    root = os.path.join(home, root[2:]) if root.startswith("~/") else (home if root == "~" else root)
    if not os.path.isabs(root):   # a relative RLHF_ORCH_OUTPUT_DIR would land in Ray's copy again
        raise ConfigError(f"{OUTPUT_ENV}={root!r} is relative; in a Ray job the cwd is Ray's temporary copy of the "
                          "working dir: set it to an absolute path")
    resolved = os.path.normpath(os.path.join(root, output_dir))
    return resolved, (f"Ray job {job}: the cwd ({cwd}) is Ray's copy of the working dir, so the relative "
                      f"experiment.output_dir {output_dir!r} resolves under {src} ({root})")


def job_output_override(config_path, overrides: list[str], env: dict, cwd: str) -> tuple[str | None, str | None]:
    """(an `experiment.output_dir=...` override to append, why) before the config is loaded: loading creates the
    output folder (config/checks.py), which must not happen in Ray's copy of the working dir. (None, None) when
    nothing changes; problems in the file or overrides are left to load_config to report."""
    job = ray_job_id(env, cwd)
    if job is None:
        return None, None
    raw = read_yaml(config_path) if config_path else {}
    for ov in overrides:
        try:
            apply_override(raw, ov)
        except (ValueError, TypeError, AttributeError):
            pass
    exp = raw.get("experiment")
    output_dir = exp.get("output_dir") if isinstance(exp, dict) else None
    default = output_dir is None
    if default:
        output_dir = ExperimentSection.model_fields["output_dir"].default
    if not isinstance(output_dir, str):
        return None, None
    out, why = resolve_output_dir(output_dir, env, cwd)
    if why and default and job != "unknown":
        # Each job its own folder unless the user named one: two submissions of one config (or the README's
        # command sent twice) must not meet in one run folder (the second was refused, issue #31).
        out = os.path.join(out, job)
        why += f", in a folder of this job's own ({job}; name experiment.output_dir to choose one)"
    return (f"experiment.output_dir={json.dumps(out)}", why) if why else (None, None)


def _owner(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(owner: dict) -> str:
    if not owner:
        return "another process"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
    return f"pid {owner.get('pid')} on host {owner.get('host')} (started {started})"


class RunLock:
    """`with RunLock(run_dir, name):` holds the run folder. Raises ConfigError when a live run holds it."""

    def __init__(self, run_dir: str | Path, name: str):
        self.run_dir, self.name = Path(run_dir), name
        self.path = self.run_dir / LOCK_NAME
        self.fd: int | None = None
        self.took_over: dict | None = None   # the owner of a stale lock this one replaced

    def acquire(self) -> "RunLock":
        import fcntl
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)   # O_CLOEXEC by default: Ray's children do not hold it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(
                    f"experiment.name: run folder {self.run_dir} is in use by {_describe(_owner(self.path))}; "
                    f"two runs of the same name would overwrite each other's metrics and checkpoints. Use another "
                    f"experiment.name (or experiment.output_dir), or wait for that run to end (then resume=true "
                    f"continues it)") from None
            # A filesystem without flock (some network/FUSE mounts): say so and go on unguarded.
            logger.warning("cannot lock %s (%s): nothing stops a second run of %r from sharing this folder",
                           self.path, e.strerror or e, self.name)
            return self
        self.fd = fd
        old = _owner(self.path)
        if old.get("pid"):   # written by a run that never released it: killed (SIGKILL, OOM, node loss)
            self.took_over = old
            logger.warning("run folder %s: taking over the lock of %s, which is gone (killed?)", self.run_dir,
                           _describe(old))
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        import fcntl
        try:
            os.ftruncate(self.fd, 0)   # empty: released cleanly (a later run does not warn)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def earlier_outputs(run_dir: str | Path) -> list[str]:
    """Names of what an earlier run left in `run_dir` (everything but the lock file), sorted; [] for no folder."""
    try:
        return sorted(p.name for p in Path(run_dir).iterdir() if p.name != LOCK_NAME)
    except FileNotFoundError:
        return []


def _earlier_status(run_dir: Path) -> str:
    """'a finished run', 'a stopped run', ... from its summary.json; 'an earlier run' when there is none."""
    status = _owner(run_dir / "summary.json").get("status")   # the same tolerant JSON read as the lock's record
    return f"a {status} run" if isinstance(status, str) and status else "an earlier run"


def claim_run_dir(run_dir: str | Path, resume: bool, overwrite: bool) -> list[str]:
    """Make `run_dir` this run's own before anything is written there; returns the names it deleted (overwrite).
    resume=true: nothing changes (the run continues what is there). resume=false: an empty folder is used as it is;
    one holding an earlier run's outputs raises ConfigError, unless `overwrite`, which deletes them (the lock stays)."""
    run_dir = Path(run_dir)
    if resume:
        if overwrite:
            raise ConfigError("experiment.overwrite: true deletes the run folder's outputs, resume=true continues from "
                              "them; set one of them (resume=true keeps the earlier run)")
        return []
    found = earlier_outputs(run_dir)
    if not found:
        return []
    if not overwrite:
        shown = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "")
        raise ConfigError(
            f"experiment.name: run folder {run_dir} already holds the outputs of {_earlier_status(run_dir)} ({shown}); "
            f"a fresh run (resume=false) would overwrite them. Use another experiment.name (or experiment.output_dir), "
            f"set resume=true to continue that run, or set experiment.overwrite=true (or delete the folder) to replace it")
    for name in found:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    logger.warning("experiment.overwrite=true: deleted the earlier run's outputs in %s (%s)", run_dir, ", ".join(found))
    return found
