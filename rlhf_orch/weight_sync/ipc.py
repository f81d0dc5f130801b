"""Zero-copy handles to a bucket buffer for a process on the same device (the `ipc` transport).

On CPU a buffer lives in shared memory (torch's `file_system` sharing strategy) and its handle is the
few hundred bytes `ForkingPickler` produces; the receiver maps the same pages. This is the CPU twin
of CUDA IPC and exercises the same protocol in CI. On CUDA the handle is torch's CUDA IPC handle of
the buffer's storage, re-pointed at the receiver's index of the same physical GPU (the two processes
may see it under different indices when CUDA_VISIBLE_DEVICES differs).

Handles are opened once per buffer and cached by buffer id, because a sync reuses the same two
buffers every time (opening a CUDA IPC handle costs ~1 ms). This module does not decide when a
buffer may be reused: the sender waits for the receiver's acknowledgement (see sender.py).

`ipc_events` and `open_event` make CUDA events that two processes on one GPU share, so that one side's host can
poll whether the other side's queued work is done on the device (the GPU hand-over, mailbox.py) without either
host waiting for its own GPU.
"""
from __future__ import annotations

import io
import os
import pickle
import uuid
from dataclasses import dataclass

import torch
import torch.multiprocessing as tmp
from multiprocessing.reduction import ForkingPickler


@dataclass(frozen=True)
class IpcHandle:
    buffer_id: str
    device: str       # "cpu" or "cuda"
    payload: bytes    # pickled handle; opened by `open_handle`
    device_uuid: str = ""


def as_handle(obj) -> IpcHandle:
    """An IpcHandle from itself or from the dict a msgpack transport (vLLM's collective_rpc) makes of one."""
    return IpcHandle(**obj) if isinstance(obj, dict) else obj


def allocate_shared(nbytes: int, device: torch.device) -> tuple[str, torch.Tensor]:
    """A uint8 buffer another process on `device` can map; returns (buffer_id, tensor)."""
    if device.type == "cpu":
        tmp.set_sharing_strategy("file_system")   # a named file in /dev/shm, not an fd to pass around
        buf = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return uuid.uuid4().hex, buf


_UNLINKED: list[torch.Tensor] = []   # buffers whose name is gone: never freed (torch's free would unlink again)


def unlink_shared(buf: torch.Tensor) -> None:
    """Remove a CPU shared buffer's name from /dev/shm, for a process about to be killed. The name goes when the
    last process using the buffer frees it, but Ray kills the actors at a run's end, so every run left its sender's
    buffers in /dev/shm. The buffer is kept alive until the process ends: freeing it would make torch unlink the
    name again, which aborts the process. Processes that mapped it keep their pages. CPU only (CUDA has no name)."""
    if buf.device.type != "cpu" or not buf.is_shared():
        return
    name = buf.untyped_storage()._share_filename_cpu_()[1]   # the name it already has
    try:
        os.unlink("/dev/shm/" + name.decode().lstrip("/"))
    except FileNotFoundError:
        return
    _UNLINKED.append(buf)


_SHM_MANAGER_STARTED = False


def start_shm_manager() -> None:
    """Start torch's shared-memory manager (a child process, started at the first CPU shared allocation) now, if it
    has not started yet. Call before opening sockets that must close when this process leaves them: the child
    inherits every descriptor open when it starts, so a gloo group made earlier would stay open in it after we
    abandon the group, and the group's other members would wait for their timeout (collective.py)."""
    global _SHM_MANAGER_STARTED
    if not _SHM_MANAGER_STARTED:
        allocate_shared(1, torch.device("cpu"))
        _SHM_MANAGER_STARTED = True


def export_handle(buffer_id: str, buf: torch.Tensor) -> IpcHandle:
    if buf.device.type == "cpu":
        tmp.set_sharing_strategy("file_system")
        out = io.BytesIO()
        ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump(buf)
        return IpcHandle(buffer_id, "cpu", out.getvalue())
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(buf)
    dev_uuid = str(torch.cuda.get_device_properties(buf.device).uuid)
    return IpcHandle(buffer_id, "cuda", pickle.dumps((rebuild, args)), dev_uuid)


def _local_cuda_index(dev_uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == dev_uuid:
            return i
    raise RuntimeError(f"GPU {dev_uuid} is not visible in this process (CUDA_VISIBLE_DEVICES); "
                       "an ipc engine must see the trainer's GPU")


def open_handle(handle: IpcHandle) -> torch.Tensor:
    if handle.device == "cpu":
        tmp.set_sharing_strategy("file_system")
        return pickle.loads(handle.payload)
    rebuild, args = pickle.loads(handle.payload)
    args = list(args)
    args[6] = _local_cuda_index(handle.device_uuid)   # reduce_tensor's arg 6 is the device index
    return rebuild(*args)


EVENT_HANDLE_BYTES = 64   # sizeof(cudaIpcEventHandle_t)


def ipc_events(n: int, device: torch.device) -> tuple[list[torch.cuda.Event], list[bytes]]:
    """`n` interprocess events on `device` and their handles. An event is recorded on the creator's stream only;
    another process opens the handle and polls (`query`) the latest record. Not a stream wait there: that never
    ends if the creator is killed before its record runs (bench/device/probe_ipc_event_kill.py)."""
    with torch.cuda.device(device):
        events = [torch.cuda.Event(interprocess=True) for _ in range(n)]
        handles = [bytes(e.ipc_handle()) for e in events]
    for h in handles:
        if len(h) != EVENT_HANDLE_BYTES:
            raise RuntimeError(f"a CUDA IPC event handle has {len(h)} bytes, expected {EVENT_HANDLE_BYTES}")
    return events, handles


def open_event(handle: bytes, device: torch.device) -> torch.cuda.Event:
    return torch.cuda.Event.from_ipc_handle(device, handle)
