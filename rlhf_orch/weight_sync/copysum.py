"""Copy many byte ranges and checksum them in one pass: the bulk step of a sync on both of its sides.

A sync moves every tensor twice on a colocated GPU (trainer parameters -> bucket, bucket -> engine parameters)
and checksums it on each side. Done as a copy launch plus a reduction per tensor, the checksums read every byte a
second time and cost a launch each (an 8B model: ~300 tensors, a 30B-A3B MoE: ~19,000). Here a `CopyPlan` is a
list of runs (source address, destination address, bytes, slot), and `run()` copies every run and adds each
run's int64 words into its slot's checksum, reading each byte once:

- on CUDA with Triton (the GPU machines: vLLM and SGLang both need it), one kernel launch for the whole plan:
  each program copies one chunk of at most `CHUNK_WORDS` words and adds its sum to the slot with one integer
  atomic, so the result is exact and independent of the order (sums are mod 2**64, as in buckets.py);
- elsewhere (CPU, no Triton), `torch._foreach_copy_` plus one `buckets._word_sum` per run: the same numbers.

A run's checksum is the word sum of buckets.py, so the slot sums equal `checksums()` of the tensors when each run
starts at a multiple of 8 bytes within its slot (runs are additive over such splits). Runs whose addresses or
length are not multiples of 8 bytes take the torch path. This module knows nothing of engines, Ray or layouts.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable

import torch

from rlhf_orch.weight_sync.buckets import _word_sum

CHUNK_WORDS = 1 << 16        # 512 KiB per program: enough work per program, enough programs for a small bucket
_BLOCK = 2048                # words per loop step of a program
_WARPS = 8

_kernel = None               # the compiled Triton kernel, or False when Triton cannot be used here


def _triton_kernel():
    global _kernel
    if _kernel is not None:
        return _kernel or None
    if os.environ.get("RLHF_ORCH_COPYSUM", "auto") == "torch":
        _kernel = False
        return None
    try:
        import triton
        import triton.language as tl
    except Exception:   # no Triton (CPU machines): the torch path does the same work
        _kernel = False
        return None

    @triton.jit
    def copy_sum(desc, sums, COPY: tl.constexpr, BLOCK: tl.constexpr):
        # desc rows: source address, destination address, words, slot (int64). Addresses are 8-byte aligned.
        row = desc + tl.program_id(0) * 4
        src = tl.load(row).to(tl.pointer_type(tl.int64))
        dst = tl.load(row + 1).to(tl.pointer_type(tl.int64))
        n = tl.load(row + 2)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(0, n, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            m = idx < n
            if COPY:
                w = tl.load(src + idx, mask=m, other=0)
                tl.store(dst + idx, w, mask=m)
            else:
                w = tl.load(dst + idx, mask=m, other=0)
            acc += w
        tl.atomic_add(sums + tl.load(row + 3), tl.sum(acc, axis=0))

    _kernel = copy_sum
    return _kernel


def triton_available(device: torch.device) -> bool:
    return device.type == "cuda" and _triton_kernel() is not None


@dataclass(frozen=True)
class Run:
    """The bytes of `src` into `dst`, counted into `slot`: both uint8, either flat or 2-D of contiguous rows (a
    tensor-parallel slice: rows of a matrix, or a block of every row), of the same shape."""
    src: torch.Tensor
    dst: torch.Tensor
    slot: int


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as a flat uint8 view (what a Run copies)."""
    return t.detach().reshape(-1).view(torch.uint8)


def _addr_ok(t: torch.Tensor) -> bool:
    if t.dim() == 2:
        return t.data_ptr() % 8 == 0 and t.shape[1] % 8 == 0 and t.stride(1) == 1 and t.stride(0) % 8 == 0
    return t.data_ptr() % 8 == 0 and t.numel() % 8 == 0 and t.is_contiguous()


def _rows(r: Run) -> torch.Tensor:
    """The kernel's descriptor rows of one run: (source, destination, words, slot) per chunk of each row."""
    rows, row_bytes = (r.src.shape[0], r.src.shape[1]) if r.src.dim() == 2 else (1, r.src.numel())
    src_pitch, dst_pitch = (r.src.stride(0), r.dst.stride(0)) if r.src.dim() == 2 else (0, 0)
    words = row_bytes // 8
    starts = torch.arange(0, words, CHUNK_WORDS, dtype=torch.int64)
    row = torch.arange(rows, dtype=torch.int64)[:, None]
    src = r.src.data_ptr() + row * src_pitch + 8 * starts
    dst = r.dst.data_ptr() + row * dst_pitch + 8 * starts
    n = torch.clamp(words - starts, max=CHUNK_WORDS).expand_as(src)
    return torch.stack([src, dst, n, torch.full_like(src, r.slot)], dim=-1).reshape(-1, 4)


def device_current(device: torch.device):
    """A context in which `device` is the current CUDA device (a no-op elsewhere): Triton, and torch's streams and
    events made without a device, use the calling thread's current device, not the tensors'."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class CopyPlan:
    """A fixed list of runs; `run()` may be called many times while the memory stays where it was.

    Runs that the kernel takes are kept as addresses only, so a cached plan does not keep an engine's weights
    alive while it sleeps: the caller must not run it once that memory may have moved (replay.py keys its cached
    plans by the parameters' addresses). Runs on the torch path keep their views (`cacheable` is then False).
    """

    def __init__(self, runs: list[Run], n_slots: int, device: torch.device):
        self.n_slots = n_slots
        self.device = device
        use_kernel = triton_available(device)
        fast = [r for r in runs if use_kernel and _addr_ok(r.src) and _addr_ok(r.dst)]
        fast_ids = {id(r) for r in fast}
        self.slow = [r for r in runs if id(r) not in fast_ids]
        self.desc = None
        self.kernel = _triton_kernel() if fast else None   # kept: a plan runs as it was built
        self.kernel_runs = len(fast)
        if fast:
            self.desc = torch.cat([_rows(r) for r in fast]).to(device)

    @property
    def cacheable(self) -> bool:
        return not self.slow

    def run(self, copy: bool = True, out: torch.Tensor | None = None) -> list[int] | None:
        """Copy every run (unless `copy` is False: checksum the destinations only) and return the slot sums. With
        `out` (zeroed int64, one per slot, on the device) the sums are added there instead and nothing waits for
        the device: the GPU hand-over keeps them there until the sync's end."""
        sums = torch.zeros(self.n_slots, dtype=torch.int64, device=self.device) if out is None else out
        if self.desc is not None:
            # Triton launches on the calling thread's current device and stream, whatever device the tensors are on
            # (the SGLang GPU tests: "invalid resource handle" once an earlier test had left GPU 1 current); every
            # sender's pack and receiver's replay comes through here, so this is the one place that needs it.
            with device_current(self.device):
                self.kernel[(self.desc.shape[0],)](self.desc, sums, COPY=copy, BLOCK=_BLOCK, num_warps=_WARPS)
        if self.slow:
            if copy:
                torch._foreach_copy_([r.dst for r in self.slow], [r.src for r in self.slow], non_blocking=True)
            parts = torch.stack([_word_sum(r.dst) for r in self.slow])
            index = torch.tensor([r.slot for r in self.slow], device=self.device)
            sums.index_add_(0, index, parts)
        if out is not None:
            return None
        return sums.tolist()   # the host read waits for the copies too


class PlanCache:
    """At most one CopyPlan per place (a bucket in a ring buffer), reused while the addresses it was built on are
    the current ones. Plans on the torch path hold views of the caller's tensors and are never cached."""

    def __init__(self):
        self._plans: dict[tuple, tuple[tuple, CopyPlan]] = {}

    def get(self, place: tuple, addresses: tuple, build: Callable[[], CopyPlan]) -> CopyPlan:
        hit = self._plans.get(place)
        if hit is not None and hit[0] == addresses:
            return hit[1]
        plan = build()
        if plan.cacheable:
            self._plans[place] = (addresses, plan)
        else:
            self._plans.pop(place, None)
        return plan

    def plans(self) -> list[CopyPlan]:
        return [plan for _, plan in self._plans.values()]
