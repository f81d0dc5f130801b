"""Flatten named tensors into a few large contiguous byte buffers ("buckets"), and back.

A `BucketLayout` is computed once from the parameter specs (name, dtype, shape) and the bucket size;
both sides of a sync hold the same layouts, so a sync needs no per-tensor metadata on the wire: one
buffer per bucket. Each tensor sits at a 256-byte aligned offset so views into the buffer are
aligned for any dtype. A tensor larger than the bucket size gets a bucket of its own.

Checksums are exact integer sums of a tensor's bytes read as 64/32/8-bit words (mod 2**64), so both
sides agree bit for bit on any device; they catch stale, partial or missing loads cheaply (one
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
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    n = raw.numel()
    word = 8 if n % 8 == 0 else 4 if n % 4 == 0 else 1
    if raw.storage_offset() % word:
        raw = raw.clone()   # a view starting mid-word in its storage (e.g. into a flat buffer) cannot be re-viewed
    if word == 8:
        words = raw.view(torch.int64)
    elif word == 4:
        words = raw.view(torch.int32)
    else:
        words = raw
    return words.sum(dtype=torch.int64)


def checksums(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Exact per-tensor checksums (see module doc); one host sync for the whole list."""
    sums = [_word_sum(t) for t in tensors]
    if not sums:
        return []
    return [int(x) for x in torch.stack([s.cpu() for s in sums]).tolist()]


def digest(values: Sequence[int]) -> int:
    """Fold a list of checksums into one 63-bit number (order-sensitive) for logs and versions."""
    h = 1469598103934665603
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h
