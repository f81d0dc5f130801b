"""Fate-share a driver-started local Ray with the driver: a SIGKILLed driver must not leave Ray running.

Why: when the driver dies, Ray (2.60, Linux) kills only the processes it started *directly* (gcs_server,
raylet, dashboard, log_monitor, monitor: PR_SET_PDEATHSIG, `_private/services.py::start_ray_process`). The
raylet's children are left to notice by themselves: workers and actors exit within a second or two, but the
DashboardAgent and RuntimeEnvAgent see the raylet gone at once and then block ~60 s publishing that error to
the dead GCS (`_private/process_watcher.py::report_raylet_error_logs` -> `publish_error_to_driver(..., 60)`),
and anything stuck (an actor in native code, a subprocess an actor started) may never go. A restarted run
then shares the machine with the old session's processes.

What it does: `start_watchdog()`, called by the driver right after *it* started a local Ray (never when it
joined a cluster through an address), spawns `python -m driver.watchdog ...`: a small detached process
(own session, so terminal signals and kills aimed at the driver's process group miss it; stdin/stdout on
/dev/null; log `<session>/logs/rlhf_orch_watchdog.log`). It records the processes Ray started
(`_global_node.all_processes`, with their create times), and every 2 s adds their descendants, while it
polls every 0.5 s whether the driver is alive (pid *and* create time, so a reused pid does not count; a
zombie counts as dead). Once the driver is gone it terminates every process of that session -- the
recorded ones still alive, any process of the driver's user that runs a Ray program with the session dir on
its command line or holds a file under the session dir open for writing (Ray retitles agents and workers,
so their command lines no longer name the session, but they all write its logs; the files every *driver*
writes -- python-core-driver-*, events/ -- do not count), and all descendants of those -- with SIGTERM,
then SIGKILL for what is left after 3 s (plus anything that appeared meanwhile), and exits. Measured on a
2-core machine: everything of a tiny_cpu run's session (~27 processes) gone ~5 s after the driver's SIGKILL;
the helper costs ~17 MB and <1% of a core. If instead the session ends while the driver lives
(`ray.shutdown()`: raylet and GCS are gone), it gives the recorded processes 5 s to exit, kills only recorded
ones still there, and exits.

What it does not do: it never signals the driver, pid 1, itself, or processes of other users or other Ray
sessions (a `tail -f` on the session's logs is spared: read-only, and not a Ray program; so is another
driver that attached to this session, unless it descends from a Ray process). It is not started for a
driver that joins a cluster by address (`ray job submit` runs, shared clusters): that Ray is not the
driver's to kill. It does not cover a driver killed while `ray.init` is still starting Ray. It cannot help
if it is itself SIGKILLed, or if the whole machine/container goes (then nothing survives anyway). It does
not clean /tmp/ray/session_* directories. A raylet that crashes while the driver lives leaves its agents to the
driver's own `ray.shutdown()` (and to this process's 5 s rule above).

Alternatives considered: PR_SET_PDEATHSIG only fires for a process's own parent, and Ray's agents and
workers are the raylet's children (the raylet is fate-shared with the driver, its children are not). Ray's
own knobs (`kill_child_processes_on_worker_exit_with_raylet_subreaper`, per-worker process groups) clean up
after a *worker* that exits while the raylet lives, not after the raylet's death; no `ray.init`/_system_config
option was found that fate-shares the raylet's children with the driver. Running ray.init in a separate
process group and killing that group needs someone alive to do the killing. A watcher outside the driver is
the one place that still runs after the driver's SIGKILL.
Set RLHF_ORCH_WATCHDOG=0 to not start it.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

POLL_S = 0.5          # driver liveness check
REFRESH_S = 2.0       # re-learn the descendants of Ray's processes while the driver lives
TERM_GRACE_S = 3.0    # SIGTERM -> SIGKILL
SHUTDOWN_GRACE_S = 5.0
LOG_NAME = "rlhf_orch_watchdog.log"
CTIME_TOLERANCE_S = 1.0   # create times are derived from boot time, which can jitter by a second
_started: dict[str, subprocess.Popen] = {}   # session dir -> helper (kept so it is not reported as leaked)


# ---- driver side --------------------------------------------------------------------------------------
def start_watchdog() -> subprocess.Popen | None:
    """Start the helper for the local Ray this process just started. Never raises: without a watchdog the
    run still works, it only loses the clean-up after a SIGKILL. Returns the helper, or None."""
    if os.environ.get("RLHF_ORCH_WATCHDOG", "1") == "0":
        logger.info("Ray watchdog disabled (RLHF_ORCH_WATCHDOG=0)")
        return None
    try:
        import ray

        node = getattr(ray._private.worker, "_global_node", None)
        if node is None or not ray.is_initialized():
            logger.warning("Ray watchdog not started: no local Ray node in this process")
            return None
        started = {ptype for ptype, infos in node.all_processes.items() if infos}
        if not {"raylet", "gcs_server"} <= started:   # ray.init attached to a running Ray (e.g. one `ray start`ed)
            logger.info("Ray watchdog not started: this process did not start the Ray it is connected to")
            return None
        session_dir = os.path.realpath(node.get_session_dir_path())
        if session_dir in _started and _started[session_dir].poll() is None:
            return _started[session_dir]
        procs = []
        for ptype, infos in node.all_processes.items():
            for info in infos:
                try:
                    procs.append([ptype, info.process.pid, psutil.Process(info.process.pid).create_time()])
                except psutil.Error:
                    pass
        me = psutil.Process()
        cmd = [sys.executable, "-m", "driver.watchdog", "--driver-pid", str(me.pid),
               "--driver-create-time", repr(me.create_time()), "--session-dir", session_dir,
               "--ray-dir", os.path.dirname(os.path.abspath(ray.__file__)), "--processes", json.dumps(procs)]
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        logs = Path(node.get_logs_dir_path())
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / LOG_NAME, "ab") as log:
            helper = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=log, start_new_session=True, close_fds=True)
        _started[session_dir] = helper
        logger.info("Ray watchdog pid %d guards session %s (log: %s)", helper.pid, session_dir, logs / LOG_NAME)
        return helper
    except Exception as e:   # never let the safety net take the run down
        logger.warning("Ray watchdog not started: %s", e)
        return None


# ---- helper side --------------------------------------------------------------------------------------
def _same(proc: psutil.Process, create_time: float) -> bool:
    """`proc` is the process first seen with `create_time` (not a reused pid), alive and not a zombie."""
    try:
        return (abs(proc.create_time() - create_time) <= CTIME_TOLERANCE_S
                and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


class Watchdog:
    def __init__(self, driver_pid: int, driver_ctime: float, session_dir: str, ray_dir: str,
                 processes: list[tuple[str, int, float]]):
        self.driver_pid, self.driver_ctime = driver_pid, driver_ctime
        self.session_dir = os.path.realpath(session_dir).rstrip("/")
        self.session_prefix = self.session_dir + "/"
        self.ray_dir = ray_dir.rstrip("/") + "/"
        self.me = os.getpid()
        try:
            self.uids = {psutil.Process(driver_pid).uids().real}
        except psutil.Error:
            self.uids = {os.getuid()}
        self.known: dict[int, float] = {pid: ct for _, pid, ct in processes}      # pid -> create time
        self.core = [(pid, ct) for t, pid, ct in processes if t in ("raylet", "gcs_server")]

    # -- liveness
    def driver_alive(self) -> bool:
        try:
            return _same(psutil.Process(self.driver_pid), self.driver_ctime)
        except psutil.Error:
            return False

    def core_alive(self) -> bool:
        for pid, ct in self.core:
            try:
                if _same(psutil.Process(pid), ct):
                    return True
            except psutil.Error:
                pass
        return not self.core   # nothing recorded: only the driver's death ends the watch

    # -- finding the session's processes
    def _table(self) -> dict[int, dict]:
        table = {}
        for p in psutil.process_iter(["ppid", "create_time", "status", "uids"]):
            info = p.info
            if info["status"] == psutil.STATUS_ZOMBIE or info["uids"] is None or info["uids"].real not in self.uids:
                continue
            table[p.pid] = {"proc": p, "ppid": info["ppid"], "ct": info["create_time"]}
        return table

    def _descendants(self, table: dict[int, dict], seeds: set[int]) -> set[int]:
        children: dict[int, list[int]] = {}
        for pid, row in table.items():
            children.setdefault(row["ppid"], []).append(pid)
        out, todo = set(), list(seeds)
        while todo:
            pid = todo.pop()
            if pid in out:
                continue
            out.add(pid)
            todo.extend(children.get(pid, []))
        return out

    def _known_alive(self, table: dict[int, dict]) -> set[int]:
        return {pid for pid, ct in self.known.items()
                if pid in table and abs(table[pid]["ct"] - ct) <= CTIME_TOLERANCE_S}

    def refresh(self) -> None:
        """Learn the descendants of the recorded processes (workers, agents, actors' own subprocesses) while
        their parents are alive: once the raylet is gone they are orphans that no tree leads to."""
        table = self._table()
        alive = self._known_alive(table)
        self.known = {pid: self.known[pid] for pid in alive}
        for pid in self._descendants(table, alive):
            self.known.setdefault(pid, table[pid]["ct"])

    def _of_session(self, proc: psutil.Process) -> bool:
        try:
            cmdline = proc.cmdline()
            if any(self.session_dir in a for a in cmdline) and any(self.ray_dir in a for a in cmdline):
                return True
            return any(f.mode != "r" and f.path.startswith(self.session_prefix) and not _driver_file(f.path)
                       for f in proc.open_files())
        except psutil.Error:
            return False

    def protected(self) -> set[int]:
        keep = {1, self.me, *(p.pid for p in psutil.Process(self.me).parents())}
        if self.driver_alive():
            keep.add(self.driver_pid)
        return keep

    def collect(self, scan: bool = True) -> list[psutil.Process]:
        """Live processes of the session: recorded ones, (scan) those that name or write the session dir,
        and all their descendants."""
        table = self._table()
        keep = self.protected()
        seeds = self._known_alive(table)
        if scan:
            seeds |= {pid for pid, row in table.items() if pid not in keep and self._of_session(row["proc"])}
        return [table[pid]["proc"] for pid in sorted(self._descendants(table, seeds) - keep)]

    # -- killing
    def _signal(self, procs: list[psutil.Process], sig: int) -> None:
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass

    def terminate(self, scan: bool = True) -> list[psutil.Process]:
        """SIGTERM the session, SIGKILL what is left after TERM_GRACE_S; returns survivors (normally none)."""
        targets = self.collect(scan)
        if not targets:
            logger.info("no process of %s left", self.session_dir)
            return []
        logger.info("terminating %d processes of %s: %s", len(targets), self.session_dir, _describe(targets))
        self._signal(targets, signal.SIGTERM)
        _, alive = psutil.wait_procs(targets, timeout=TERM_GRACE_S)
        pids = {p.pid for p in alive}
        alive += [p for p in self.collect(scan) if p.pid not in pids]   # spawned meanwhile, or missed
        if alive:
            logger.info("SIGKILL %d processes: %s", len(alive), _describe(alive))
            self._signal(alive, signal.SIGKILL)
            _, alive = psutil.wait_procs(alive, timeout=TERM_GRACE_S)
        left = [p for p in alive if _running(p)]
        if left:
            logger.warning("still alive after SIGKILL: %s", _describe(left))
        else:
            logger.info("all processes of %s are gone", self.session_dir)
        return left

    def run(self) -> int:
        logger.info("watching driver pid %d for Ray session %s (%d recorded processes)", self.driver_pid,
                    self.session_dir, len(self.known))
        if not self.driver_alive():
            logger.warning("driver pid %d already gone at start", self.driver_pid)
        last_refresh = 0.0
        while self.driver_alive():
            if not self.core_alive():
                return self._after_shutdown()
            if time.monotonic() - last_refresh >= REFRESH_S:
                self.refresh()
                last_refresh = time.monotonic()
            time.sleep(POLL_S)
        logger.info("driver pid %d is gone: cleaning up its Ray session", self.driver_pid)
        return 1 if self.terminate() else 0

    def _after_shutdown(self) -> int:
        """Raylet and GCS are gone while the driver lives: Ray was shut down (or crashed). Let the recorded
        processes exit on their own; if the driver dies meanwhile (its SIGKILL takes the raylet at the same
        instant), do the full clean-up."""
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        while time.monotonic() < deadline:
            if not self.driver_alive():
                logger.info("driver pid %d is gone: cleaning up its Ray session", self.driver_pid)
                return 1 if self.terminate() else 0
            if not self.collect(scan=False):
                logger.info("Ray session %s ended while the driver lives; nothing to do", self.session_dir)
                return 0
            time.sleep(POLL_S)
        logger.warning("Ray session %s ended but some of its processes did not exit", self.session_dir)
        return 1 if self.terminate(scan=False) else 0


def _driver_file(path: str) -> bool:
    """A file every process attached to the session writes, drivers included (another driver connected to
    this session is someone's program, not part of Ray: it is not killed for writing these)."""
    name = os.path.basename(path)
    return (name.startswith("python-core-driver-")
            or os.path.basename(os.path.dirname(path)) in ("events", "export_events"))


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid}:{p.name()}")
        except psutil.Error:
            out.append(f"{p.pid}:?")
    return ", ".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Kill a local Ray session once the driver that started it is gone.")
    ap.add_argument("--driver-pid", type=int, required=True)
    ap.add_argument("--driver-create-time", type=float, required=True)
    ap.add_argument("--session-dir", required=True)
    ap.add_argument("--ray-dir", required=True, help="Ray's package directory (its programs' paths start with it)")
    ap.add_argument("--processes", default="[]", help='JSON [[type, pid, create_time], ...] of what Ray started')
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s watchdog[{os.getpid()}]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C meant for the driver is not for us
    try:
        return Watchdog(args.driver_pid, args.driver_create_time, args.session_dir, args.ray_dir,
                        [tuple(p) for p in json.loads(args.processes)]).run()
    except Exception:
        logger.exception("watchdog failed")
        return 2


if __name__ == "__main__":
    sys.exit(main())
