"""Where DeepSpeed's JIT-built ops go, and what to do about a build lock left by a killed process.

DeepSpeed builds some ops on first use (on CPU: `deepspeed_shm_comm`, the shared-memory allreduce) through
torch.utils.cpp_extension, into $TORCH_EXTENSIONS_DIR/<op>/. That build is guarded by torch's FileBaton: a file
named `lock` in the op's folder, created with O_EXCL and deleted when the build ends. A process killed during
the build leaves the file behind, and every later run then waits on it forever (FileBaton.wait spins while the
file exists). The file holds no owner, so staleness is decided from the outside:

  a lock is stale when it is older than `grace_s` AND no process on this machine has it open (the builder keeps
  the O_EXCL file descriptor open for the whole build) or runs in the op's folder (ninja and the compiler run
  with that folder as their working directory).

The age grace covers what this machine cannot see: a build on another node sharing the folder over a network
file system (grace SHARED_FS_GRACE_S there), or one by a process whose open files this user may not read (another
user's). On a local disk the owner check is exact (the lock is created and opened in one O_EXCL call), so the grace
is only LOCAL_GRACE_S: a run restarted right after a killed build must not hang on its lock.

This module only decides and removes; it never builds. It imports neither Ray nor DeepSpeed (versions are read
from the installed package metadata, so the driver pays no DeepSpeed import).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = "lock"              # torch.utils.cpp_extension: FileBaton(os.path.join(build_directory, 'lock'))
LOCAL_GRACE_S = 2.0             # a lock younger than this is left alone even when no owner is seen here
SHARED_FS_GRACE_S = 300.0       # ... on a network file system, where the owner may be on another node
SHARED_FS = ("nfs", "nfs4", "cifs", "smb", "smbfs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
             "fuse.sshfs", "fuse.glusterfs", "fuse.ceph", "fuse.juicefs", "fuse.gcsfuse", "fuse.s3fs", "9p", "virtiofs")
CPU_OPS = ("deepspeed_shm_comm",)   # what DeepSpeed JIT-builds for a CPU (gloo) trainer


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def default_extensions_dir(base: str | os.PathLike | None = None) -> Path:
    """~/.cache/rlhf_orch/torch_extensions/ds<deepspeed>-torch<torch>-py<XY>: a build is private to the versions
    that made it, so upgrading DeepSpeed or torch (or switching a CPU wheel for a CUDA one) never loads an old .so."""
    base = Path(base) if base is not None else Path.home() / ".cache" / "rlhf_orch" / "torch_extensions"
    tag = f"ds{_version('deepspeed')}-torch{_version('torch')}-py{sys.version_info.major}{sys.version_info.minor}"
    return base / tag


def extensions_dir(environ=None) -> Path:
    """TORCH_EXTENSIONS_DIR when the user set it, else the versioned default."""
    environ = os.environ if environ is None else environ
    given = environ.get("TORCH_EXTENSIONS_DIR")
    return Path(given) if given else default_extensions_dir()


def _lock_users(lock: Path) -> list[str]:
    """'pid N (name)' of every process on this machine that may own `lock`: it has the file open, or it runs
    in the lock's folder (processes this user may not inspect are left to the age grace)."""
    import psutil

    folder, target = os.path.realpath(lock.parent), os.path.realpath(lock)
    users = []
    for proc in psutil.process_iter(["pid", "name"]):
        if proc.pid == os.getpid():
            continue
        try:
            cwd = os.path.realpath(proc.cwd())
            if cwd == folder or cwd.startswith(folder + os.sep):
                users.append(f"pid {proc.pid} ({proc.info['name']}, working in the build folder)")
                continue
            if any(os.path.realpath(f.path) == target for f in proc.open_files()):
                users.append(f"pid {proc.pid} ({proc.info['name']}, holds the lock open)")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        except psutil.AccessDenied:   # another user's (or a sandbox's init): it could not have made our folder's lock
            continue
    return users


def default_grace_s(path: str | os.PathLike) -> float:
    """LOCAL_GRACE_S, or SHARED_FS_GRACE_S when `path` is on a network file system (other nodes may build there)."""
    import psutil
    real, best, fstype = os.path.realpath(path), "", ""
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint.rstrip(os.sep) or os.sep
        if (real == mp or real.startswith(mp.rstrip(os.sep) + os.sep)) and len(mp) > len(best):
            best, fstype = mp, part.fstype
    return SHARED_FS_GRACE_S if fstype in SHARED_FS else LOCAL_GRACE_S


def lock_state(lock: Path, grace_s: float | None = None, now: float | None = None) -> tuple[bool, str]:
    """(stale, why) for an existing build lock; grace_s None: default_grace_s of its folder."""
    if grace_s is None:
        grace_s = default_grace_s(lock.parent)
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False, "gone"
    if age < grace_s:
        return False, f"{age:.0f}s old, younger than {grace_s:.0f}s"
    users = _lock_users(lock)
    if users:
        return False, "in use by " + ", ".join(users[:3])
    return True, f"{age:.0f}s old and no process on this machine holds it or builds in its folder"


def clear_stale_locks(root: str | os.PathLike, grace_s: float | None = None) -> list[Path]:
    """Remove the stale `<root>/<op>/lock` files (warning with each path); returns the removed ones."""
    root = Path(root)
    removed = []
    if not root.is_dir():
        return removed
    for lock in sorted(root.glob(f"*/{LOCK_NAME}")):
        stale, why = lock_state(lock, grace_s)
        if not stale:
            logger.debug("build lock %s kept: %s", lock, why)
            continue
        try:
            lock.unlink()
        except FileNotFoundError:   # its owner finished meanwhile, or another process cleared it
            continue
        logger.warning("removed the stale build lock %s (%s; left by a killed build, it would make every later "
                       "run wait forever)", lock, why)
        removed.append(lock)
    return removed


def is_built(root: str | os.PathLike, op: str) -> bool:
    """Whether `<root>/<op>/` holds a built shared library."""
    return any((Path(root) / op).glob("*.so"))


def note_first_build(root: str | os.PathLike, device: str) -> list[str]:
    """Log, before the actors start, the ops the trainer will compile because none is built here yet."""
    ops = [op for op in (CPU_OPS if device == "cpu" else ()) if not is_built(root, op)]
    for op in ops:
        logger.info("compiling DeepSpeed's %s (first run on this machine, about 30-60 s) into %s", op, Path(root) / op)
    return ops


def prepare_extensions_dir(device: str, environ=None) -> Path:
    """The driver's step before Ray: fix TORCH_EXTENSIONS_DIR in `environ` (actors inherit it), clear stale
    locks, and say when a first build is coming."""
    environ = os.environ if environ is None else environ
    root = extensions_dir(environ)
    environ["TORCH_EXTENSIONS_DIR"] = str(root)
    clear_stale_locks(root)
    note_first_build(root, device)
    return root
