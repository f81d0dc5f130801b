"""Engine side of a sync: take buckets by broadcast or by IPC handle and load them into the model.

A `WeightReceiver` lives in every engine worker (the HF engine's one process, or each vLLM/SGLang
worker). It knows the bucket layouts from init, so the wire carries only raw buckets. Loading and
checksumming are injected by the engine (`load_fn(list[(name, tensor)])`, `checksum_fn(names)`), so
one receiver serves every engine kind. Broadcast receiving is pipelined: the receive of bucket k + 1
is posted before bucket k is loaded.

A colocated (`ipc`) receiver is fed one of two ways: per bucket (`receive_ipc`, one call per bucket, for
engines whose loading we do not drive, SGLang), or as a stream (`connect_stream` once, then one
`receive_stream` per sync that takes every bucket through a shared-memory mailbox, see mailbox.py). Stream and
broadcast receivers with `expect_sums` compare each tensor with the sender's checksum themselves and raise on a
difference, so an engine never resumes generating with weights nobody checked. On CUDA the sender may hand a
stream's buckets over through shared CUDA events (mailbox.py, "GPU hand-over"): each load then waits for the
sender's event of its buffer, is queued without a host sync, and its checksums stay on the device; every tensor is
compared once, at the sync's end.

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
import traceback
from typing import Callable, Sequence

import torch

from rlhf_orch.weight_sync.abort import AbortFlag, checker_for
from rlhf_orch.weight_sync.buckets import BucketLayout, checksums, max_bucket_bytes, unpack
from rlhf_orch.weight_sync.collective import BroadcastGroup
from rlhf_orch.errors import WeightSyncError
from rlhf_orch.weight_sync.ipc import HandleCache, IpcHandle, ipc_events, open_event, open_handle
from rlhf_orch.weight_sync.mailbox import DEVICE, SLOTS, Mailbox, seq_of
from rlhf_orch.weight_sync.replay import LoadReplay

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
    def __init__(self, layouts: Sequence[BucketLayout], device: torch.device, load_fn: LoadFn,
                 checksum_fn: ChecksumFn | None = None, replay: LoadReplay | None = None):
        self.layouts = list(layouts)
        self.device = device
        self.load_fn = load_fn
        self.checksum_fn = checksum_fn
        self.replay = replay
        self.last_sums: dict[str, int] = {}   # the latest verified checksum of every tensor
        self.group: BroadcastGroup | None = None
        self.expect_sums = False       # broadcast: the sender follows the buckets with its checksums
        self._bufs: list[torch.Tensor] = []
        self._cache = HandleCache()
        self._names = [name for lay in self.layouts for name in lay.names]   # the flat checksum list's order
        self._firsts = [0]             # index of each bucket's first tensor in the flat checksum list
        for lay in self.layouts:
            self._firsts.append(self._firsts[-1] + len(lay.slots))
        self.mailbox: Mailbox | None = None
        self._stream_bufs: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] | None = None        # ours, one per slot: "loaded from slot"
        self._peer_events: list[torch.cuda.Event] | None = None   # the sender's: "packed into slot"
        self.timeout_s = 300.0
        self.abort_flag: AbortFlag | None = None   # the owner (the engine's actor) aborts a sync through it

    def join_group(self, backend: str, host: str, port: int, rank: int, world_size: int,
                   timeout_s: float, local_host: str | None = None, expect_sums: bool = False) -> float:
        """Create this worker's end of the broadcast group and warm it up; returns seconds taken."""
        t0 = time.perf_counter()
        group = BroadcastGroup(backend, host, port, rank, world_size, timeout_s, self.device, local_host)
        group.warmup()
        self.attach_group(group)
        self.expect_sums = bool(expect_sums)
        return time.perf_counter() - t0

    def attach_group(self, group: BroadcastGroup) -> None:
        """Receive through an existing (warmed-up) group; allocates the two receive buffers."""
        self.group = group
        n = max_bucket_bytes(self.layouts)
        # Zeroed once: alignment padding is never written, so it stays identical on every rank.
        self._bufs = [torch.zeros(n, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def _load(self, layout: BucketLayout, buf: torch.Tensor, verify: bool,
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

    def receive_broadcast(self, verify: bool = True, sync_id: int = 0) -> tuple[list[int], dict[str, float]]:
        """Take every bucket of sync `sync_id` from rank 0's broadcasts (0: a sync no abort can end)."""
        if self.group is None:
            raise RuntimeError("receive_broadcast before join_group (or after an aborted sync left the group)")
        t0 = time.perf_counter()
        load_s = 0.0
        sums: list[int] = []
        group, check = self.group, checker_for(self.abort_flag, sync_id, "engine")
        want = None
        work = nxt = None

        def post(k: int):
            lay = self.layouts[k]
            return group.broadcast(self._bufs[k % 2][:lay.nbytes], src=0, async_op=True)

        try:
            work = post(0) if self.layouts else None
            for k, layout in enumerate(self.layouts):
                # The next bucket is posted before this one is waited for, so the wire never waits for this host.
                # Its buffer was last read by bucket k - 1's load, queued before this post: the collective's stream
                # waits for the current stream when it is posted.
                nxt = post(k + 1) if k + 1 < len(self.layouts) else None
                group.wait(work, check)
                t1 = time.perf_counter()
                sums.extend(self._load(layout, self._bufs[k % 2], verify))
                load_s += time.perf_counter() - t1
                work, nxt = nxt, None
            if self.expect_sums:
                # Rank 0 sends its checksums after the last bucket (always, so every rank's collectives match).
                want = torch.zeros(self._firsts[-1], dtype=torch.int64, device=self.device)
                group.wait(group.broadcast(want, src=0, async_op=True), check)
            group.synchronize(check)
        except BaseException as e:
            busy = any(w is not None and not w.is_completed() for w in (work, nxt))
            work = nxt = None   # pending works hold the group's sockets open
            traceback.clear_frames(e.__traceback__)
            self.group = None
            group.abandon(busy)   # its collectives are out of step with the sender's now
            raise
        if want is not None and verify:
            self._compare(sums, want.tolist(), 0, "broadcast")
        return sums, {"load_s": load_s, "total_s": time.perf_counter() - t0}

    def _compare(self, got: list[int], want: list[int], first: int, how: str) -> None:
        if got != want:
            names = self._names[first:first + len(got)]
            bad = [n for n, g, w in zip(names, got, want) if g != w][:5]
            raise WeightSyncError(f"weights received by {how} differ from the trainer's (checksums); first "
                                  f"differing tensors: {bad}")

    # ---- ipc as a stream: one call per sync -------------------------------------------------------------
    def connect_stream(self, buffer_handles: Sequence[IpcHandle], timeout_s: float) -> bytes:
        """Open the sender's ring buffers once and make the mailbox; returns its handle for the sender."""
        if len(buffer_handles) != SLOTS:
            raise ValueError(f"a stream needs {SLOTS} sender buffers, got {len(buffer_handles)}: the trainer and this "
                             "engine read RLHF_ORCH_SYNC_SLOTS differently; unset it or set it alike for both")
        self._stream_bufs = [open_handle(h) for h in buffer_handles]
        self.mailbox = Mailbox.create(self._firsts[-1])
        if self.device.type == "cuda":
            self._events, handles = ipc_events(SLOTS, self.device)
            self.mailbox.put_events(False, handles)
        self._peer_events = None   # a new sender: its events are opened at the first sync on the device
        self.timeout_s = float(timeout_s)
        return self.mailbox.handle()

    def set_replay(self, enabled: bool) -> None:
        """Switch load replay on or off for later syncs (the benchmark compares both in one run)."""
        if self.replay is not None:
            self.replay.enabled = bool(enabled)

    def abort_stream(self) -> None:
        """Tell the sender this sync will not be taken (it stops waiting at once)."""
        if self.mailbox is not None:
            self.mailbox.fail()

    def receive_stream(self, sync_id: int, verify: bool = True) -> tuple[list[int], dict[str, float]]:
        """Take every bucket of sync `sync_id` as the sender publishes it; returns (checksums, timings)."""
        box = self.mailbox
        if box is None:
            raise RuntimeError("receive_stream before connect_stream")
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        box.reset_failure()
        box.check = checker_for(self.abort_flag, sync_id, "engine")
        sums: list[int] = []
        load_s = wait_s = 0.0
        on_device, dev = False, None
        try:
            for k, layout in enumerate(self.layouts):
                slot, seq = k % SLOTS, seq_of(sync_id, k)
                t1 = time.perf_counter()
                box.wait_ready(slot, seq, deadline, f"bucket {k} of sync {sync_id}")
                if k == 0:
                    box.unlink()   # the sender has mapped it: no file needs to outlive a crash
                    on_device, dev = self._begin_on_device(box, verify)
                t2 = time.perf_counter()
                buf, first = self._stream_bufs[slot], self._firsts[k]
                if on_device:
                    # The sender's pack of this bucket, done on the device (polled: see mailbox.py).
                    box.wait_event(self._peer_events[slot], deadline, f"bucket {k} of sync {sync_id} (its event)", False)
                    t2 = time.perf_counter()
                    got = self._load(layout, buf, verify, None if dev is None else dev[first:self._firsts[k + 1]])
                    self._events[slot].record(torch.cuda.current_stream(self.device))   # the sender refills after it
                    if got:
                        dev[first:first + len(got)] = torch.tensor(got, dtype=torch.int64)   # the loader's path
                else:
                    got = self._load(layout, buf, verify)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)   # the sender refills the slot once we acknowledge
                    if verify:
                        self._compare(got, box.expected(first, len(got)), first, "ipc")
                    sums.extend(got)
                box.ack(slot, seq)
                wait_s += t2 - t1
                load_s += time.perf_counter() - t2
            if on_device:
                t2 = time.perf_counter()
                torch.cuda.synchronize(self.device)
                if dev is not None:
                    sums = dev.tolist()
                    box.wait_final(seq_of(sync_id, len(self.layouts)), deadline, f"the checksums of sync {sync_id}")
                    self._compare(sums, box.expected(0, len(sums)), 0, "ipc")
                    self.last_sums.update(zip(self._names, sums))
                load_s += time.perf_counter() - t2
        except BaseException:
            box.fail()   # the sender stops waiting for us now, not at its deadline
            raise
        return sums, {"load_s": load_s, "wait_s": wait_s, "total_s": time.perf_counter() - t0,
                      "on_device": float(on_device)}

    def _begin_on_device(self, box: Mailbox, verify: bool) -> tuple[bool, torch.Tensor | None]:
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
        return True, (torch.zeros(self._firsts[-1], dtype=torch.int64, device=self.device) if verify else None)

    def receive_ipc(self, handle: IpcHandle, bucket_index: int, verify: bool = True) -> list[int]:
        buf = self._cache.open(handle)
        sums = self._load(self.layouts[bucket_index], buf, verify)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # the sender may refill this buffer once we return
        return sums

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
        self._cache.clear()
        if self.mailbox is not None:
            self.mailbox.unlink()
        self._stream_bufs, self.mailbox = [], None
