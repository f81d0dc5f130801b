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

An ipc engine is fed one of two ways. A *stream* engine (ours: hf, vLLM) opened every buffer once and gave us
its mailbox (`attach_mailbox`): per bucket we publish the bucket's sequence number and checksums into the
mailbox and, before refilling a buffer, wait for the engine's acknowledgement there (microseconds; see
mailbox.py). Any other ipc engine (SGLang) gets each bucket's handle by a call, injected as `deliver`/`wait`
callables: the actor shell uses Ray calls, tests may call a receiver directly. With `bcast_sums`, rank 0
follows the last broadcast bucket with its checksums so broadcast receivers verify themselves.

On CUDA, when every ipc engine of the rank streams, a sync hands buckets over through shared CUDA events
(mailbox.py, "GPU hand-over"): the pack's checksums stay in a device tensor, our event per buffer says when a pack is
done and the engine's when its load from that buffer is, so this host never waits for its own GPU per bucket, only
(by polling) for the engine's load of a buffer it is about to refill. RLHF_ORCH_SYNC_HANDOVER=host keeps the
per-bucket host hand-over (`gpu_handover`, which the benchmark flips per round to compare the two). A source whose
memory is freed after its bucket (ZeRO-3's gathers) must be kept until the pack is done: the trainer's iterator
synchronises before it frees a gathered group.
A sync that another member aborts (abort.py) ends at this side's next wait with `SyncAborted`. Whatever ends a sync
early on rank 0, it leaves its broadcast group at once (collective.py, `abandon`): its sockets close and every
broadcast receiver's pending receive fails now, not at the group's timeout.
This module never imports Ray.
"""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from rlhf_orch.errors import WeightSyncError
from rlhf_orch.types import dtype_from_name
from rlhf_orch.weight_sync.abort import AbortFlag, checker_for
from rlhf_orch.weight_sync.buckets import BucketLayout, _word_sum, checksums, max_bucket_bytes, slot_view
from rlhf_orch.weight_sync.collective import BroadcastGroup
from rlhf_orch.weight_sync.copysum import CopyPlan, PlanCache, Run, as_bytes
from rlhf_orch.weight_sync.ipc import IpcHandle, allocate_shared, export_handle, ipc_events, open_event, unlink_shared
from rlhf_orch.weight_sync.mailbox import DEVICE, HOST, SLOTS, Mailbox, seq_of

Deliver = Callable[[str, object, int, int], object]   # (engine, IpcHandle, bucket index, version) -> token
Wait = Callable[[object], list[int]]                   # token -> engine's checksums for that bucket


@dataclass
class SendResult:
    checksums: list[int] = field(default_factory=list)          # per tensor, layout order
    engine_checksums: dict[str, list[int]] = field(default_factory=dict)   # ipc engines' acks
    bytes: int = 0
    pack_s: float = 0.0
    wait_s: float = 0.0      # time blocked on transfers / acknowledgements
    total_s: float = 0.0


class WeightSender:
    def __init__(self, layouts: Sequence[BucketLayout], device: torch.device, ipc_engines: Sequence[str] = (),
                 group: BroadcastGroup | None = None, verify: bool = True, bcast_sums: bool = False,
                 timeout_s: float = 300.0, abort_flag: AbortFlag | None = None):
        self.layouts = list(layouts)
        self.abort_flag = abort_flag   # the trainer actor aborts a sync through it (abort.py)
        self.device = device
        self.ipc_engines = list(ipc_engines)
        self.group = group
        self.verify = verify
        self.bcast_sums = bool(bcast_sums and verify and group is not None)
        self.timeout_s = float(timeout_s)
        self.mailboxes: dict[str, Mailbox] = {}   # stream engines (attach_mailbox); the rest get calls
        self._plans = PlanCache()   # pack-and-checksum plans by (bucket, buffer), while the tensors stay put
        self._views: dict[tuple, list[torch.Tensor]] = {}   # (bucket, buffer) -> its slots' views
        self._dtypes: dict[int, list[torch.dtype]] = {}
        self.active = bool(self.ipc_engines) or group is not None
        # GPU hand-over with streaming engines (module doc); the benchmark flips it between rounds.
        self.gpu_handover = device.type == "cuda" and os.environ.get("RLHF_ORCH_SYNC_HANDOVER", "device") != "host"
        self._events: list[torch.cuda.Event] | None = None     # ours, one per slot: "bucket packed"
        self._event_handles: list[bytes] = []
        self._peer_events: dict[str, list[torch.cuda.Event]] = {}   # each stream engine's: "slot loaded"
        self._bufs: list[tuple[str, torch.Tensor]] = []
        self._handles = []
        self._pending: list[list] = []
        self._stage: list[tuple[str, torch.Tensor]] = []   # `stage`'s copy of the weights (allocated once)
        self.staged_version: int | None = None
        if self.active:
            n = max_bucket_bytes(self.layouts)
            self._bufs = [allocate_shared(n, device) for _ in range(SLOTS)]
            for _, b in self._bufs:
                b.zero_()   # alignment padding is never written: keep it identical on both sides
            self._handles = [export_handle(bid, b) if self.ipc_engines else None for bid, b in self._bufs]

    def buffer_handles(self) -> list[IpcHandle]:
        """The ring buffers' handles, for engines that stream (opened once by `WeightReceiver.connect_stream`)."""
        return list(self._handles) if self.ipc_engines else []

    def release(self) -> None:
        """The process is about to be killed (the run's end): its CPU ring buffers' names leave /dev/shm, the
        buffers stay mapped until then (ipc.unlink_shared)."""
        for _, buf in self._bufs:
            unlink_shared(buf)

    def attach_mailbox(self, engine: str, handle: bytes) -> None:
        if engine not in self.ipc_engines:
            raise ValueError(f"{engine} is not an ipc engine of this rank")
        box = self.mailboxes[engine] = Mailbox.attach(handle)
        peer = box.events(of_sender=False)   # the receiver made its events when it made the mailbox (CUDA only)
        if self.device.type == "cuda" and peer is not None:
            if self._events is None:
                self._events, self._event_handles = ipc_events(SLOTS, self.device)
            box.put_events(True, self._event_handles)
            self._peer_events[engine] = [open_event(h, self.device) for h in peer]

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
        if self.group is not None:
            self.group.synchronize(check)
        elif self.device.type == "cuda":
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

    def send(self, named: Iterator[tuple[str, torch.Tensor]], version: int,
             deliver: Deliver | None = None, wait: Wait | None = None, sync_id: int = 0) -> SendResult:
        """`sync_id` numbers this sync for stream engines (the coordinator's count, the same on both sides) and for
        aborts (0: a sync no abort can end)."""
        try:
            return self._send(named, version, deliver, wait, sync_id)
        except BaseException as e:
            busy = any(kind == "bcast" and not tok.is_completed() for p in self._pending for kind, _, tok in p)
            for p in self._pending:
                p.clear()
            traceback.clear_frames(e.__traceback__)   # the failed frames' locals hold works too
            if self.group is not None:   # rank 0: free every broadcast receiver now (module doc)
                group, self.group = self.group, None
                group.abandon(busy)
            raise

    def _send(self, named, version: int, deliver: Deliver | None, wait: Wait | None, sync_id: int) -> SendResult:
        check = checker_for(self.abort_flag, sync_id, "trainer rank")
        called = [e for e in self.ipc_engines if e not in self.mailboxes]
        res = SendResult(engine_checksums={e: [] for e in called})
        t_start = time.perf_counter()
        if not self.active:
            for _ in named:   # ZeRO-3 ranks must still take part in every gather
                pass
            return res
        if called and (deliver is None or wait is None):
            raise ValueError("ipc engines without a mailbox need deliver and wait callables")
        deadline = time.monotonic() + self.timeout_s
        # Per buffer: broadcast work, ipc tokens, stream acks. Held by the sender so that a failed sync drops them
        # (`send`): a gloo work keeps the group's sockets open, and the receivers waiting.
        pending = self._pending = [[] for _ in range(SLOTS)]
        on_device = (self.gpu_handover and bool(self.mailboxes) and not called
                     and all(e in self._peer_events for e in self.mailboxes))
        stream = torch.cuda.current_stream(self.device) if on_device else None
        what = "{} loading bucket {} (its event)"
        dev_sums = None
        if on_device and self.verify:
            dev_sums = torch.zeros(sum(len(lay.slots) for lay in self.layouts), dtype=torch.int64, device=self.device)
        for box in self.mailboxes.values():
            box.begin(DEVICE if on_device else HOST)
            box.check = check

        def drain(slot: int):
            t0 = time.perf_counter()
            for kind, engine, token in pending[slot]:
                if kind == "bcast":
                    self.group.wait(token, check)
                elif kind == "stream":
                    self.mailboxes[engine].wait_done(slot, token, deadline, f"{engine} loading bucket {token % (1 << 20) - 1}")
                else:
                    res.engine_checksums[engine].extend(wait(token))
            pending[slot] = []
            res.wait_s += time.perf_counter() - t0

        def refill(slot: int, k: int):
            drain(slot)
            if on_device:
                # The engine has queued its load from this buffer (its `done`); wait until the load itself is done.
                # Polled, not a stream wait: a stream waiting on a killed engine's event would hang for good. Also
                # right for a buffer's first use in a sync: its event then marks the previous sync's last load.
                t0 = time.perf_counter()
                for engine, box in self.mailboxes.items():
                    box.wait_event(self._peer_events[engine][slot], deadline, what.format(engine, k - SLOTS), True)
                res.wait_s += time.perf_counter() - t0

        it = iter(named)
        first = 0   # index of the bucket's first tensor in the flat checksum list
        for layout in self.layouts:
            slot = layout.index % SLOTS
            refill(slot, layout.index)
            buf = self._bufs[slot][1]
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
                self._events[slot].record(stream)   # the engine polls this before it loads the buffer
            elif self.verify:
                sums = self._pack_and_sum(layout, slot, srcs)   # its host read also waits for the copies
                res.checksums.extend(sums)
            else:
                torch._foreach_copy_(self._slot_views(layout, slot), srcs, non_blocking=True)
                if self.ipc_engines:
                    self._sync_device()   # another process reads this buffer: the copies must be done first
            del srcs
            res.pack_s += time.perf_counter() - t0
            res.bytes += layout.nbytes
            if self.group is not None:
                pending[slot].append(("bcast", None, self.group.broadcast(buf[:layout.nbytes], src=0, async_op=True)))
            for engine in self.ipc_engines:
                box = self.mailboxes.get(engine)
                if box is not None:
                    seq = seq_of(sync_id, layout.index)
                    box.publish(slot, seq, first, sums)
                    pending[slot].append(("stream", engine, seq))
                else:
                    pending[slot].append(("ipc", engine, deliver(engine, self._handles[slot], layout.index, version)))
            first += len(layout.slots)
        n = len(self.layouts)     # oldest in-flight bucket first, so acks stay in layout order
        for k in range(SLOTS):
            drain((n + k) % SLOTS)
        _none_left(it)
        if on_device:
            t0 = time.perf_counter()
            if dev_sums is not None:
                res.checksums = dev_sums.tolist()   # the one host wait for our packs
            res.pack_s += time.perf_counter() - t0
            for box in self.mailboxes.values():
                box.publish_final(seq_of(sync_id, len(self.layouts)), res.checksums)
        if self.bcast_sums:
            # Broadcast engines compare each tensor with these before they resume (receiver.py).
            sums_t = torch.tensor(res.checksums, dtype=torch.int64, device=self.device)
            self.group.wait(self.group.broadcast(sums_t, src=0, async_op=True), check)
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

