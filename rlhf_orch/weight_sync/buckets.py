"""Flatten named tensors into a few large contiguous byte buffers ("buckets"), and back.

A `BucketLayout` is computed once from the parameter specs (name, dtype, shape) and the bucket size;
both sides of a sync hold the same layouts, so a sync needs no per-tensor metadata on the wire: one
buffer per bucket. Each tensor sits at a 256-byte aligned offset so views into the buffer are
aligned for any dtype. A tensor larger than the bucket size gets a bucket of its own.

Checksums are exact integer sums (mod 2**64) of a tensor's bytes read as int64 words, the last word
zero-padded, so both sides agree bit for bit on any device; they catch stale, partial or missing loads cheaply (one
reduction per tensor, one host sync per bucket). This module does no communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

from rlhf_orch.types import ParamSpec, dtype_from_name

ALIGN = 256


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int     # bytes from the start of the bucket
    nbytes: int


@dataclass(frozen=True)
class BucketLayout:
    index: int
    nbytes: int
    slots: tuple[TensorSlot, ...]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(specs: Sequence[ParamSpec], bucket_bytes: int) -> list[BucketLayout]:
    """Greedy, order-preserving packing of `specs` into buckets of at most `bucket_bytes` (but see module doc)."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    layouts: list[BucketLayout] = []
    slots: list[TensorSlot] = []
    used = 0
    for spec in specs:
        size = spec.nbytes
        start = _align(used)
        if slots and start + size > bucket_bytes:
            layouts.append(BucketLayout(len(layouts), used, tuple(slots)))
            slots, used, start = [], 0, 0
        slots.append(TensorSlot(spec.name, spec.dtype, tuple(spec.shape), start, size))
        used = start + size
    if slots:
        layouts.append(BucketLayout(len(layouts), used, tuple(slots)))
    return layouts


def max_bucket_bytes(layouts: Sequence[BucketLayout]) -> int:
    return max((b.nbytes for b in layouts), default=0)


def slot_view(buf: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """A typed, shaped view of `slot` inside the uint8 buffer `buf` (no copy)."""
    raw = buf[slot.offset:slot.offset + slot.nbytes]
    return raw.view(dtype_from_name(slot.dtype)).view(slot.shape)


def pack(layout: BucketLayout, tensors: Iterable[torch.Tensor], buf: torch.Tensor) -> None:
    """Copy `tensors` (in slot order, any dtype/device) into `buf`, converting to each slot's dtype."""
    n = 0
    for slot, t in zip(layout.slots, tensors):
        if tuple(t.shape) != slot.shape:
            raise ValueError(f"{slot.name}: shape {tuple(t.shape)} does not match the layout's {slot.shape}")
        slot_view(buf, slot).copy_(t, non_blocking=True)
        n += 1
    if n != len(layout.slots):
        raise ValueError(f"bucket {layout.index}: got {n} tensors for {len(layout.slots)} slots")


def unpack(layout: BucketLayout, buf: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) for every slot of `layout` in `buf`."""
    for slot in layout.slots:
        yield slot.name, slot_view(buf, slot)


def _word_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum (mod 2**64) of the tensor's bytes read as int64 words, the last word zero-padded."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    if raw.storage_offset() % 8:
        raw = raw.clone()    # a view at an unaligned offset cannot be re-viewed as int64
    n = raw.numel()
    main = n - n % 8
    total = raw[:main].view(torch.int64).sum() if main else torch.zeros((), dtype=torch.int64, device=raw.device)
    if n % 8:
        tail = torch.zeros(8, dtype=torch.uint8, device=raw.device)
        tail[:n % 8] = raw[main:]
        total = total + tail.view(torch.int64)[0]
    return total


def checksums(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Exact per-tensor checksums (see module doc), with one host sync for the whole list."""
    sums = [_word_sum(t) for t in tensors]
    if not sums:
        return []
    return torch.stack(sums).tolist()


def bucket_checksums(layout: BucketLayout, buf: torch.Tensor) -> list[int]:
    """The same per-slot checksums as `checksums(unpack(layout, buf))`, computed from the packed bucket.

    Buckets of many small tensors (MoE experts) would need a kernel launch per tensor; here one scan
    over the bucket's words and one gather give every slot's sum. It relies on the bytes between slots
    being zero (buffers are zeroed once and padding is never written); the tail after the last slot is
    cleared here because a previous, larger bucket may have used the same buffer.
    """
    if len(layout.slots) <= 64:
        return checksums(slot_view(buf, s) for s in layout.slots)
    end = (layout.nbytes + 7) // 8 * 8
    if end > layout.nbytes:
        buf[layout.nbytes:end].zero_()
    words = buf[:end].view(torch.int64)
    scan = words.cumsum(0)        # int64 wraps mod 2**64, so segment differences stay exact
    starts = torch.tensor([s.offset // 8 for s in layout.slots], device=buf.device)
    ends = torch.tensor([(s.offset + s.nbytes + 7) // 8 for s in layout.slots], device=buf.device)
    before = torch.where(starts > 0, scan[(starts - 1).clamp(min=0)], torch.zeros_like(starts))
    return (scan[ends - 1] - before).tolist()


def digest(values: Sequence[int]) -> int:
    """Fold a list of checksums into one 63-bit number (order-sensitive) for logs and versions."""
    h = 1469598103934665603
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h
