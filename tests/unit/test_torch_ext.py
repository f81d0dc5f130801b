"""DeepSpeed's op build folder is private to the installed versions; a build lock left by a killed process is
removed with a warning, a live one is left alone (rlhf_orch/torch_ext.py)."""
import logging
import os
import signal
import subprocess
import sys
from importlib import metadata

from torch.utils.file_baton import FileBaton

from rlhf_orch import torch_ext

HOLD = ("import sys, time\nfrom torch.utils.file_baton import FileBaton\n"
        "b = FileBaton(sys.argv[1])\nassert b.try_acquire()\nprint('held', flush=True)\ntime.sleep(300)\n")


def _holder(lock, **kw):
    """A real process that takes the lock exactly as torch.utils.cpp_extension does, then sleeps mid-'build'."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True, **kw)
    assert p.stdout.readline().strip() == "held"
    return p


def test_default_folder_names_the_versions_and_the_user_setting_wins(tmp_path):
    d = torch_ext.default_extensions_dir(tmp_path)
    assert d.parent == tmp_path
    assert d.name.startswith(f"ds{metadata.version('deepspeed')}-torch{metadata.version('torch')}-py")
    assert torch_ext.extensions_dir({}) == torch_ext.default_extensions_dir()
    assert torch_ext.extensions_dir({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) == tmp_path
    env = {}
    assert torch_ext.prepare_extensions_dir("cuda", env) == torch_ext.default_extensions_dir()
    assert env["TORCH_EXTENSIONS_DIR"] == str(torch_ext.default_extensions_dir())


def test_lock_of_a_killed_build_is_removed_with_a_warning(tmp_path, caplog):
    op = tmp_path / "deepspeed_shm_comm"
    op.mkdir()
    lock = op / "lock"
    p = _holder(lock)
    try:
        stale, why = torch_ext.lock_state(lock, grace_s=0)
        assert not stale and f"pid {p.pid}" in why and "holds the lock open" in why   # the live owner is seen
        assert torch_ext.clear_stale_locks(tmp_path, grace_s=0) == [] and lock.exists()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert lock.exists()                          # what a killed build leaves behind
    assert not FileBaton(str(lock)).try_acquire()   # ... and what every later build would wait on forever
    assert not torch_ext.lock_state(lock, grace_s=3600)[0]   # younger than a shared file system's grace: left alone
    assert torch_ext.default_grace_s(lock.parent) == torch_ext.LOCAL_GRACE_S   # tmp is local: the owner check is exact
    with caplog.at_level(logging.WARNING, logger="rlhf_orch.torch_ext"):
        assert torch_ext.clear_stale_locks(tmp_path, grace_s=0) == [lock]
    assert not lock.exists()
    assert any("removed the stale build lock" in r.getMessage() and str(lock) in r.getMessage() for r in caplog.records)
    baton = FileBaton(str(lock))
    assert baton.try_acquire()                    # the next build proceeds
    baton.release()


def test_a_process_working_in_the_build_folder_keeps_the_lock(tmp_path):
    op = tmp_path / "op"
    op.mkdir()
    lock = op / "lock"
    lock.write_text("")
    old = lock.stat().st_mtime - 3600
    os.utime(lock, (old, old))
    worker = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(300)"],
                              cwd=op, stdout=subprocess.PIPE, text=True)   # stands in for ninja / c++
    try:
        assert worker.stdout.readline().strip() == "up"
        stale, why = torch_ext.lock_state(lock, grace_s=60)
        assert not stale and "working in the build folder" in why
    finally:
        worker.kill()
        worker.wait()
    stale, why = torch_ext.lock_state(lock, grace_s=60)
    assert stale and "no process on this machine" in why


def test_first_build_is_announced_only_while_no_library_is_built(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="rlhf_orch.torch_ext"):
        assert torch_ext.note_first_build(tmp_path, "cpu") == ["deepspeed_shm_comm"]
    assert any("compiling DeepSpeed's deepspeed_shm_comm (first run on this machine, about 30-60 s)" in r.getMessage()
               for r in caplog.records)
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    assert torch_ext.note_first_build(tmp_path, "cpu") == []
    assert torch_ext.note_first_build(tmp_path / "empty", "cuda") == []   # nothing is JIT-built for a cuda trainer here


def test_a_network_file_system_gets_the_long_grace(tmp_path, monkeypatch):
    import psutil
    real = psutil.disk_partitions(all=True)
    nfs = type(real[0])(**{**real[0]._asdict(), "mountpoint": str(tmp_path), "fstype": "nfs4"})   # a seam: no NFS here
    monkeypatch.setattr(psutil, "disk_partitions", lambda all=False: [*real, nfs])
    assert torch_ext.default_grace_s(tmp_path / "op") == torch_ext.SHARED_FS_GRACE_S
    lock = tmp_path / "op" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    assert not torch_ext.lock_state(lock)[0]   # it may be another node's build in progress
