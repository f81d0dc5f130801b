"""Trainer side of a sync: pack named tensors into a ring of bucket buffers and send each one; or first stage a
copy of them, so the transfer can overlap the next train step (`stage`, weight_sync.overlap).

The named-tensor iterator must keep each bucket's tensors valid until the first tensor of the next
bucket is requested (`DeepSpeedTrainer.iter_named_tensors(groups)` gathers ZeRO-3 partitions bucket
by bucket for exactly this reason).

One `WeightSender` lives in every trainer rank. Per bucket k it packs into buffer k % SLOTS (mailbox.py:
3 buffers of bucket_size_mb each), then (rank 0, if any engine uses broadcast) starts an asynchronous
broadcast of the bucket and (any rank that shares its device with engines) hands each such engine an IPC
handle of the buffer. Before a buffer is packed again (bucket k + SLOTS) the sender waits for that buffer's
broadcast and for every engine's acknowledgement, so packing runs up to SLOTS - 1 buckets ahead of the
transfers and loads. (A third buffer made colocated syncs 10-13% faster than double buffering on one H200:
the trainer's and the engine's kernels share the GPU, and the deeper ring keeps one side's work queued while
the other hands a bucket over; bench/RESULTS.md, 2026-11-26.)

What happens to a packed bucket is its transports' business (transport.py): `BroadcastSend` (broadcast.py, rank 0
when any engine is dedicated) posts its broadcast, `StreamSend` (ipc_stream.py, a rank that shares its device with
engines) publishes it in every colocated engine's mailbox. Each says when a buffer may be packed again (`drain`) and
what the engines need at the sync's end (`finish`: with the broadcast spec's `sums`, rank 0's checksums as one more
broadcast, so broadcast receivers verify themselves). The sender opens its sides from their specs (transports.py) and
takes part in setup's handshake through `offers` and `accept`; it never names a transport.

On CUDA, when every colocated engine of the rank made events, a sync hands buckets over through shared CUDA events
(ipc_stream.py, mailbox.py "GPU hand-over"): the pack's checksums stay in a device tensor and this host never waits for
its own GPU per bucket, only (by polling) for the engines' loads of a buffer it is about to refill.
RLHF_ORCH_SYNC_HANDOVER=host keeps the per-bucket host hand-over (`gpu_handover`, which the benchmark flips per round
to compare the two). A source whose memory is freed after its bucket (ZeRO-3's gathers) must be kept until the pack is
done: the trainer's iterator synchronises before it frees a gathered group.
A sync that another member aborts (abort.py) ends at this side's next wait with `SyncAborted`. Whatever ends a sync
early, every transport abandons it (`abandon`): rank 0 leaves its broadcast group at once, so every broadcast
receiver's pending receive fails now, not at the group's timeout.
This module never imports Ray.
"""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from rlhf_orch.errors import WeightSyncError
from rlhf_orch.types import dtype_from_name
from rlhf_orch.weight_sync.abort import AbortFlag, checker_for
from rlhf_orch.weight_sync.buckets import BucketLayout, _word_sum, checksums, max_bucket_bytes, slot_view
from rlhf_orch.weight_sync.copysum import CopyPlan, PlanCache, Run, as_bytes
from rlhf_orch.weight_sync.ipc import allocate_shared, unlink_shared
from rlhf_orch.weight_sync.mailbox import SLOTS
from rlhf_orch.weight_sync.transport import SendSide
from rlhf_orch.weight_sync.transports import TRANSPORTS


@dataclass
class SendResult:
    checksums: list[int] = field(default_factory=list)          # per tensor, layout order
    bytes: int = 0
    pack_s: float = 0.0
    wait_s: float = 0.0      # time blocked on transfers / acknowledgements
    total_s: float = 0.0


class WeightSender:
    """`specs`: {transport name: this rank's spec} (transports.py `setup_specs`); each side opens now (a broadcast
    group blocks here until every member joined). None or {}: a rank that sends to no engine (it still takes part in
    ZeRO-3's gathers)."""

    def __init__(self, layouts: Sequence[BucketLayout], device: torch.device, specs: dict[str, dict] | None = None,
                 verify: bool = True, timeout_s: float = 300.0, abort_flag: AbortFlag | None = None):
        self.layouts = list(layouts)
        self.abort_flag = abort_flag   # the trainer actor aborts a sync through it (abort.py)
        self.device = device
        self.verify = verify
        self.timeout_s = float(timeout_s)
        self._plans = PlanCache()   # pack-and-checksum plans by (bucket, buffer), while the tensors stay put
        self._views: dict[tuple, list[torch.Tensor]] = {}   # (bucket, buffer) -> its slots' views
        self._dtypes: dict[int, list[torch.dtype]] = {}
        specs = dict(specs or {})
        self.active = bool(specs)
        # GPU hand-over with colocated engines (module doc); the benchmark flips it between rounds.
        self.gpu_handover = device.type == "cuda" and os.environ.get("RLHF_ORCH_SYNC_HANDOVER", "device") != "host"
        self._bufs: list[tuple[str, torch.Tensor]] = []
        self._stage: list[tuple[str, torch.Tensor]] = []   # `stage`'s copy of the weights (allocated once)
        self.staged_version: int | None = None
        if self.active:
            n = max_bucket_bytes(self.layouts)
            self._bufs = [allocate_shared(n, device) for _ in range(SLOTS)]
            for _, b in self._bufs:
                b.zero_()   # alignment padding is never written: keep it identical on both sides
        # Drained in the table's order (ipc before broadcast).
        self.sides: dict[str, SendSide] = {name: TRANSPORTS[name][0].open(specs[name], self._bufs, device, verify,
                                                                         self.timeout_s)
                                           for name in TRANSPORTS if name in specs}
        unknown = set(specs) - set(self.sides)
        if unknown:
            raise ValueError(f"unknown weight transports {sorted(unknown)}; known: {sorted(TRANSPORTS)}")

    @property
    def group(self):
        """The collective group of a side that has one (rank 0's broadcast), None where none is left."""
        return next((t.group for t in self.sides.values() if getattr(t, "group", None) is not None), None)

    def transports(self) -> list[SendSide]:
        """This rank's transports, in the order they are drained."""
        return list(self.sides.values())

    def offers(self) -> dict[str, Any]:
        """Setup's second round: {transport: what its receivers connect with} (ipc: the ring buffers' handles)."""
        return {name: side.offer() for name, side in self.sides.items()}

    def accept(self, transport: str, engine: str, answer: Any) -> None:
        """Setup's third round: `engine` connected over `transport` and answered (ipc: its mailbox)."""
        if transport not in self.sides:
            raise ValueError(f"{engine} answered over {transport}, which this trainer rank does not send on")
        self.sides[transport].accept(engine, answer)

    def release(self) -> None:
        """The process is about to be killed (the run's end): its CPU ring buffers' names leave /dev/shm, the
        buffers stay mapped until then (ipc.unlink_shared)."""
        for _, buf in self._bufs:
            unlink_shared(buf)

    def close(self) -> None:
        """Leave the transports (a re-plan): rank 0's broadcast group is destroyed."""
        for t in self.transports():
            t.close()
        self.sides = {}

    def _slot_views(self, layout: BucketLayout, slot: int) -> list[torch.Tensor]:
        """Typed views of every tensor's place in ring buffer `slot`, made once (an MoE bucket has ~170 tensors, and
        making the views at every sync cost more than the copy)."""
        views = self._views.get((layout.index, slot))
        if views is None:
            buf = self._bufs[slot][1]
            views = self._views[(layout.index, slot)] = [slot_view(buf, s) for s in layout.slots]
        return views

    def _pack_and_sum(self, layout: BucketLayout, slot: int, srcs: list, out: torch.Tensor | None = None) -> list[int]:
        """Pack one bucket and checksum every tensor in the same pass (copysum.py). Tensors that must change dtype
        on the way are copied by torch and checksummed from the bucket. The plan is cached by the tensors'
        addresses: parameters that stay put (ZeRO-1/2) reuse it at every sync. With `out` (zeroed int64 on the
        device, one per tensor) the sums stay there, nothing waits for the device, and [] is returned."""
        dtypes = self._dtypes.get(layout.index)
        if dtypes is None:
            dtypes = self._dtypes[layout.index] = [dtype_from_name(s.dtype) for s in layout.slots]
        same = [i for i, t in enumerate(srcs) if t.dtype == dtypes[i] and t.is_contiguous()]
        dsts = self._slot_views(layout, slot)
        plan = self._plans.get((layout.index, slot), tuple(srcs[i].data_ptr() for i in same), lambda: CopyPlan(
            [Run(as_bytes(srcs[i]), as_bytes(dsts[i]), i) for i in same], len(layout.slots), self.device))
        rest = sorted(set(range(len(srcs))) - set(same))
        if rest:
            torch._foreach_copy_([dsts[i] for i in rest], [srcs[i] for i in rest], non_blocking=True)
        sums = plan.run(out=out)
        if rest and out is not None:
            out.index_copy_(0, torch.tensor(rest, device=out.device), torch.stack([_word_sum(dsts[i]) for i in rest]))
        elif rest:
            for i, s in zip(rest, checksums(dsts[i] for i in rest)):
                sums[i] = s
        return sums or []

    def _sync_device(self, check=None):
        if not any(t.synchronize(check) for t in self.transports()) and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def stage(self, named: Iterator[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Copy the weights, in the sync's dtypes, into a staging buffer of this sender's own (allocated at the first
        stage, reused after): `send(self.staged(), ...)` then transfers version `version` while the trainer already
        trains the next step (weight_sync.overlap). Costs one copy of the synced weights in memory (`stage_gb`). A
        rank that sends nothing still takes part in ZeRO-3's gathers and stages nothing."""
        t0 = time.perf_counter()
        if not self.active:
            for _ in named:
                pass
            self.staged_version = version
            return {"stage_s": time.perf_counter() - t0, "stage_gb": 0.0}
        fresh = not self._stage
        it = iter(named)
        slots = [s for layout in self.layouts for s in layout.slots]
        for i, s in enumerate(slots):
            t = _pull(it, s)   # the same checks as a send's
            if fresh:
                self._stage.append((s.name, torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device=self.device)))
            self._stage[i][1].copy_(t, non_blocking=True)
        _none_left(it)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # the copy is done before the next train step changes the weights
        self.staged_version = version
        nbytes = sum(t.numel() * t.element_size() for _, t in self._stage)
        return {"stage_s": time.perf_counter() - t0, "stage_gb": nbytes / 2**30}

    def kept_stage(self) -> tuple[list, int | None]:
        """(the staged copy, its version): what a replacement sender adopts (`adopt_stage`)."""
        return self._stage, self.staged_version

    def adopt_stage(self, stage: list, version: int | None) -> None:
        """Keep the staged copy of the sender this one replaces (a re-plan after a fault): the failed overlapped sync
        it belonged to is sent again from it. Kept only where it is whole for this sender's layout."""
        names = [(s.name, tuple(s.shape)) for lay in self.layouts for s in lay.slots]
        if version is not None and (not self.active or [(n, tuple(t.shape)) for n, t in stage] == names):
            self._stage, self.staged_version = (stage if self.active else []), version

    def staged(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The staged weights, to `send` (they stay until the next `stage`: a failed sync is sent again from them)."""
        if self.staged_version is None:
            raise WeightSyncError("send of staged weights without a stage first")
        return iter(self._stage) if self.active else iter(())

    def send(self, named: Iterator[tuple[str, torch.Tensor]], version: int, sync_id: int = 0) -> SendResult:
        """Send weights `version` to every engine this rank feeds. `sync_id` numbers this sync for colocated engines'
        mailboxes (the coordinator's count, the same on both sides) and for aborts (0: a sync no abort can end)."""
        try:
            return self._send(named, sync_id)
        except BaseException as e:
            traceback.clear_frames(e.__traceback__)   # the failed frames' locals hold works too
            for t in self.transports():
                t.abandon()   # rank 0 leaves its broadcast group: every receiver is freed now (module doc)
            self.sides = {name: t for name, t in self.sides.items() if t.alive}
            raise

    def _send(self, named, sync_id: int) -> SendResult:
        check = checker_for(self.abort_flag, sync_id, "trainer rank")
        res = SendResult()
        t_start = time.perf_counter()
        if not self.active:
            for _ in named:   # ZeRO-3 ranks must still take part in every gather
                pass
            return res
        deadline = time.monotonic() + self.timeout_s
        sides = self.transports()
        on_device = self.gpu_handover and any(t.device_handover() for t in sides)
        for t in sides:
            t.begin(sync_id, check, deadline, on_device)
        dev_sums = None
        if on_device and self.verify:
            dev_sums = torch.zeros(sum(len(lay.slots) for lay in self.layouts), dtype=torch.int64, device=self.device)

        def drain(slot: int, bucket: int | None = None):
            t0 = time.perf_counter()
            for t in sides:
                t.drain(slot)
            if bucket is not None:   # about to refill: on the device, the engines' loads from it must be done too
                for t in sides:
                    t.refill_wait(slot, bucket)
            res.wait_s += time.perf_counter() - t0

        it = iter(named)
        first = 0   # index of the bucket's first tensor in the flat checksum list
        for layout in self.layouts:
            slot = layout.index % SLOTS
            drain(slot, layout.index)
            t0 = time.perf_counter()
            # Pull the bucket's tensors, then copy (and checksum) them in one launch. The trainer
            # iterator keeps a bucket's tensors valid until the next bucket is pulled (ZeRO-3 gathers
            # exactly one bucket at a time), so batching is safe and saves a launch per tensor.
            srcs = [_pull(it, s) for s in layout.slots]
            sums: list[int] = []
            if on_device:
                if dev_sums is not None:
                    self._pack_and_sum(layout, slot, srcs, out=dev_sums[first:first + len(layout.slots)])
                else:
                    torch._foreach_copy_(self._slot_views(layout, slot), srcs, non_blocking=True)
            elif self.verify:
                sums = self._pack_and_sum(layout, slot, srcs)   # its host read also waits for the copies
                res.checksums.extend(sums)
            else:
                torch._foreach_copy_(self._slot_views(layout, slot), srcs, non_blocking=True)
                if any(t.peers_read_buffers for t in sides):
                    self._sync_device()   # another process reads this buffer: the copies must be done first
            del srcs
            res.pack_s += time.perf_counter() - t0
            res.bytes += layout.nbytes
            for t in sides:
                t.post(slot, layout, first, sums)
            first += len(layout.slots)
        n = len(self.layouts)     # oldest in-flight bucket first, so acks stay in layout order
        for k in range(SLOTS):
            drain((n + k) % SLOTS)
        _none_left(it)
        if dev_sums is not None:
            t0 = time.perf_counter()
            res.checksums = dev_sums.tolist()   # the one host wait for our packs
            res.pack_s += time.perf_counter() - t0
        for t in sides:
            t.finish(sync_id, n, res.checksums)
        self._sync_device(check)
        res.total_s = time.perf_counter() - t_start
        return res


def _pull(it: Iterator[tuple[str, torch.Tensor]], s) -> torch.Tensor:
    """The trainer's next tensor, checked against layout slot `s`: its name (the parameter order) and its shape."""
    try:
        name, t = next(it)
    except StopIteration:
        raise WeightSyncError(f"trainer yielded fewer tensors than the layout expects (missing {s.name})") from None
    if name != s.name:
        raise WeightSyncError(f"trainer yielded {name!r} where the layout expects {s.name!r}; "
                              "parameter order changed since the plan was made")
    if tuple(t.shape) != s.shape:
        raise WeightSyncError(f"{name}: shape {tuple(t.shape)} does not match the layout's {s.shape}")
    return t


def _none_left(it: Iterator) -> None:
    if next(it, None) is not None:
        raise WeightSyncError("trainer yielded more tensors than the layout expects; re-plan the sync")

