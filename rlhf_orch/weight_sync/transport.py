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

Implementations, one file each:
- ipc_stream.py: colocated engines. The trainer's ring buffers are opened once (CUDA IPC, or shared memory on CPU)
  and buckets are handed over through a shared-memory mailbox, on the host or through CUDA events.
- broadcast.py: dedicated engines. One collective group holds trainer rank 0 and every engine worker (NCCL, or gloo
  on CPU).
weight_sync/plan.py names one transport per engine. A new transport (RDMA, NIXL) is one more file with a `SendSide`
and a `ReceiveSide`, its rule in plan.py, and its setup call in the coordinator.
This module defines the interface only.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable

from rlhf_orch.weight_sync.buckets import BucketLayout

if TYPE_CHECKING:   # an annotation only: receiver.py imports the transports, so a plain import would be a cycle
    from rlhf_orch.weight_sync.receiver import WeightReceiver

Check = Callable[[], None]   # raises SyncAborted once another member aborted this sync (abort.py)


class SendSide(ABC):
    """One transport's part of one trainer rank's sender. Shares the sender's ring of SLOTS buffers."""

    name: str

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

    name: str

    @abstractmethod
    def receive(self, rx: "WeightReceiver", sync_id: int, verify: bool) -> tuple[list[int], dict[str, float]]:
        """Take every bucket of sync `sync_id` and load it (rx.load_bucket); returns (checksums of what the engine
        holds, in layout order, and seconds by phase). With `verify` and the trainer's checksums at hand, raises
        WeightSyncError on the first difference (rx.compare)."""

    def abort(self) -> None:
        """Tell the sender this side gives up on the sync under way (it stops waiting at once)."""

    def close(self) -> None:
        """Leave the transport (a re-plan, or the engine shuts down)."""
