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
not understand (a transpose, a dtype conversion, a write from a computed tensor, a tensor only partly loaded as
under tensor parallelism, an in-place op other than copy/fill) leaves that bucket on the loader, with a log line
saying why. Memory that moves (a parameter reallocated on wake-up) only rebuilds the addresses; a parameter whose
shape, dtype or size changed sends the bucket back to the loader, which raises its own errors.
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
    nbytes: int
    slot: int         # index of the tensor within the bucket


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


def _record(layout: BucketLayout, buf: torch.Tensor, params: dict[str, torch.Tensor], load_fn) -> BucketPlan | str:
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
        if not (src.is_contiguous() and dst.is_contiguous()):
            return f"{pname} is loaded through a strided view"
        nbytes = src.numel() * src.element_size()
        p = params[pname]
        dst_off = dst.data_ptr() - p.data_ptr()
        if dst_off < 0 or dst_off + nbytes > p.numel() * p.element_size():
            return f"{pname} is written outside its own elements"
        pieces.append(Piece(src.data_ptr() - base, pname, dst_off, nbytes, -1))
    fills = []
    for dst, value in rec.fills:
        pname = rec.storages[dst.untyped_storage().data_ptr()]
        p = params[pname]
        if not dst.is_contiguous():
            return f"{pname} is filled through a strided view"
        fills.append(Fill(pname, dst.data_ptr() - p.data_ptr(), dst.numel() * dst.element_size(), dst.dtype, value))
    # Every tensor's bytes covered exactly once, in pieces that keep its 8-byte words whole (checksums add up).
    pieces.sort(key=lambda x: x.src_off)
    out, i = [], 0
    for k, slot in enumerate(layout.slots):
        pos, stop = slot.offset, slot.offset + slot.nbytes
        while i < len(pieces) and pieces[i].src_off < stop:
            pc = pieces[i]
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
    used = {pc.param for pc in out} | {f.param for f in fills}
    return BucketPlan(out, fills, {n: (tuple(params[n].shape), params[n].dtype) for n in used})


class LoadReplay:
    """Per receiver: one plan per bucket index, learnt at its first load (see the module doc)."""

    def __init__(self, params: Params, enabled: bool = True):
        self.params = params
        self.enabled = enabled
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
            plan = self.plans[layout.index] = _record(layout, buf, params, load_fn)
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
        def build() -> CopyPlan:
            bytes_of = {n: as_bytes(params[n]) for n in plan.shapes}
            src = buf.view(torch.uint8)
            runs = [Run(src[pc.src_off:pc.src_off + pc.nbytes], bytes_of[pc.param][pc.dst_off:pc.dst_off + pc.nbytes],
                        pc.slot) for pc in plan.pieces]
            return CopyPlan(runs, len(layout.slots), buf.device)

        # Keyed by the parameters' addresses: memory that moved (a wake-up) gets a new plan.
        addresses = tuple(params[n].data_ptr() for n in plan.shapes)
        cp = self._copy_plans.get((layout.index, buf.data_ptr()), addresses, build)
        sums = cp.run(copy=copy, out=out)
        for f in plan.fills:
            as_bytes(params[f.param])[f.dst_off:f.dst_off + f.nbytes].view(f.dtype).fill_(f.value)
        return True if out is not None else sums
