"""The weight-transport seam: one interface for every way a trainer rank's packed buckets reach engines.

Every sync runs one protocol, whatever carries the bytes (sender.py and receiver.py drive it):

    trainer rank: WeightSender, one per rank               engine worker: WeightReceiver, one per worker
    begin(sync_id, check, deadline, on_device)             receive(rx, sync_id, verify):
    per bucket k, into ring buffer slot = k % SLOTS:           every bucket in layout order, each loaded through
        drain(slot), refill_wait(slot, k)   (slot is free)     rx.load_bucket; where the transport carries the
        ... the sender packs the bucket ...                    trainer's checksums each tensor is compared with
        post(slot, layout, first, sums)     (start moving it)  them (rx.compare) before the engine may resume
    drain() of every slot still in flight                  abort(): the sender stops waiting at once
    finish(sync_id, n_buckets, checksums)                  close()
    on any failure: abandon()

Setup is one handshake too, the same for every transport, in three rounds (the coordinator runs it):

    1. open, on every side at once:   SendSide.open(spec, ...)       ReceiveSide.open(spec, rx, ...)
       (a collective group's rendezvous needs every member joining together; ipc's sender allocates its buffers)
    2. the receiver connects:         offer = side.offer()    ->     answer = side.connect(offer)
       (ipc: the offer is the ring buffers' handles, the answer the engine's mailbox; broadcast: None and None)
    3. the sender accepts:            side.accept(engine, answer)

What each side opens with is its `spec`, a plain dict made from the plan by the transport itself (`SendSide.specs`),
so it crosses Ray, vLLM's collective_rpc and SGLang's scheduler requests unchanged: the actors and engines carry
(transport name, spec, offer, answer) without knowing what is inside.

Implementations, one file each:
- ipc_stream.py: colocated engines. The trainer's ring buffers are opened once (CUDA IPC, or shared memory on CPU)
  and buckets are handed over through a shared-memory mailbox, on the host or through CUDA events.
- broadcast.py: dedicated engines. One collective group holds trainer rank 0 and every engine worker (NCCL, or gloo
  on CPU).
weight_sync/plan.py names one transport per engine; transports.py lists them by name. A new transport (RDMA, NIXL)
is one more file with a `SendSide` and a `ReceiveSide`, its line in transports.py and its rule in plan.py.
This module defines the interface only.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import torch

from rlhf_orch.weight_sync.buckets import BucketLayout

if TYPE_CHECKING:   # annotations only: receiver.py imports the transports, so a plain import would be a cycle
    from rlhf_orch.weight_sync.plan import EngineRoute
    from rlhf_orch.weight_sync.receiver import WeightReceiver

Check = Callable[[], None]   # raises SyncAborted once another member aborted this sync (abort.py)


@dataclass
class PlanFacts:
    """What a transport's `specs` may use besides its routes: the group backend ("nccl" on CUDA, "gloo" on CPU),
    whether syncs are verified, which engines compare their loads with the trainer's checksums themselves over their
    transport (`checks`), and, for a transport with a rendezvous, the sending rank's (host, port)."""

    backend: str
    verify: bool
    checks: dict[str, bool] = field(default_factory=dict)
    address: tuple[str, int] | None = None


def for_worker(spec: dict, k: int) -> dict:
    """Worker `k` of an engine's spec: a spec's `rank`, where it has one (a group member's), is the engine's first
    worker's, and worker k takes rank + k."""
    return {**spec, "rank": int(spec["rank"]) + int(k)} if "rank" in spec else dict(spec)


class SendSide(ABC):
    """One transport's part of one trainer rank's sender. Shares the sender's ring of SLOTS buffers."""

    name: ClassVar[str]
    rendezvous: ClassVar[bool] = False   # its sides open together at an address of the sending rank's node
    # Its peers read the sender's buffers themselves once a bucket is posted (ipc), so a bucket handed over on the host
    # must be packed on the device first; a collective (broadcast) is ordered after the pack by its stream instead.
    peers_read_buffers: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def specs(cls, routes: Sequence["EngineRoute"], facts: PlanFacts) -> tuple[dict[int, dict], dict[str, dict]]:
        """The plan's routes of this transport -> ({trainer rank: its send spec}, {engine: its receive spec}). A receive
        spec with `hold: True` marks an engine whose loads the coordinator checks (it resumes the engine after)."""

    @classmethod
    @abstractmethod
    def open(cls, spec: dict, bufs: list[tuple[str, torch.Tensor]], device: torch.device, verify: bool,
             timeout_s: float) -> "SendSide":
        """Round 1 of setup, while the receivers open theirs: this rank's side over the sender's ring buffers."""

    def offer(self) -> Any:
        """Round 2: what every receiver of this side connects with (must pickle)."""
        return None

    def accept(self, engine: str, answer: Any) -> None:
        """Round 3: `engine` connected and answered."""

    @property
    def alive(self) -> bool:
        """False once a failed sync made this side unusable (the coordinator opens a new one)."""
        return True

    def synchronize(self, check: Check | None = None) -> bool:
        """Wait until this side's device work is done; False where it has none of its own (the sender then waits for
        the device itself)."""
        return False

    def device_handover(self) -> bool:
        """Whether every peer of this side can take buckets handed over on the device (CUDA events, no host wait per
        bucket). The sender hands a sync over on the device when one side can; every other side must work with it
        (the broadcast does: NCCL orders each collective after the pack queued before it on the stream)."""
        return False

    @abstractmethod
    def begin(self, sync_id: int, check: Check, deadline: float, on_device: bool) -> None:
        """A new sync: `check` raises once it is aborted; no wait may outlast `deadline` (time.monotonic)."""

    @abstractmethod
    def post(self, slot: int, layout: BucketLayout, first: int, sums: list[int]) -> None:
        """Bucket `layout` is packed in buffer `slot` (on the device: queued, with the sender's event recorded): start
        moving it. Its tensors' checksums start at flat index `first` ([] when they stay on the device)."""

    @abstractmethod
    def drain(self, slot: int) -> None:
        """Wait until everything this side started from buffer `slot` is done (the sender may refill it)."""

    def refill_wait(self, slot: int, bucket: int) -> None:
        """On the device only: wait until the peers' loads from `slot` (of bucket `bucket - SLOTS`) are done."""

    def finish(self, sync_id: int, n_buckets: int, checksums: list[int]) -> None:
        """After the last bucket was drained: hand the peers what they need to check the whole sync."""

    def abandon(self) -> None:
        """The sync failed on this rank: drop what is in flight and free the peers now, not at their deadline."""

    def close(self) -> None:
        """The sender is replaced (a re-plan) or the process ends."""


class ReceiveSide(ABC):
    """One transport's part of one engine worker's receiver."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def open(cls, spec: dict, rx: "WeightReceiver", timeout_s: float) -> "ReceiveSide":
        """Round 1 of setup, while the sender opens its side."""

    def connect(self, offer: Any) -> Any:
        """Round 2: the sender's offer -> this side's answer (must pickle)."""
        return None

    @classmethod
    def watch(cls, answer: Any) -> Callable[[], None] | None:
        """From another process of the engine (an actor whose receiver runs in SGLang's scheduler): a call that fails
        the sync under way, as `abort` would, while the receiving process is busy; None where the sender waits on
        nothing this side answered."""
        return None

    @abstractmethod
    def receive(self, rx: "WeightReceiver", sync_id: int, verify: bool) -> tuple[list[int], dict[str, float]]:
        """Take every bucket of sync `sync_id` and load it (rx.load_bucket); returns (checksums of what the engine
        holds, in layout order, and seconds by phase). With `verify` and the trainer's checksums at hand, raises
        WeightSyncError on the first difference (rx.compare)."""

    def abort(self) -> None:
        """Tell the sender this side gives up on the sync under way (it stops waiting at once)."""

    def close(self) -> None:
        """Leave the transport (a re-plan, or the engine shuts down)."""
