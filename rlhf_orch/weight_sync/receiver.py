"""Engine side of a sync: take buckets by broadcast or by IPC handle and load them into the model.

A `WeightReceiver` lives in every engine worker (the HF engine's one process, or each vLLM/SGLang
worker). It knows the bucket layouts from init, so the wire carries only raw buckets. Loading and
checksumming are injected by the engine (`load_fn(list[(name, tensor)])`, `checksum_fn(names)`), so
one receiver serves every engine kind. Broadcast receiving is pipelined: the receive of bucket k + 1
is posted before bucket k is loaded.

The checksums returned are of what the engine holds after loading (its own parameters), not of the
received bytes: a load that silently skips or mangles a tensor shows up as a mismatch.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from rlhf_orch.weight_sync.buckets import BucketLayout, max_bucket_bytes, unpack
from rlhf_orch.weight_sync.collective import BroadcastGroup
from rlhf_orch.weight_sync.ipc import HandleCache, IpcHandle

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]
ChecksumFn = Callable[[list[str]], list[int]]


class WeightReceiver:
    def __init__(self, layouts: Sequence[BucketLayout], device: torch.device, load_fn: LoadFn,
                 checksum_fn: ChecksumFn | None = None):
        self.layouts = list(layouts)
        self.device = device
        self.load_fn = load_fn
        self.checksum_fn = checksum_fn
        self.group: BroadcastGroup | None = None
        self._bufs: list[torch.Tensor] = []
        self._cache = HandleCache()

    def join_group(self, backend: str, host: str, port: int, rank: int, world_size: int,
                   timeout_s: float, local_host: str | None = None) -> float:
        """Create this worker's end of the broadcast group and warm it up; returns seconds taken."""
        t0 = time.perf_counter()
        group = BroadcastGroup(backend, host, port, rank, world_size, timeout_s, self.device, local_host)
        group.warmup()
        self.attach_group(group)
        return time.perf_counter() - t0

    def attach_group(self, group: BroadcastGroup) -> None:
        """Receive through an existing (warmed-up) group; allocates the two receive buffers."""
        self.group = group
        n = max_bucket_bytes(self.layouts)
        # Zeroed once: alignment padding is never written, so it stays identical on every rank.
        self._bufs = [torch.zeros(n, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def _load(self, layout: BucketLayout, buf: torch.Tensor, verify: bool) -> list[int]:
        self.load_fn(list(unpack(layout, buf)))
        if verify and self.checksum_fn is not None:
            return self.checksum_fn(layout.names)
        return []

    def receive_broadcast(self, verify: bool = True) -> tuple[list[int], dict[str, float]]:
        if self.group is None:
            raise RuntimeError("receive_broadcast before join_group")
        t0 = time.perf_counter()
        load_s = 0.0
        sums: list[int] = []

        def post(k: int):
            lay = self.layouts[k]
            return self.group.broadcast(self._bufs[k % 2][:lay.nbytes], src=0, async_op=True)

        work = post(0) if self.layouts else None
        for k, layout in enumerate(self.layouts):
            work.wait()
            nxt = post(k + 1) if k + 1 < len(self.layouts) else None
            t1 = time.perf_counter()
            sums.extend(self._load(layout, self._bufs[k % 2], verify))
            load_s += time.perf_counter() - t1
            work = nxt
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return sums, {"load_s": load_s, "total_s": time.perf_counter() - t0}

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
