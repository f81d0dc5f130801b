"""Helpers shared by the weight-sync unit tests (bit-exact comparisons, specs, child-process cleanup, a sender and
colocated receivers streaming in one process)."""
import itertools
import threading

import torch

from rlhf_orch.types import ParamSpec
from rlhf_orch.weight_sync.abort import AbortFlag

HOST = "127.0.0.1"
CPU = torch.device("cpu")
CHILD_TIMEOUT_S = 60.0     # generous: only reached when something is broken
GROUP_TIMEOUT_S = 30.0


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as uint8, for bit-exact comparisons (distinguishes -0.0 from 0.0, NaN payloads)."""
    return t.detach().contiguous().view(-1).view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, what: str = ""):
    assert a.dtype == b.dtype, what
    assert tuple(a.shape) == tuple(b.shape), what
    assert torch.equal(raw_bytes(a), raw_bytes(b)), what


def spec(name, dtype, *shape) -> ParamSpec:
    return ParamSpec(name, dtype, tuple(shape))


def stop_children(procs, timeout=5.0):
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def ipc_spec(*engines: str) -> dict:
    """A sender's specs for a rank streaming to `engines` (ipc_stream.py)."""
    return {"ipc": {"engines": list(engines)}}


def group_spec(port: int, world_size: int, sums: bool = False, backend: str = "gloo", rank: int | None = None) -> dict:
    """One member's broadcast spec (broadcast.py): rank 0's without `rank`, a receiver's with it."""
    spec = {"backend": backend, "host": HOST, "port": port, "world_size": world_size, "sums": sums}
    return spec if rank is None else {**spec, "rank": rank}


def connect_ipc(sender, name: str, recv, timeout_s: float = CHILD_TIMEOUT_S) -> None:
    """Setup's handshake for one colocated receiver in this process: open, connect with the offer, accept."""
    recv.open("ipc", {}, timeout_s)
    sender.accept("ipc", name, recv.connect(sender.offers()["ipc"]))


def in_process_streams(sender, receivers: dict, timeout_s: float = CHILD_TIMEOUT_S, verify: bool = True):
    """Connect `receivers` ({engine name: WeightReceiver} in this process) to `sender` as colocated streams; returns
    `sync(named)`, which sends while one thread per receiver takes the sync, and gives (the sender's result,
    {engine: its checksums, or the error it raised}). A failing send aborts the receives, as the coordinator would."""
    for name, recv in receivers.items():
        if recv.abort_flag is None:
            recv.abort_flag = AbortFlag.private()
        connect_ipc(sender, name, recv, timeout_s)
    ids = itertools.count(1)

    def sync(named):
        sync_id, got = next(ids), {}

        def take(name, recv):
            try:
                got[name] = recv.receive(sync_id, verify)[0]
            except BaseException as e:   # the engine's side of a failed sync, for the test to look at
                got[name] = e

        threads = [threading.Thread(target=take, args=item) for item in receivers.items()]
        for t in threads:
            t.start()
        try:
            return sender.send(named, sync_id, sync_id=sync_id), got
        except BaseException:
            for recv in receivers.values():
                recv.abort_flag.abort(sync_id)
            raise
        finally:
            for t in threads:
                t.join(timeout_s)
            assert not any(t.is_alive() for t in threads), "a receiver did not end with its sync"

    return sync
