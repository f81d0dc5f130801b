"""Learn once where an engine's `load_weights` puts each received byte, then redo it as one fused copy per bucket.

An engine's loader (vLLM's `model.load_weights`, the hf engine's) is Python that, for every tensor of a bucket,
looks up the parameter, narrows it (vLLM fuses q/k/v and gate/up into one parameter, MoE experts into one per
layer) and calls `copy_`. For an 8B model that is ~50 ms of interpreter work per sync around ~8 ms of copying,
and for a 30B-A3B MoE (~19,000 tensors) far more. The copies are the same at every sync, because the layouts
and the parameters do not move. So `LoadReplay` runs the loader once per bucket under a `TorchFunctionMode` that
records every write into a parameter; if every write is a plain same-dtype copy of a contiguous piece of the
bucket into a contiguous piece of one parameter (or a constant fill) and the copies cover each tensor's bytes
exactly once, the bucket gets a plan: (bucket offset, parameter name, parameter offset, bytes) per piece. Later
syncs run the plan with `copysum.CopyPlan`: one kernel copies every piece and checksums it as it goes.

The checksums are then of what the engine *holds* (its parameters' bytes, per received tensor), which is a
stronger check than the bytes received: a plan that wrote the wrong place would show. Anything the recorder does
not understand (a transpose, a dtype conversion, a write from a computed tensor, an in-place op other than
copy/fill) leaves that bucket on the loader, with a log line saying why.

A tensor-parallel worker (`sharded=True`) holds only its slice of each tensor: its loader copies a block of rows
(column-parallel layers, q/k/v) or a block of every row (row-parallel layers: a strided view of the received
tensor) into its parameter. Such a bucket gets a *sharded* plan when every write is a same-dtype copy of at most
two dimensions with contiguous rows, each read from inside one received tensor, and no two writes overlap: the
copies run as one kernel over every row, and a second pass checksums the received tensors whole (what the
trainer checksummed; a worker cannot checksum the whole tensor from its slice), as the loader path does for such
engines. A bucket whose tensors a worker loads whole still gets a full plan.

Memory that moves (a parameter reallocated on wake-up) only rebuilds the addresses; a parameter whose shape, dtype
or size changed sends the bucket back to the loader, which raises its own errors.
This module knows nothing of vLLM or Ray.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from rlhf_orch.weight_sync.buckets import BucketLayout, unpack
from rlhf_orch.weight_sync.copysum import CopyPlan, PlanCache, Run, as_bytes

logger = logging.getLogger(__name__)

Params = Callable[[], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Piece:
    src_off: int      # bytes from the bucket's start
    param: str
    dst_off: int      # bytes from the parameter's first element
    nbytes: int       # per row
    slot: int         # index of the tensor within the bucket
    rows: int = 1     # > 1 only in sharded plans: `rows` rows of `nbytes`, `*_pitch` bytes apart
    src_pitch: int = 0
    dst_pitch: int = 0

    def extents(self) -> tuple[int, int]:
        """Bytes spanned from the first row's start to the last row's end, in the source and the destination."""
        return (self.rows - 1) * self.src_pitch + self.nbytes, (self.rows - 1) * self.dst_pitch + self.nbytes


@dataclass(frozen=True)
class Fill:
    param: str
    dst_off: int
    nbytes: int
    dtype: torch.dtype
    value: float


@dataclass
class BucketPlan:
    pieces: list[Piece]
    fills: list[Fill]
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]   # every parameter the plan writes, as recorded
    sharded: bool = False   # the pieces load part of the tensors; the checksums are of the received tensors


class _Recorder(TorchFunctionMode):
    """Records the writes a loader makes into parameter storage; anything else in place on a parameter is fatal."""

    def __init__(self, storages: dict[int, str]):
        super().__init__()
        self.storages = storages
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.fills: list[tuple[torch.Tensor, float]] = []
        self.problem: str | None = None

    def _param_of(self, t) -> str | None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return None
        return self.storages.get(t.untyped_storage().data_ptr())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name.startswith("_foreach_") and name.endswith("_") and args and isinstance(args[0], (list, tuple)):
            hit = [d for d in args[0] if self._param_of(d) is not None]
            if hit and name == "_foreach_copy_":
                self.copies.extend((d, s) for d, s in zip(args[0], args[1]) if self._param_of(d) is not None)
            elif hit:
                self.problem = self.problem or f"the loader calls {name} on parameter {self._param_of(hit[0])}"
            return func(*args, **kwargs)
        target = self._param_of(args[0]) if args else None
        if target is not None:
            if name == "copy_":
                self.copies.append((args[0], args[1]))
            elif name in ("fill_", "zero_"):
                value = 0.0 if name == "zero_" else args[1]
                if isinstance(value, torch.Tensor):
                    value = value.item()
                self.fills.append((args[0], float(value)))
            elif name.endswith("_") and not name.startswith("__") or name == "__setitem__":
                self.problem = self.problem or f"the loader calls {name} on parameter {target}"
        return func(*args, **kwargs)


def _rows(src: torch.Tensor, dst: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(rows, elements per row, source row stride, destination row stride) of a copy between two same-shape
    views whose dimensions merge into at most two with contiguous rows in both; None otherwise."""
    if src.numel() == 0:
        return 1, 0, 0, 0
    dims = [[n, a, b] for n, a, b in zip(src.shape, src.stride(), dst.stride()) if n != 1]
    if not dims:
        return 1, 1, 0, 0
    merged = [dims[-1]]
    for n, a, b in reversed(dims[:-1]):
        inner = merged[0]
        if a == inner[1] * inner[0] and b == inner[2] * inner[0]:
            inner[0] *= n          # contiguous over both dimensions in both views: one longer row
        else:
            merged.insert(0, [n, a, b])
    if len(merged) > 2 or merged[-1][1] != 1 or merged[-1][2] != 1:
        return None
    return (1, merged[0][0], 0, 0) if len(merged) == 1 else (merged[0][0], merged[1][0], merged[0][1], merged[0][2])


def _whole(layout: BucketLayout, pieces: list[Piece]) -> list[Piece] | str:
    """Pieces that cover every tensor's bytes exactly once, in runs that keep its 8-byte words whole (checksums
    add up), each tagged with its tensor's slot; or why they do not."""
    pieces = sorted(pieces, key=lambda x: x.src_off)
    out, i = [], 0
    for k, slot in enumerate(layout.slots):
        pos, stop = slot.offset, slot.offset + slot.nbytes
        while i < len(pieces) and pieces[i].src_off < stop:
            pc = pieces[i]
            if pc.rows > 1:
                return f"{pc.param} is loaded through a strided view"
            if pc.src_off != pos:
                return f"{slot.name}: bytes {pos}..{pc.src_off} of the bucket are loaded {'twice' if pc.src_off < pos else 'nowhere'}"
            if (pos - slot.offset) % 8 or (pc.src_off + pc.nbytes != stop and pc.nbytes % 8):
                return f"{slot.name} is split at a byte offset that is not a multiple of 8"
            out.append(Piece(pc.src_off, pc.param, pc.dst_off, pc.nbytes, k))
            pos += pc.nbytes
            i += 1
        if pos != stop:
            return f"{slot.name} is not loaded whole ({pos - slot.offset} of {slot.nbytes} bytes: a sharded engine?)"
    if i != len(pieces):
        return "the loader copied bytes from outside the bucket's tensors"
    return out


def _sharded(layout: BucketLayout, pieces: list[Piece]) -> list[Piece] | str:
    """Pieces of a tensor-parallel worker: each read from inside one received tensor, no two writing the same
    bytes (the kernel runs them in any order); or why not."""
    out, k = [], 0
    slots = layout.slots
    for pc in sorted(pieces, key=lambda x: x.src_off):
        while k < len(slots) and slots[k].offset + slots[k].nbytes <= pc.src_off:
            k += 1
        if k == len(slots) or pc.src_off < slots[k].offset or pc.src_off + pc.extents()[0] > slots[k].offset + slots[k].nbytes:
            return f"{pc.param} is loaded from bytes outside one received tensor"
        out.append(Piece(pc.src_off, pc.param, pc.dst_off, pc.nbytes, k, pc.rows, pc.src_pitch, pc.dst_pitch))
    last: dict[str, int] = {}
    for pc in sorted(out, key=lambda x: (x.param, x.dst_off)):
        if pc.dst_off < last.get(pc.param, 0):
            return f"{pc.param} is written twice by the loader"
        last[pc.param] = pc.dst_off + pc.extents()[1]
    return out


def _record(layout: BucketLayout, buf: torch.Tensor, params: dict[str, torch.Tensor], load_fn,
            sharded: bool = False) -> BucketPlan | str:
    """Run the loader on one bucket while recording its writes; a plan, or why the bucket cannot have one."""
    storages = {p.untyped_storage().data_ptr(): n for n, p in params.items() if p.numel()}
    rec = _Recorder(storages)
    with torch.no_grad(), rec:
        load_fn(list(unpack(layout, buf)))
    if rec.problem:
        return rec.problem
    base, end = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
    pieces: list[Piece] = []
    for dst, src in rec.copies:
        pname = rec.storages[dst.untyped_storage().data_ptr()]
        if not isinstance(src, torch.Tensor) or not base <= src.data_ptr() < end:
            return f"{pname} is loaded from a computed tensor, not from the received bytes"
        if src.dtype != dst.dtype or src.shape != dst.shape:
            return f"{pname} is loaded with a dtype or shape conversion"
        shape = _rows(src, dst)
        if shape is None or shape[0] > 1 and not sharded:
            return f"{pname} is loaded through a strided view"
        rows, elems, src_stride, dst_stride = shape
        es = src.element_size()
        p = params[pname]
        pc = Piece(src.data_ptr() - base, pname, dst.data_ptr() - p.data_ptr(), elems * es, -1, rows,
                   src_stride * es, dst_stride * es)
        src_span, dst_span = pc.extents()
        if pc.dst_off < 0 or pc.dst_off + dst_span > p.numel() * p.element_size():
            return f"{pname} is written outside its own elements"
        if src.data_ptr() + src_span > end:
            return f"{pname} is loaded from bytes outside the bucket"
        pieces.append(pc)
    fills = []
    for dst, value in rec.fills:
        pname = rec.storages[dst.untyped_storage().data_ptr()]
        p = params[pname]
        if not dst.is_contiguous():
            return f"{pname} is filled through a strided view"
        fills.append(Fill(pname, dst.data_ptr() - p.data_ptr(), dst.numel() * dst.element_size(), dst.dtype, value))
    out = _whole(layout, pieces)
    partial = isinstance(out, str) and sharded
    if partial:
        out = _sharded(layout, pieces)
    if isinstance(out, str):
        return out
    used = {pc.param for pc in out} | {f.param for f in fills}
    return BucketPlan(out, fills, {n: (tuple(params[n].shape), params[n].dtype) for n in used}, partial)


class _ShardedRun:
    """A sharded plan's two passes: the slices copied (their sums unused), then the received tensors checksummed."""

    def __init__(self, copies: CopyPlan, sums: CopyPlan):
        self.copies, self.sums = copies, sums
        self.kernel_runs = copies.kernel_runs + sums.kernel_runs
        self.cacheable = copies.cacheable and sums.cacheable
        # The copies' own sums (of slices) are never read: one buffer they add into, made once, never zeroed.
        self._discard = torch.zeros(copies.n_slots, dtype=torch.int64, device=copies.device)

    def run(self, copy: bool = True, out: torch.Tensor | None = None) -> list[int] | None:
        if copy:
            self.copies.run(copy=True, out=self._discard)
        return self.sums.run(copy=False, out=out)


class LoadReplay:
    """Per receiver: one plan per bucket index, learnt at its first load (see the module doc)."""

    def __init__(self, params: Params, enabled: bool = True, sharded: bool = False):
        self.params = params
        self.enabled = enabled
        self.sharded = sharded   # a tensor-parallel worker: plans may load part of each tensor
        self.plans: dict[int, BucketPlan | str] = {}
        self._copy_plans = PlanCache()   # by (bucket, buffer), while the parameters stay where they were

    def load(self, layout: BucketLayout, buf: torch.Tensor, load_fn,
             out: torch.Tensor | None = None) -> list[int] | bool | None:
        """Load one bucket, by its plan or by `load_fn`. Returns the per-tensor checksums of what the engine now
        holds, or None when `load_fn` did the loading (the caller checksums as it always did). With `out` (zeroed
        int64 on the device, one per tensor) a planned bucket's sums go there without a host wait, and True
        is returned in their place."""
        if not self.enabled:
            load_fn(list(unpack(layout, buf)))
            return None
        plan = self.plans.get(layout.index)
        params = self.params()
        if plan is None:
            plan = self.plans[layout.index] = _record(layout, buf, params, load_fn, self.sharded)
            if isinstance(plan, str):
                logger.info("weight sync: bucket %d loads through the engine's loader: %s", layout.index, plan)
                return None
            return self._run(layout, plan, buf, params, copy=False, out=out)   # the recording run did the copies
        if isinstance(plan, str) or not self._fits(plan, params, buf.device):
            load_fn(list(unpack(layout, buf)))
            return None
        return self._run(layout, plan, buf, params, copy=True, out=out)

    def status(self) -> dict:
        """Which buckets replay and why the others do not (for tests, benchmarks and logs)."""
        reasons = {i: p for i, p in self.plans.items() if isinstance(p, str)}
        return {"enabled": self.enabled, "replayed": sorted(i for i in self.plans if i not in reasons),
                "sharded": sorted(i for i, p in self.plans.items() if not isinstance(p, str) and p.sharded),
                "loader": reasons, "fused_kernel": any(cp.kernel_runs for cp in self._copy_plans.plans())}

    @staticmethod
    def _fits(plan: BucketPlan, params: dict[str, torch.Tensor], device: torch.device) -> bool:
        for name, (shape, dtype) in plan.shapes.items():
            p = params.get(name)
            if p is None or tuple(p.shape) != shape or p.dtype != dtype or p.device != device:
                return False   # asleep (emptied) or replaced: the loader knows what to say
        return True

    def _run(self, layout: BucketLayout, plan: BucketPlan, buf: torch.Tensor, params, copy: bool,
             out: torch.Tensor | None) -> list[int] | bool:
        def build() -> CopyPlan | _ShardedRun:
            bytes_of = {n: as_bytes(params[n]) for n in plan.shapes}
            src = buf.view(torch.uint8)
            runs = [Run(_span(src, pc.src_off, pc.rows, pc.nbytes, pc.src_pitch),
                        _span(bytes_of[pc.param], pc.dst_off, pc.rows, pc.nbytes, pc.dst_pitch), pc.slot)
                    for pc in plan.pieces]
            copies = CopyPlan(runs, len(layout.slots), buf.device)
            if not plan.sharded:
                return copies
            whole = [Run(src[s.offset:s.offset + s.nbytes], src[s.offset:s.offset + s.nbytes], k)
                     for k, s in enumerate(layout.slots)]
            return _ShardedRun(copies, CopyPlan(whole, len(layout.slots), buf.device))

        # Keyed by the parameters' addresses: memory that moved (a wake-up) gets a new plan.
        addresses = tuple(params[n].data_ptr() for n in plan.shapes)
        cp = self._copy_plans.get((layout.index, buf.data_ptr()), addresses, build)
        sums = cp.run(copy=copy, out=out)   # (a sharded plan's recording run did the copies too: its sums pass only)
        for f in plan.fills:
            as_bytes(params[f.param])[f.dst_off:f.dst_off + f.nbytes].view(f.dtype).fill_(f.value)
        return True if out is not None else sums


def _span(flat: torch.Tensor, off: int, rows: int, nbytes: int, pitch: int) -> torch.Tensor:
    """`rows` rows of `nbytes` bytes, `pitch` apart, from byte `off` of a flat uint8 view (1-D for one row)."""
    if rows == 1:
        return flat[off:off + nbytes]
    return flat.as_strided((rows, nbytes), (pitch, 1), flat.storage_offset() + off)
