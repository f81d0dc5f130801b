"""The `ipc` transport: a trainer rank streams every bucket of a sync to the engines that share its device.

At setup (transport.py's handshake) the rank offers its SLOTS ring buffers' handles; each engine opens them once (CUDA
IPC, or shared memory on CPU: ipc.py) and answers with a mailbox (mailbox.py), which the rank maps (`accept`). Per
bucket the sender publishes the bucket's sequence number and checksums into every engine's mailbox; the engine loads
the bucket straight from the shared buffer, compares each tensor with the trainer's checksum and acknowledges; the
sender waits for that acknowledgement before it refills the buffer. No call per bucket: a sync is one call on each
side.

On CUDA, when every engine of the rank made events, a sync may hand buckets over on the device (mailbox.py, "GPU
hand-over"): the sender records its event per buffer after the pack, the engine polls it before it loads and records
its own after the load, the sender polls that one before it refills, and the checksums stay on the device until the
sync's end (`publish_final`). Neither host waits for its own GPU per bucket.
This module moves no data itself: the buffers are the sender's, the loads the receiver's.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from rlhf_orch.errors import WeightSyncError
from rlhf_orch.weight_sync.ipc import IpcHandle, as_handle, export_handle, ipc_events, open_event, open_handle
from rlhf_orch.weight_sync.mailbox import DEVICE, HOST, SLOTS, Mailbox, seq_of
from rlhf_orch.weight_sync.plan import feeds
from rlhf_orch.weight_sync.transport import PlanFacts, ReceiveSide, SendSide


class StreamSend(SendSide):
    """One trainer rank's streams to its colocated engines (one mailbox each)."""

    name = "ipc"
    peers_read_buffers = True

    def __init__(self, engines: Sequence[str], bufs: list[tuple[str, torch.Tensor]], device: torch.device):
        self.engines = list(engines)
        self.device = device
        self.handles = [export_handle(bid, b) for bid, b in bufs]   # each engine opens them once (`offer`)
        self.mailboxes: dict[str, Mailbox] = {}
        self._events: list[torch.cuda.Event] | None = None     # ours, one per slot: "bucket packed"
        self._event_handles: list[bytes] = []
        self._peer_events: dict[str, list[torch.cuda.Event]] = {}   # each engine's: "slot loaded"
        self._pending: list[list[tuple[str, int]]] = [[] for _ in range(SLOTS)]
        self.sync_id, self.deadline, self.on_device = 0, 0.0, False

    @classmethod
    def specs(cls, routes, facts: PlanFacts) -> tuple[dict[int, dict], dict[str, dict]]:
        """Each rank feeds the engines on its device; the engines compare every tensor with the trainer's checksums
        as they load it (every engine of ours can over ipc: an engine that cannot is refused here)."""
        blind = [r.engine for r in routes if not facts.checks.get(r.engine, True)]
        if blind:   # plan.py gives ipc to single-worker engines only, and every one of ours streams
            raise WeightSyncError(f"engines {blind} were planned ipc but cannot take an ipc stream; set "
                                  "weight_sync.transport: broadcast")
        return ({rank: {"engines": engines} for rank, engines in feeds(routes).items()},
                {r.engine: {} for r in routes})

    @classmethod
    def open(cls, spec: dict, bufs, device: torch.device, verify: bool, timeout_s: float) -> "StreamSend":
        return cls(spec["engines"], bufs, device)

    def offer(self) -> list[IpcHandle]:
        return list(self.handles)

    def accept(self, engine: str, handle: bytes) -> None:
        """`engine` opened our buffers and made its mailbox (`handle`): map it, and trade CUDA events through it."""
        if engine not in self.engines:
            raise ValueError(f"{engine} is not an ipc engine of this rank")
        box = self.mailboxes[engine] = Mailbox.attach(handle)
        peer = box.events(of_sender=False)   # the receiver made its events when it made the mailbox (CUDA only)
        if self.device.type == "cuda" and peer is not None:
            if self._events is None:
                self._events, self._event_handles = ipc_events(SLOTS, self.device)
            box.put_events(True, self._event_handles)
            self._peer_events[engine] = [open_event(h, self.device) for h in peer]

    def device_handover(self) -> bool:
        return bool(self.mailboxes) and all(e in self._peer_events for e in self.mailboxes)

    def begin(self, sync_id: int, check, deadline: float, on_device: bool) -> None:
        missing = [e for e in self.engines if e not in self.mailboxes]
        if missing:
            raise WeightSyncError(f"ipc engines {missing} have no stream to this trainer rank: each colocated engine "
                                  "connects at setup (the receiver's connect, then the sender's accept)")
        self.sync_id, self.deadline, self.on_device = sync_id, deadline, on_device
        self._pending = [[] for _ in range(SLOTS)]
        for box in self.mailboxes.values():
            box.begin(DEVICE if on_device else HOST)
            box.check = check

    def post(self, slot: int, layout, first: int, sums: list[int]) -> None:
        if self.on_device:
            self._events[slot].record(torch.cuda.current_stream(self.device))   # the engines poll it before they load
        seq = seq_of(self.sync_id, layout.index)
        for engine in self.engines:
            self.mailboxes[engine].publish(slot, seq, first, sums)
            self._pending[slot].append((engine, seq))

    def drain(self, slot: int) -> None:
        for engine, seq in self._pending[slot]:
            self.mailboxes[engine].wait_done(slot, seq, self.deadline, f"{engine} loading bucket {seq % (1 << 20) - 1}")
        self._pending[slot] = []

    def refill_wait(self, slot: int, bucket: int) -> None:
        # The engine has queued its load from this buffer (its `done`); wait until the load itself is done. Polled,
        # not a stream wait: a stream waiting on a killed engine's event would hang for good. Also right for a
        # buffer's first use in a sync: its event then marks the previous sync's last load.
        if self.on_device:
            for engine in self.engines:
                self.mailboxes[engine].wait_event(self._peer_events[engine][slot], self.deadline,
                                                  f"{engine} loading bucket {bucket - SLOTS} (its event)", True)

    def finish(self, sync_id: int, n_buckets: int, checksums: list[int]) -> None:
        if self.on_device:   # the checksums stayed on the device until now: the engines compare them at the end
            for box in self.mailboxes.values():
                box.publish_final(seq_of(sync_id, n_buckets), checksums)

    def abandon(self) -> None:
        self._pending = [[] for _ in range(SLOTS)]


class StreamReceive(ReceiveSide):
    """An engine worker's end: the rank's buffers, opened once, and the mailbox it made for that rank."""

    name = "ipc"

    def __init__(self, n_tensors: int, device: torch.device, timeout_s: float):
        self.n_tensors = n_tensors
        self.device = device
        self.timeout_s = float(timeout_s)
        self.bufs: list[torch.Tensor] = []
        self.mailbox: Mailbox | None = None       # made at `connect`
        self._events: list[torch.cuda.Event] | None = None        # ours, one per slot: "loaded from slot"
        self._peer_events: list[torch.cuda.Event] | None = None   # the sender's, opened at the first device sync

    @classmethod
    def open(cls, spec: dict, rx, timeout_s: float) -> "StreamReceive":
        return cls(rx.firsts[-1], rx.device, timeout_s)

    @classmethod
    def watch(cls, answer: bytes):
        return Mailbox.observe(answer).fail   # the mailbox we answered with, mapped before the first sync unlinks it

    def connect(self, buffer_handles: Sequence[IpcHandle]) -> bytes:
        """Open the rank's ring buffers once and make our mailbox; returns its handle (the sender's `accept`)."""
        if len(buffer_handles) != SLOTS:
            raise ValueError(f"a stream needs {SLOTS} sender buffers, got {len(buffer_handles)}: the trainer and this "
                             "engine read RLHF_ORCH_SYNC_SLOTS differently; unset it or set it alike for both")
        self.close()
        self.bufs = [open_handle(as_handle(h)) for h in buffer_handles]
        self.mailbox = Mailbox.create(self.n_tensors)
        if self.device.type == "cuda":
            self._events, handles = ipc_events(SLOTS, self.device)
            self.mailbox.put_events(False, handles)
        return self.mailbox.handle()

    def receive(self, rx, sync_id: int, verify: bool) -> tuple[list[int], dict[str, float]]:
        box = self.mailbox
        if box is None:
            raise WeightSyncError("an ipc receive before the stream was connected (setup's second round)")
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        box.reset_failure()
        box.check = rx.checker(sync_id)
        sums: list[int] = []
        load_s = wait_s = 0.0
        on_device, dev = False, None
        firsts = rx.firsts
        try:
            for k, layout in enumerate(rx.layouts):
                slot, seq = k % SLOTS, seq_of(sync_id, k)
                t1 = time.perf_counter()
                box.wait_ready(slot, seq, deadline, f"bucket {k} of sync {sync_id}")
                if k == 0:
                    box.unlink()   # the sender has mapped it: no file needs to outlive a crash
                    on_device, dev = self._begin_on_device(box, verify, firsts[-1])
                t2 = time.perf_counter()
                buf, first = self.bufs[slot], firsts[k]
                if on_device:
                    # The sender's pack of this bucket, done on the device (polled: see mailbox.py).
                    box.wait_event(self._peer_events[slot], deadline, f"bucket {k} of sync {sync_id} (its event)", False)
                    t2 = time.perf_counter()
                    got = rx.load_bucket(layout, buf, verify, None if dev is None else dev[first:firsts[k + 1]])
                    self._events[slot].record(torch.cuda.current_stream(self.device))   # the sender refills after it
                    if got:
                        dev[first:first + len(got)] = torch.tensor(got, dtype=torch.int64)   # the loader's path
                else:
                    got = rx.load_bucket(layout, buf, verify)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)   # the sender refills the slot once we acknowledge
                    if verify:
                        rx.compare(got, box.expected(first, len(got)), first, "ipc")
                    sums.extend(got)
                box.ack(slot, seq)
                wait_s += t2 - t1
                load_s += time.perf_counter() - t2
            if on_device:
                t2 = time.perf_counter()
                torch.cuda.synchronize(self.device)
                if dev is not None:
                    sums = dev.tolist()
                    box.wait_final(seq_of(sync_id, len(rx.layouts)), deadline, f"the checksums of sync {sync_id}")
                    rx.compare(sums, box.expected(0, len(sums)), 0, "ipc")
                    rx.last_sums.update(zip(rx.names, sums))
                load_s += time.perf_counter() - t2
        except BaseException:
            box.fail()   # the sender stops waiting for us now, not at its deadline
            raise
        return sums, {"load_s": load_s, "wait_s": wait_s, "total_s": time.perf_counter() - t0,
                      "on_device": float(on_device)}

    def _begin_on_device(self, box: Mailbox, verify: bool, n_tensors: int) -> tuple[bool, torch.Tensor | None]:
        """Whether the sender hands this sync over on the device; if so, a zeroed device tensor for our checksums."""
        if box.mode() != DEVICE:
            return False, None
        if self._events is None:
            raise WeightSyncError("the trainer hands buckets over on the GPU but this receiver made no CUDA events")
        if self._peer_events is None:
            handles = box.events(of_sender=True)
            if handles is None:
                raise WeightSyncError("the trainer hands buckets over on the GPU but left no events in the mailbox")
            self._peer_events = [open_event(h, self.device) for h in handles]
        return True, (torch.zeros(n_tensors, dtype=torch.int64, device=self.device) if verify else None)

    def abort(self) -> None:
        if self.mailbox is not None:
            self.mailbox.fail()

    def close(self) -> None:
        if self.mailbox is not None:
            self.mailbox.unlink()
        self.bufs = []
