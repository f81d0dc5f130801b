"""A broadcast group of trainer rank 0 plus every receiving engine worker, outside the default group.

The group is built directly on a `TCPStore` (hosted by the sender, rank 0) as a standalone
`ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (CUDA), so it never touches the trainer's own
torch.distributed world nor the engines' internal groups. One group serves every engine: each engine
worker is one rank, so fan-out is one collective that NCCL pipelines, not one send per engine.

The store keys follow the chain torch's own `new_group` builds (`PrefixStore(name)` -> `name + "/"` ->
`"cuda/"` or `"cpu/"`, distributed_c10d.py `_new_process_group_helper`), which is also what SGLang's
`init_weights_update_group` builds on its side: an engine that joins with its own torch code (SGLang)
finds the NCCL id where it looks, so vLLM workers, hf engines and SGLang schedulers share one group.

`warmup()` runs one small broadcast (8 uint8 ones: the dtype SGLang's flat receive buffer has) right
after creation on every rank: the first collective on a fresh communicator pays connection setup
(~1.5 s for NCCL), which must not land inside a timed sync.
A sync that another member aborts (abort.py) must not sit in a collective until the group's timeout: `wait` and
`synchronize` take a check that raises, and poll (gloo: the work's completion; CUDA: an event) instead of blocking;
`abandon` then leaves the group without blocking. Measured on torch 2.13: a gloo `abort()` does nothing and dropping
a gloo group whose receive is pending blocks until the peer goes (its destructor joins the worker threads first), so
such a group is dropped on a daemon thread; when the *sender* drops its group, its sockets close and every receiver's
pending receive fails at once ("Connection closed by peer"), provided no child process inherited the sockets: torch's
shared-memory manager, started at a process's first CPU shared allocation, would keep them open (found by
tests/unit/test_sync_abort.py), so a gloo group starts it first. NCCL's `abort()` ends the communicator's pending
kernels.
This module does not decide what to send (sender.py / receiver.py do).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from rlhf_orch.distributed import free_port, tcp_store
from rlhf_orch.weight_sync.ipc import start_shm_manager

GROUP_NAME = "rlhf_orch_sync"   # the name engines that build their own end (SGLang) must be given
__all__ = ["BroadcastGroup", "GROUP_NAME", "free_port"]   # free_port re-exported: callers pick a port and build the group together

logger = logging.getLogger(__name__)


class BroadcastGroup:
    """Rank 0 broadcasts to ranks 1..world_size-1. Create on every rank concurrently."""

    def __init__(self, backend: str, host: str, port: int, rank: int, world_size: int,
                 timeout_s: float = 300.0, device: torch.device | None = None, local_host: str | None = None,
                 name: str = GROUP_NAME):
        if world_size < 2:
            raise ValueError("a broadcast group needs the sender and at least one receiver")
        if backend not in ("gloo", "nccl"):   # checked before the store, which would block for peers
            raise ValueError(f"unknown backend {backend!r}; use gloo or nccl")
        self.backend, self.rank, self.world_size = backend, rank, world_size
        self.device = device or torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        store = tcp_store(host, port, world_size, rank == 0, timeout)
        chain = dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store))
        self._store = dist.PrefixStore("cuda/" if backend == "nccl" else "cpu/", chain)
        if backend == "gloo":
            start_shm_manager()   # before our sockets exist, or it would hold them open (ipc.py)
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            iface = os.environ.get("GLOO_SOCKET_IFNAME")
            # Bind to this process's own address (or the interface the operator chose), not the master's.
            dev = (dist.ProcessGroupGloo.create_device(interface=iface) if iface
                   else dist.ProcessGroupGloo.create_device(hostname=local_host or host))
            opts._devices = [dev]
            self.pg = dist.ProcessGroupGloo(self._store, rank, world_size, opts)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            # Opt-in, not shown to pay (bench/RESULTS.md, tenth session: 1B 9.5 against 10.0 ms, one process each,
            # within the spread between processes): NCCL's kernels on a high-priority stream, so the block scheduler
            # gives them SMs before the pack's and load's copy kernels that run beside every bucket's broadcast.
            opts.is_high_priority_stream = os.environ.get("RLHF_ORCH_SYNC_NCCL_PRIORITY", "normal") == "high"
            torch.cuda.set_device(self.device)
            self.pg = dist.ProcessGroupNCCL(self._store, rank, world_size, opts)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        work = self.pg.broadcast([tensor], opts)
        if async_op:
            return work
        work.wait()
        return None

    def wait(self, work, check: Callable[[], None] | None = None) -> None:
        """Wait for an async collective. With `check` (raises to end the wait), the work is polled (gloo: its
        completion; NCCL: its end event on the GPU), so an aborted sync ends within a millisecond even where the peer
        never sends. Without `check`, NCCL's `wait()` only orders the current stream after the collective.
        Why NCCL is polled too: a receiver's next host read (a bucket's checksums) would otherwise block in CUDA on a
        broadcast that never comes, deaf to the abort, until the group's watchdog takes the whole process down
        (a vLLM engine core, on 2x H100, 2026-11-28: bench/RESULTS.md)."""
        if check is not None:
            spins = 0   # yield the GIL for the first 100 polls, then sleep 0.2 ms between polls
            while not work.is_completed():
                check()
                spins += 1
                time.sleep(0 if spins < 100 else 2e-4)
        work.wait()   # raises the work's own error (a peer that went away)

    def synchronize(self, check: Callable[[], None] | None = None) -> None:
        """Wait until this process's queued device work (the collectives and loads) is done; polled with `check`."""
        if self.device.type != "cuda":
            return
        if check is None:
            torch.cuda.synchronize(self.device)
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        while not done.query():
            check()
            time.sleep(1e-4)

    def abandon(self, busy: bool = True) -> None:
        """Leave the group now, without waiting for pending collectives (a failed or aborted sync): NCCL aborts the
        communicator; gloo drops the group (which closes its sockets, so the other members' pending operations fail
        instead of waiting for their timeout), on a daemon thread if `busy` (an operation of ours may still be
        pending: dropping the group waits for it, module doc). The group cannot be used again; the coordinator makes
        a new one (`reconfigure`)."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        if self.backend == "nccl":
            try:
                pg.abort()
            except Exception:  # already torn down by a failed peer
                logger.debug("nccl abort failed", exc_info=True)
            return
        if not busy:
            return   # dropped here, now
        held = [pg]
        del pg
        threading.Thread(target=held.clear, name="rlhf_orch-abandon-group", daemon=True).start()

    def warmup(self) -> float:
        """One small collective on every rank; returns the value seen (rank 0 sends ones)."""
        t = torch.full((8,), 1 if self.rank == 0 else 0, dtype=torch.uint8, device=self.device)
        self.broadcast(t)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if float(t[0]) != 1.0:
            raise RuntimeError("broadcast warm-up returned the wrong value")
        return float(t[0])

    def destroy(self) -> None:
        # Dropping the references closes the communicator; abort() exists only on some backends.
        abort = getattr(self.pg, "abort", None)
        if callable(abort) and self.backend == "nccl":
            try:
                abort()
            except Exception:  # already torn down by a failed peer
                logger.debug("nccl abort failed", exc_info=True)
        self.pg = None
