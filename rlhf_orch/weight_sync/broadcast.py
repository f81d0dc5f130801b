"""The `broadcast` transport: trainer rank 0 broadcasts every bucket to every dedicated engine worker at once.

One group (collective.py) holds rank 0 and every worker of every broadcast engine, so fan-out is one collective per
bucket that NCCL pipelines, not one send per engine. The sender posts bucket k's broadcast from ring buffer k % SLOTS
and waits for it only before that buffer is packed again. A receiver posts bucket k + 1's receive before it loads
bucket k, into two buffers of its own. With `sums` (every receiver of the group checks what it loads), rank 0
follows the last bucket with its checksums as one more broadcast, and each receiver compares every tensor before its
engine may resume.

A failed or aborted sync leaves the group at once (collective.py, `abandon`): rank 0's leaving frees every receiver's
pending receive; a receiver's leaving frees itself. The coordinator then builds a new group.
"""
from __future__ import annotations

import time
import traceback

import torch

from rlhf_orch.weight_sync.buckets import max_bucket_bytes
from rlhf_orch.weight_sync.collective import BroadcastGroup
from rlhf_orch.weight_sync.mailbox import SLOTS
from rlhf_orch.weight_sync.plan import group_size
from rlhf_orch.weight_sync.transport import PlanFacts, ReceiveSide, SendSide


def _join(spec: dict, rank: int, timeout_s: float, device: torch.device) -> BroadcastGroup:
    """Create this member's end of the group and warm it up (blocks until every member has joined)."""
    group = BroadcastGroup(spec["backend"], spec["host"], int(spec["port"]), rank, int(spec["world_size"]),
                           float(timeout_s), device, spec.get("local_host"))
    group.warmup()
    return group


class BroadcastSend(SendSide):
    """Rank 0's end of the group: broadcasts out of the sender's ring buffers."""

    name = "broadcast"
    rendezvous = True   # rank 0 hosts the group's store

    def __init__(self, group: BroadcastGroup, bufs: list[torch.Tensor], device: torch.device, sums: bool):
        self.group, self.bufs, self.device, self.sums = group, bufs, device, bool(sums)
        self._pending: list[list] = [[] for _ in range(SLOTS)]
        self.check = None
        self._alive = True

    @classmethod
    def specs(cls, routes, facts: PlanFacts) -> tuple[dict[int, dict], dict[str, dict]]:
        """One group: rank 0 and every worker of every broadcast engine (an engine's first worker's rank is its spec's
        `rank`; worker k joins as `rank` + k). The trainer's checksums follow the buckets (`sums`) only if every
        receiver can compare them itself, since every member must take part in that broadcast; otherwise the
        engines are held for the coordinator to check."""
        host, port = facts.address
        sums = facts.verify and all(facts.checks.get(r.engine, True) for r in routes)
        group = {"backend": facts.backend, "host": host, "port": int(port), "world_size": group_size(routes),
                 "sums": sums}
        return ({0: dict(group)},
                {r.engine: {**group, "rank": r.group_ranks[0], "hold": facts.verify and not sums} for r in routes})

    @classmethod
    def open(cls, spec: dict, bufs, device: torch.device, verify: bool, timeout_s: float) -> "BroadcastSend":
        return cls(_join(spec, 0, timeout_s, device), [b for _, b in bufs], device, bool(spec.get("sums")) and verify)

    @property
    def alive(self) -> bool:
        return self._alive

    def begin(self, sync_id: int, check, deadline: float, on_device: bool) -> None:
        # NCCL orders each broadcast after the pack queued before it on the stream, so it works on either hand-over.
        self.check = check
        self._pending = [[] for _ in range(SLOTS)]

    def post(self, slot: int, layout, first: int, sums: list[int]) -> None:
        self._pending[slot].append(self.group.broadcast(self.bufs[slot][:layout.nbytes], src=0, async_op=True))

    def drain(self, slot: int) -> None:
        for work in self._pending[slot]:
            self.group.wait(work, self.check)
        self._pending[slot] = []

    def finish(self, sync_id: int, n_buckets: int, checksums: list[int]) -> None:
        if self.sums:   # the receivers compare each tensor with these before they resume
            sums_t = torch.tensor(checksums, dtype=torch.int64, device=self.device)
            self.group.wait(self.group.broadcast(sums_t, src=0, async_op=True), self.check)

    def synchronize(self, check=None) -> bool:
        self.group.synchronize(check)
        return True

    def abandon(self) -> None:
        busy = any(not work.is_completed() for p in self._pending for work in p)
        self._pending = [[] for _ in range(SLOTS)]   # a gloo work keeps the group's sockets open, and the receivers waiting
        self._alive = False   # out of step with the receivers now: the coordinator builds a new group
        self.group.abandon(busy)

    def close(self) -> None:
        self.group.destroy()


class BroadcastReceive(ReceiveSide):
    """One engine worker's end of the group, with two receive buffers."""

    name = "broadcast"

    def __init__(self, group: BroadcastGroup, layouts, device: torch.device, expect_sums: bool):
        self.group: BroadcastGroup | None = group
        self.expect_sums = bool(expect_sums)
        n = max_bucket_bytes(layouts)
        # Zeroed once: alignment padding is never written, so it stays identical on every rank.
        self.bufs = [torch.zeros(n, dtype=torch.uint8, device=device) for _ in range(2)]
        self.device = device

    @classmethod
    def open(cls, spec: dict, rx, timeout_s: float) -> "BroadcastReceive":
        """`spec["rank"]`: this worker's rank in the group (an engine of several workers adds each one's index)."""
        return cls(_join(spec, int(spec["rank"]), timeout_s, rx.device), rx.layouts, rx.device, bool(spec.get("sums")))

    def receive(self, rx, sync_id: int, verify: bool) -> tuple[list[int], dict[str, float]]:
        if self.group is None:
            raise RuntimeError("receive over broadcast after an aborted sync left the group (the coordinator re-plans)")
        t0 = time.perf_counter()
        load_s = 0.0
        sums: list[int] = []
        group, check = self.group, rx.checker(sync_id)
        layouts = rx.layouts
        want = None
        work = nxt = None

        def post(k: int):
            return group.broadcast(self.bufs[k % 2][:layouts[k].nbytes], src=0, async_op=True)

        try:
            work = post(0) if layouts else None
            for k, layout in enumerate(layouts):
                # The next bucket is posted before this one is waited for, so the wire never waits for this host.
                # Its buffer was last read by bucket k - 1's load, queued before this post: the collective's stream
                # waits for the current stream when it is posted.
                nxt = post(k + 1) if k + 1 < len(layouts) else None
                group.wait(work, check)
                t1 = time.perf_counter()
                sums.extend(rx.load_bucket(layout, self.bufs[k % 2], verify))
                load_s += time.perf_counter() - t1
                work, nxt = nxt, None
            if self.expect_sums:
                # Rank 0 sends its checksums after the last bucket (always, so every rank's collectives match).
                want = torch.zeros(rx.firsts[-1], dtype=torch.int64, device=self.device)
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
            rx.compare(sums, want.tolist(), 0, "broadcast")
        return sums, {"load_s": load_s, "total_s": time.perf_counter() - t0}

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
