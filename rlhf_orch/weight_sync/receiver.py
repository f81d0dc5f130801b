"""Engine side of a sync: take every bucket over the worker's transport and load it into the model.

A `WeightReceiver` lives in every engine worker (the HF engine's one process, or each vLLM/SGLang worker). It knows
the bucket layouts from init, so the wire carries only raw buckets. Loading and checksumming are injected by the
engine (`load_fn(list[(name, tensor)])`, `checksum_fn(names)`), so one receiver serves every engine kind. How the
bytes arrive is its transport's business (transport.py): a colocated worker streams from its trainer rank's ring
buffers (ipc_stream.py), a dedicated one takes rank 0's broadcasts (broadcast.py). Either way setup is
`open(transport, spec)` then `connect(offer)`, whatever the transport, and a sync is one call, `receive`, and where
the trainer's checksums travel with the buckets (always over ipc; over broadcast when every receiver of the group
checks) each tensor is compared with them here, so an engine never resumes generating with weights nobody checked.

A sync that another member aborts (abort.py: the flag's owner writes the sync's number) ends at this side's next
wait, with `SyncAborted`; a broadcast receiver then leaves its group without blocking (collective.py, `abandon`).
The engine stays paused after any failed sync (the actor's `sync_weights`), so a half-loaded version is never served:
the next verified sync, with the replacement of the member that died, ends the pause.

The checksums returned are of what the engine holds after loading (its own parameters), not of the
received bytes: a load that silently skips or mangles a tensor shows up as a mismatch. With a `LoadReplay`
(replay.py), a bucket whose loader is plain copies is loaded by one fused copy-and-checksum pass after its first
sync, and its checksums are of the engine's parameters even where the engine fuses tensors (vLLM's qkv).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from rlhf_orch.errors import WeightSyncError
from rlhf_orch.weight_sync.abort import AbortFlag, checker_for
from rlhf_orch.weight_sync.buckets import BucketLayout, checksums, unpack
from rlhf_orch.weight_sync.collective import BroadcastGroup
from rlhf_orch.weight_sync.replay import LoadReplay
from rlhf_orch.weight_sync.transport import ReceiveSide
from rlhf_orch.weight_sync.transports import sides

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]
ChecksumFn = Callable[[list[str]], list[int]]


class ReceivedSums:
    """`load_fn` and `checksum_fn` for an engine whose loader we call but whose parameters have no per-tensor twin
    (vLLM and SGLang fuse q/k/v): the checksums are of the tensors the last load received, taken from views into
    the bucket before the next bucket overwrites it. `sums` keeps every tensor's latest."""

    def __init__(self, load: LoadFn):
        self._load = load
        self._views: dict[str, torch.Tensor] = {}
        self.sums: dict[str, int] = {}

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            self._load(named)
        self._views = dict(named)

    def checksums(self, names: list[str]) -> list[int]:
        missing = [n for n in names if n not in self._views]
        if missing:
            raise RuntimeError(f"checksums asked for tensors not in the last load: {missing[:5]}")
        sums = checksums(self._views[n] for n in names)
        self.sums.update(zip(names, sums))
        self._views = {}   # views alias a receive buffer that the next bucket overwrites
        return sums


class WeightReceiver:
    """One engine worker's receiving end: the bucket layouts, the engine's load and checksum functions, and the
    transport its sync plan gave it (`open` and `connect`: setup's handshake, transport.py)."""

    def __init__(self, layouts: Sequence[BucketLayout], device: torch.device, load_fn: LoadFn,
                 checksum_fn: ChecksumFn | None = None, replay: LoadReplay | None = None):
        self.layouts = list(layouts)
        self.device = device
        self.load_fn = load_fn
        self.checksum_fn = checksum_fn
        self.replay = replay
        self.last_sums: dict[str, int] = {}   # the latest verified checksum of every tensor
        self.names = [name for lay in self.layouts for name in lay.names]   # the flat checksum list's order
        self.firsts = [0]             # index of each bucket's first tensor in the flat checksum list
        for lay in self.layouts:
            self.firsts.append(self.firsts[-1] + len(lay.slots))
        self.transport: ReceiveSide | None = None
        self.abort_flag: AbortFlag | None = None   # the owner (the engine's actor) aborts a sync through it

    @property
    def group(self) -> BroadcastGroup | None:
        """The broadcast group this worker is in, if its transport is broadcast (and no failed sync left it)."""
        return getattr(self.transport, "group", None)

    def open(self, transport: str, spec: dict, timeout_s: float) -> float:
        """Setup's first round (transport.py): open this worker's side of `transport` from its spec, leaving the side
        of an earlier plan first; returns seconds taken (a broadcast group's rendezvous and warm-up)."""
        t0 = time.perf_counter()
        self.close()
        self.transport = sides(transport)[1].open(spec, self, timeout_s)
        return time.perf_counter() - t0

    def connect(self, offer: Any) -> Any:
        """Setup's second round: the sender's offer -> this side's answer (ipc: the rank's ring buffers' handles -> our
        mailbox's handle; broadcast: None -> None)."""
        if self.transport is None:
            raise RuntimeError("connect before open")
        return self.transport.connect(offer)

    def receive(self, sync_id: int, verify: bool = True) -> tuple[list[int], dict[str, float]]:
        """Take every bucket of sync `sync_id` over this worker's transport (0: a sync no abort can end); returns the
        checksums of what the engine now holds, and seconds by phase. Raises on a checksum that differs."""
        if self.transport is None:
            raise RuntimeError("receive before the transport was opened (setup)")
        return self.transport.receive(self, sync_id, verify)

    def abort_stream(self) -> None:
        """Tell the sender this sync will not be taken (it stops waiting at once; a broadcast sender learns it from
        the coordinator's abort instead)."""
        if self.transport is not None:
            self.transport.abort()

    def checker(self, sync_id: int):
        return checker_for(self.abort_flag, sync_id, "engine")

    def load_bucket(self, layout: BucketLayout, buf: torch.Tensor, verify: bool,
                    out: torch.Tensor | None = None) -> list[int] | None:
        """Load one bucket; its checksums, or None where they went to `out` on the device (a replayed bucket)."""
        if self.replay is not None:
            sums = self.replay.load(layout, buf, self.load_fn, out=out if verify else None)
        else:
            self.load_fn(list(unpack(layout, buf)))
            sums = None
        if not verify:
            return []
        if sums is True:
            return None
        if sums is None:
            if self.checksum_fn is None:
                return []
            sums = self.checksum_fn(layout.names)
        self.last_sums.update(zip(layout.names, sums))
        return sums

    def compare(self, got: list[int], want: list[int], first: int, how: str) -> None:
        if got != want:
            names = self.names[first:first + len(got)]
            bad = [n for n, g, w in zip(names, got, want) if g != w][:5]
            raise WeightSyncError(f"weights received by {how} differ from the trainer's (checksums); first "
                                  f"differing tensors: {bad}")

    def set_replay(self, enabled: bool) -> None:
        """Switch load replay on or off for later syncs (the benchmark compares both in one run)."""
        if self.replay is not None:
            self.replay.enabled = bool(enabled)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
