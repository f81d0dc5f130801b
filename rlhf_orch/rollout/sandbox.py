"""A Python code tool for multi-turn rollouts (issue #29): `PythonSandbox` runs the code of a model turn in a fresh,
limited subprocess and answers with what the program printed.

Call: the turn's last block opened by a line "```python" and closed by "```" (an unclosed block is no call). No
block: None (the trajectory ends). An empty block, or code over `max_code_chars`: `ToolError`. Observation:
"<output>\n{stdout}</output>\n" (stdout ends with a newline when not empty), then, only when the program failed,
"<error>\n{one line}\n</error>\n": the uncaught exception as a traceback's last line ("ZeroDivisionError: division
by zero"), else stderr's last line or "exit status N"; or "timed out after T s", "CPU time limit exceeded (N s)",
"killed by signal NAME". stdout over `max_output_chars` keeps its head and tail around a line "[... output truncated:
N bytes in all ...]"; the error line is cut to `max_output_chars`. A timeout, a memory blow-up, a crash or a refused
operation is an observation, never an exception.

What it does: each call has its own temporary folder (root/work: the child's cwd, HOME and TMPDIR; the code and its
output lie in root, outside it; all deleted after the call) and process, `python -I -S -B -u` (no site-packages, no
PYTHON* variables) with a minimal environment, in a new session whose whole group is killed at the end. A preamble
sets rlimits (address space, CPU seconds, file size, processes, open files, no core; hard = soft) and installs a PEP
578 audit hook raising PermissionError for: sockets (every socket.* event but creating an AF_UNIX socket, which
socketpair and asyncio need), subprocess.Popen, os.system/exec*/spawn*/fork/forkpty/posix_spawn, ctypes.*, links,
chdir, signals to other processes, setrlimit, settrace/setprofile and gc's object walks (they would reach the hook's
state); writes (open for writing, remove, rename, mkdir, chmod, ...) outside the working folder; reads (open,
listdir, scandir) outside it, except files (not folders) under the interpreter's own sys.path (the standard library:
imports work) and os.devnull. Where `unshare -rn` (else `unshare --net`) works, probed once per process, the child
also runs in an empty network namespace: the network stays cut even past the hook.

What it does not: it is a guard rail for a model's tool calls during RL training, not a security boundary against a
determined attacker. The hook runs in the code's own interpreter: a program that sets out to game it (path objects
answering differently twice, monkeypatching os so that path resolution lies, native entry points without audit
events; `_posixsubprocess.fork_exec` is stubbed out) can get past the file and process rules. There is no filesystem
namespace (os.stat sees the whole host); each file's size is capped, not the folder's. RLIMIT_NPROC counts all the
user's processes (root is exempt; inside `unshare -rn`'s user namespace only the child's): without that namespace, a
busy non-root user's child may fail to start threads. Without site-packages there is only the standard library.
"""
from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from rlhf_orch.errors import ToolError

logger = logging.getLogger(__name__)

_BLOCK = re.compile(r"```python[^\S\n]*\n(.*?)```", re.DOTALL)

# Runs in the child before the code (argv: the program file, the exception file, the limits). Everything lives in
# functions: the code, which gets a fresh __main__, finds none of the hook's state in a module namespace.
_PREAMBLE = r'''
import builtins, os, resource, sys, traceback, types, _posixsubprocess, _socket

def _sandbox():
    prog, errfile, limits = sys.argv[1], sys.argv[2], [int(v) for v in sys.argv[3:]]
    with open(prog, encoding="utf-8") as f:
        src = f.read()
    err = open(errfile, "w", encoding="utf-8", errors="replace")   # opened before the hook would refuse it
    for res, v in zip((resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE, resource.RLIMIT_NPROC,
                       resource.RLIMIT_NOFILE, resource.RLIMIT_CORE), limits):
        # CPU: the hard limit 1 s later, so SIGXCPU (a clear message) comes before SIGKILL
        resource.setrlimit(res, (v, v + 1 if res == resource.RLIMIT_CPU else v))
    # bound now: the code may rebind os's attributes later
    realpath, isdir, fspath, fsdecode, devnull = os.path.realpath, os.path.isdir, os.fspath, os.fsdecode, os.devnull
    pid, sep, work = os.getpid(), os.sep, os.path.realpath(os.getcwd())
    roots = tuple({realpath(p) for p in sys.path if p})   # -I -S: the stdlib zip, folder and lib-dynload only
    deny = {"subprocess.Popen", "os.system", "os.exec", "os.spawn", "os.fork", "os.forkpty", "os.posix_spawn",
            "pty.spawn", "os.link", "os.symlink", "os.chdir", "resource.setrlimit", "resource.prlimit",
            "sys.settrace", "sys.setprofile", "gc.get_objects", "gc.get_referrers", "gc.get_referents"}
    writes = {"os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.chmod", "os.chown", "os.utime", "os.truncate",
              "os.setxattr", "os.removexattr"}
    wflags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def under(p, dirs):
        return any(p == d or p.startswith(d.rstrip(sep) + sep) for d in dirs)

    def check(event, path, write):
        if isinstance(path, int):   # an fd: open(1, "w") or listdir(fd) use what was already allowed...
            if write and event != "open":   # ...but fchmod on a read-only stdlib fd would still change the file
                raise PermissionError(f"sandbox: {event} on a file descriptor is not allowed")
            return
        p = realpath(fsdecode(fspath("." if path is None else path)))
        if under(p, (work,)) or p == devnull:
            return
        if not write and under(p, roots) and not (event == "open" and isdir(p)):   # no dir fd, no dir_fd tricks
            return
        raise PermissionError(f"sandbox: {'write' if write else 'read'} access to {p!r} is not allowed "
                              "(outside the working folder)")

    def hook(event, args):
        if event in deny or event.startswith("ctypes.") or (
                event.startswith("socket.") and not (event == "socket.__new__" and args[1] == _socket.AF_UNIX)) or (
                event in ("os.kill", "os.killpg") and args[0] not in (0, pid)) or (
                event == "import" and args[0] == "_posixsubprocess"):   # a fresh copy would undo the stub below
            raise PermissionError(f"sandbox: {event}{' ' + args[0] if event == 'import' else ''} is not allowed")
        if event == "open":
            check(event, args[0], (isinstance(args[1], str) and any(c in args[1] for c in "wax+"))
                  or bool((args[2] or 0) & wflags))
        elif event in writes:
            for path in args[:2 if event == "os.rename" else 1]:
                check(event, path, True)
        elif event in ("os.listdir", "os.scandir"):
            check(event, args[0], False)

    # subprocess's raw fork + exec has no audit event of its own: refused as Popen is
    _posixsubprocess.fork_exec = lambda *args: hook("subprocess.Popen", args)
    builtins.exit = builtins.quit = sys.exit   # -S leaves them out; models call exit()
    sys.addaudithook(hook)
    return src, err

def _run(src, err):
    main = types.ModuleType("__main__")
    sys.modules["__main__"], sys.argv = main, ["main.py"]
    try:
        exec(compile(src, "main.py", "exec"), main.__dict__)
    except Exception as e:   # the traceback without this frame; the exception line apart (stderr may end
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)   # with warnings printed at exit)
        err.write(traceback.format_exception_only(type(e), e)[-1] if isinstance(e, SyntaxError)
                  else f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        err.flush()
        sys.exit(1)

_run(*_sandbox())
'''

_netns_lock = threading.Lock()
_netns: list[str] | None = None   # the probed `unshare` prefix ([] where none works), once per process


def netns_prefix() -> list[str]:
    """The command prefix that puts a child in an empty network namespace on this machine, [] if none works (probed
    once; the active layers are logged)."""
    global _netns
    with _netns_lock:
        if _netns is None:
            _netns, exe = [], shutil.which("unshare")
            for flags in (["-rn"], ["--net"]) if exe else ():   # -rn also works unprivileged (a user namespace)
                try:
                    if subprocess.run([exe, *flags, sys.executable, "-I", "-S", "-c", "pass"], timeout=10,
                                      stdin=subprocess.DEVNULL, capture_output=True).returncode == 0:
                        _netns = [exe, *flags]
                        break
                except (OSError, subprocess.SubprocessError):
                    pass
            logger.info("python sandbox: rlimits + audit hook%s", f" + network namespace ({' '.join(_netns)})"
                        if _netns else " (no network namespace: unshare unavailable or not permitted)")
        return _netns


class PythonSandbox:
    """A tool running the turn's last ```python block in a limited subprocess (see the module docstring for the
    call, the observation and the isolation). Safe to call from many threads: every call has its own folder and
    process. `cpu_s` None: ceil(timeout_s) + 1 (the wall clock ends a busy loop first). `use_netns` None: the
    network namespace when `unshare` works here; False: the audit hook alone."""

    def __init__(self, timeout_s: float = 5.0, cpu_s: int | None = None, memory_bytes: int = 512 << 20,
                 max_file_bytes: int = 16 << 20, max_procs: int = 64, max_open_files: int = 64,
                 max_output_chars: int = 512, max_code_chars: int = 8192, use_netns: bool | None = None,
                 python: str = sys.executable):
        self.timeout_s, self.cpu_s = timeout_s, cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1
        self.memory_bytes, self.max_file_bytes, self.max_procs = memory_bytes, max_file_bytes, max_procs
        self.max_open_files, self.max_output_chars = max_open_files, max_output_chars
        self.max_code_chars, self.use_netns, self.python = max_code_chars, use_netns, python

    def __call__(self, turn_text: str) -> str | None:
        blocks = _BLOCK.findall(turn_text)
        if not blocks:
            return None
        code = blocks[-1]
        if not code.strip():
            raise ToolError("python: empty code block")
        if len(code) > self.max_code_chars:
            raise ToolError(f"python: code longer than {self.max_code_chars} characters")
        return self.run(code)

    def run(self, code: str) -> str:
        """The observation for `code` (no parsing, no length check)."""
        prefix = netns_prefix() if self.use_netns is not False else []
        limits = [self.memory_bytes, self.cpu_s, self.max_file_bytes, self.max_procs, self.max_open_files, 0]
        root = tempfile.mkdtemp(prefix="rlhf-sandbox-")
        try:
            work, prog, out, err, exc = (os.path.join(root, n) for n in ("work", "main.py", "out", "err", "exc"))
            os.mkdir(work)
            with open(prog, "w", encoding="utf-8") as f, open(exc, "wb"):   # exc: empty if the child never starts
                f.write(code)
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LC_ALL": "C.UTF-8"}
            argv = [*prefix, self.python, "-I", "-S", "-B", "-u", "-c", _PREAMBLE, prog, exc, *map(str, limits)]
            with open(out, "wb") as fout, open(err, "wb") as ferr:   # files, not pipes: the child's FSIZE caps them
                try:
                    proc = subprocess.Popen(argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=fout,
                                            stderr=ferr, start_new_session=True)
                except OSError as e:
                    raise ToolError(f"python: could not start ({e.strerror})") from e
            deadline, delay = time.monotonic() + self.timeout_s, 0.002
            while not _exited(proc.pid) and (left := deadline - time.monotonic()) > 0:
                time.sleep(min(delay, left))
                delay = min(delay * 2, 0.05)
            timed_out = not _exited(proc.pid)
            try:
                os.killpg(proc.pid, signal.SIGKILL)   # the group, not just the leader: anything it may have started
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            return self._observation(proc.returncode, timed_out, _clip(out, self.max_output_chars),
                                     _error_line(exc, err, self.max_output_chars))
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _observation(self, rc: int, timed_out: bool, stdout: str, error: str) -> str:
        newline = "" if not stdout or stdout.endswith("\n") else "\n"
        text = f"<output>\n{stdout}{newline}</output>\n"
        if timed_out:
            error = f"timed out after {self.timeout_s:g} s"
        elif rc == -signal.SIGXCPU:
            error = f"CPU time limit exceeded ({self.cpu_s} s)"
        elif rc < 0:
            error = f"killed by signal {signal.Signals(-rc).name}"
        elif rc > 0:
            error = error or f"exit status {rc}"
        else:
            return text
        return f"{text}<error>\n{error}\n</error>\n"


def _exited(pid: int) -> bool:
    """Whether the child has exited. WNOWAIT leaves it a zombie: its pid, the group's id, cannot be taken by another
    process before the killpg after it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:   # reaped elsewhere (a SIGCHLD handler): gone all the same
        return True


def _clip(path: str, limit: int) -> str:
    """The file's text, or its head and tail around a marker when over `limit` characters (reads a bounded amount:
    at most 4 bytes a character)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(4 * limit).decode("utf-8", "replace")
        if size <= 4 * limit and len(head) <= limit:
            return head
        f.seek(max(0, size - 4 * limit))
        tail = f.read().decode("utf-8", "replace")
    keep = limit // 2
    tail = tail[max(0, len(tail) - (limit - keep)):]
    return f"{head[:keep]}\n[... output truncated: {size} bytes in all ...]\n{tail}"


def _error_line(exc: str, stderr: str, limit: int) -> str:
    """The exception the preamble caught, on one line, else stderr's last non-empty line (of its last 8 KiB:
    sys.exit("message"), a crash), cut to `limit` characters."""
    with open(exc, "rb") as f:
        text = " ".join(f.read(4 * limit).decode("utf-8", "replace").split())
    with open(stderr, "rb") as f:
        f.seek(max(0, os.path.getsize(stderr) - 8192))
        lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    return (text or (lines[-1] if lines else ""))[:limit]
