"""Issue #33's last case: a survivor whose receive cannot be interrupted is still inside an aborted sync when the
coordinator's grace runs out. The driver replaces it as a hung engine (driver/recovery.py `hung_after_abort`), and the
rollout manager kills the engine's own processes before the actor (actors/common.py `kill_descendants`: vLLM's engine
core outlives a killed actor, seen on the GPUs). Real processes here; the replacement path itself is the one the
integration tests of dead and hung engines run."""
import subprocess
import sys
import time

from actors.common import kill_descendants
from driver.recovery import hung_after_abort


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie is dead, only not reaped yet
    except FileNotFoundError:
        return False


def test_kill_descendants_kills_every_process_below_not_the_process_itself():
    """A chain like a rollout actor's: the actor (`top`), vLLM's engine core (`mid`), a process of its own (`leaf`)."""
    leaf = "import time; time.sleep(60)"
    mid = (f"import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {leaf!r}]); "
           "print(os.getpid(), p.pid, flush=True); time.sleep(60)")
    top = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {mid!r}]); time.sleep(60)"
    actor = subprocess.Popen([sys.executable, "-c", top], stdout=subprocess.PIPE, text=True)
    try:
        core, grandchild = map(int, actor.stdout.readline().split())
        assert kill_descendants(actor.pid) == [core, grandchild]   # the actor itself stays: Ray kills it
        deadline = time.monotonic() + 10
        while (_alive(core) or _alive(grandchild)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(core) and not _alive(grandchild) and actor.poll() is None
    finally:
        actor.kill()
        actor.wait(timeout=10)


def test_engines_still_inside_an_aborted_sync_are_declared_hung_not_trainer_ranks():
    abort = {"version": 4, "culprit": "c", "still_waiting": ["d", "trainer rank 0", "gone"]}
    hung = hung_after_abort(abort, {"d": object(), "e": object()})
    assert list(hung) == ["d"] and "hung" in hung["d"] and "v4" in hung["d"]
    assert hung_after_abort(None, {"d": 1}) == {} and hung_after_abort({**abort, "still_waiting": []}, {"d": 1}) == {}
