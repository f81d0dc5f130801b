"""Trainer side of a sync: pack named tensors into double-buffered buckets and send each one.

The named-tensor iterator must keep each bucket's tensors valid until the first tensor of the next
bucket is requested (`DeepSpeedTrainer.iter_named_tensors(groups)` gathers ZeRO-3 partitions bucket
by bucket for exactly this reason).

One `WeightSender` lives in every trainer rank. Per bucket k it packs into buffer k % 2, then
(rank 0, if any engine uses broadcast) starts an asynchronous broadcast of the bucket and (any rank
that shares its device with engines) hands each such engine an IPC handle of the buffer. Before a
buffer is packed again (bucket k + 2) the sender waits for that buffer's broadcast and for every
engine's acknowledgement, so packing bucket k + 1 overlaps the transfer and load of bucket k.

How a handle reaches an engine is injected (`deliver`/`wait` callables): the actor shell uses Ray
calls, tests may call a receiver directly. This module never imports Ray.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from rlhf_orch.errors import WeightSyncError
from rlhf_orch.weight_sync.buckets import BucketLayout, bucket_checksums, max_bucket_bytes, slot_view
from rlhf_orch.weight_sync.collective import BroadcastGroup
from rlhf_orch.weight_sync.ipc import allocate_shared, export_handle

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
                 group: BroadcastGroup | None = None, verify: bool = True):
        self.layouts = list(layouts)
        self.device = device
        self.ipc_engines = list(ipc_engines)
        self.group = group
        self.verify = verify
        self.active = bool(self.ipc_engines) or group is not None
        self._bufs: list[tuple[str, torch.Tensor]] = []
        self._handles = []
        if self.active:
            n = max_bucket_bytes(self.layouts)
            self._bufs = [allocate_shared(n, device) for _ in range(2)]
            for _, b in self._bufs:
                b.zero_()   # alignment padding is never written: keep it identical on both sides
            self._handles = [export_handle(bid, b) if self.ipc_engines else None for bid, b in self._bufs]

    def _sync_device(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def send(self, named: Iterator[tuple[str, torch.Tensor]], version: int,
             deliver: Deliver | None = None, wait: Wait | None = None) -> SendResult:
        res = SendResult(engine_checksums={e: [] for e in self.ipc_engines})
        t_start = time.perf_counter()
        if not self.active:
            for _ in named:   # ZeRO-3 ranks must still take part in every gather
                pass
            return res
        if self.ipc_engines and (deliver is None or wait is None):
            raise ValueError("ipc engines need deliver and wait callables")
        pending: list[list] = [[], []]   # per buffer: broadcast work and ipc tokens in flight

        def drain(slot: int):
            t0 = time.perf_counter()
            for kind, engine, token in pending[slot]:
                if kind == "bcast":
                    token.wait()
                else:
                    res.engine_checksums[engine].extend(wait(token))
            pending[slot] = []
            res.wait_s += time.perf_counter() - t0

        it = iter(named)
        for layout in self.layouts:
            slot = layout.index % 2
            drain(slot)
            buf = self._bufs[slot][1]
            t0 = time.perf_counter()
            # Pull the bucket's tensors, then copy them with one multi-tensor kernel. The trainer
            # iterator keeps a bucket's tensors valid until the next bucket is pulled (ZeRO-3 gathers
            # exactly one bucket at a time), so batching is safe and saves a launch per tensor.
            dsts, srcs = [], []
            for s in layout.slots:
                try:
                    name, t = next(it)
                except StopIteration:
                    raise WeightSyncError(f"trainer yielded fewer tensors than the layout expects (missing {s.name})") from None
                if name != s.name:
                    raise WeightSyncError(f"trainer yielded {name!r} where the layout expects {s.name!r}; "
                                          "parameter order changed since the plan was made")
                if tuple(t.shape) != s.shape:
                    raise WeightSyncError(f"{name}: shape {tuple(t.shape)} does not match the layout's {s.shape}")
                dsts.append(slot_view(buf, s))
                srcs.append(t)
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
            del srcs
            if self.verify:
                res.checksums.extend(bucket_checksums(layout, buf))   # its host read also waits for the copies
            elif self.ipc_engines:
                self._sync_device()   # another process reads this buffer: the copies must be done first
            res.pack_s += time.perf_counter() - t0
            res.bytes += layout.nbytes
            if self.group is not None:
                work = self.group.broadcast(buf[:layout.nbytes], src=0, async_op=True)
                pending[slot].append(("bcast", None, work))
            for engine in self.ipc_engines:
                pending[slot].append(("ipc", engine, deliver(engine, self._handles[slot], layout.index, version)))
        n = len(self.layouts)     # oldest in-flight bucket first, so acks stay in layout order
        drain(n % 2)
        drain((n + 1) % 2)
        if next(it, None) is not None:
            raise WeightSyncError("trainer yielded more tensors than the layout expects; re-plan the sync")
        self._sync_device()
        res.total_s = time.perf_counter() - t_start
        return res
