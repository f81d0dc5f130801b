"""Inside SGLang 0.5.17's scheduler processes: the census and the retraction behind the streaming engine's pauses.

`rlhf_sglang_census` is a `custom_weight_loader` (the one entry SGLang gives into the scheduler; see sglang_stream.py):
StreamingSGLangEngine calls it with one empty tensor whose name carries the request, and it runs on the scheduler's
thread, between two iterations of its event loop, with the Scheduler on its call stack. Two operations:

- "count" (at a "keep" pause; the scheduler was paused `in_place`, which is O(1)): wait for the GPU step launched
  before the pause (`torch.cuda.synchronize`: without it the weight load that follows could overlap that step's
  forward, because SGLang's overlap loop fences only the step's input reads) and report how many tokens every
  unfinished request will hold once that step is processed. Nothing is changed.
- "retract" (after the weight load, in finish_sync, or in resume when no load came): process the pending step (its
  tokens were sampled under the old weights), then take every running request out of the batch with its tokens kept,
  so it re-prefills prompt + tokens under the new weights, and drop the old-weight KV. "bulk" does that in one pass:
  the requests are reset as SGLang's retract resets them, and the radix tree, the request-to-token pool and the KV
  allocator are emptied as flush_cache empties them (a few ms at 512 requests, against SGLang's per-request release,
  0.18 ms each). Only for the plain configuration this was read against (radix or chunk cache, token or paged
  allocator, no speculative decoding, disaggregation, hierarchical or sparse cache, grammar or pipeline parallelism);
  otherwise, or with bulk off, SGLang's own `pause_generation(mode="retract")` does it, followed by an eviction of
  the now unlocked tree. Either way the report holds the exact counts afterwards.
- "drop" (at an "abort" pause; the scheduler was paused `in_place`): wait for the step launched before the pause, as
  "count" does, then end every request the scheduler holds without another step: the pending step's result is
  discarded unprocessed (the aborted groups are re-queued whole, their tokens are not wanted), the waiting queue and
  the running batch are emptied and the pools reset at once. The actor has removed the requests' TokenizerManager
  states first, so nothing waits for an answer. Where bulk does not apply (or with bulk off): SGLang's own retract
  and `abort_request(abort_all)`, what the abort pause sent before, run here instead. Afterwards the scheduler is
  idle: flush_cache (finish_sync) and release_memory_occupation (sleep) find nothing left to wait for.

Private SGLang 0.5.17 internals are read and written here (result_queue, last_batch, chunked_req, the pools);
docs/sglang_pause_plan.md gives the file:line of each. It imports SGLang only inside the scheduler, when needed.
"""
from __future__ import annotations

import json
import sys
import time

import torch

from rlhf_orch.engines.sglang_stream import write_report

CENSUS = "rlhf_orch.engines.sglang_sched.rlhf_sglang_census"   # a custom_weight_loader: runs in the schedulers
PREFIX = "rlhf_orch.census:"
OPS = ("count", "retract", "drop")
_CACHES = ("RadixCache", "ChunkCache")
_ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")


def find_scheduler():
    """The Scheduler whose process_input_requests called us (the update handler runs on its stack)."""
    f = sys._getframe(1)
    while f is not None:
        s = f.f_locals.get("self")
        for obj in (s, getattr(s, "scheduler", None)):
            if all(hasattr(obj, a) for a in ("waiting_queue", "running_batch", "tree_cache")):
                return obj
        f = f.f_back
    raise RuntimeError(f"{CENSUS}: no SGLang Scheduler on the call stack")


def rlhf_sglang_census(model, named_tensors) -> None:
    """custom_weight_loader entry, called with one tensor named "rlhf_orch.census:<json {dir, seq, op, bulk}>".

    Writes census<rank>.json: {seq, rank, op, paused, running, census: {rid: tokens}} and, after "retract", how it
    was done and the cache's post-conditions (evictable_after and protected must be 0). An error is written as
    {"error": ...} and raised on the actor's side: an exception leaving a custom loader kills SGLang's scheduler."""
    for name, _ in named_tensors:
        if not name.startswith(PREFIX):
            raise RuntimeError(f"{CENSUS} only takes a census request; got tensor {name!r}")
        cfg = json.loads(name[len(PREFIX):])
        rec: dict = {"seq": cfg["seq"], "rank": 0, "op": cfg.get("op", "count")}
        try:
            _serve(rec, bool(cfg.get("bulk", True)))
        except Exception as e:   # reported, not raised: see the docstring
            rec["error"] = f"{type(e).__name__}: {e}"
        write_report(cfg["dir"], f"census{rec['rank']}", rec)


def _serve(rec: dict, bulk: bool) -> None:
    op = rec["op"]
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; use one of {OPS}")
    sched = find_scheduler()
    t0 = time.perf_counter()
    rec.update(rank=_rank(sched), paused=bool(getattr(sched, "_engine_paused", False)),
               running=len(sched.running_batch.reqs))
    if op == "count":
        if torch.cuda.is_available():
            torch.cuda.synchronize()       # the step launched before the pause ends before any weight is written
        pend = pending(sched)
        extra = pending_tokens(pend)
        rec["census"] = {rid: len(r.output_ids) + extra.get(rid, 0)
                         for rid, r in held(sched, pend).items() if not r.finished()}
        rec["pending"] = sum(extra.values())
    else:
        rec.update(retract(sched, bulk) if op == "retract" else drop(sched, bulk))
        rec["census"] = {str(r.rid): len(r.output_ids) for r in sched.waiting_queue if not r.finished()}
    rec["hook_s"] = time.perf_counter() - t0


def _rank(sched) -> int:
    try:
        from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except ImportError:
        return int(getattr(sched, "tp_rank", 0))


def pending(sched):
    """(batch, result) of the step launched before an in_place pause and not processed yet, or None. The overlap loop
    launches step k, then processes step k - 1 (scheduler.py:1766-1773): one result stays queued while paused."""
    q = getattr(sched, "result_queue", None)
    if getattr(sched, "enable_overlap", False) and sched.last_batch is not None and q:
        return q[0]
    return None


def held(sched, pend) -> dict:
    """rid -> request of every request the scheduler holds: queued, running, just prefilled (an extend last_batch or
    the pending batch, not merged into running_batch yet) or mid-chunk."""
    reqs: dict = {}
    lb = sched.last_batch
    groups = [sched.waiting_queue, sched.running_batch.reqs, pend[0].reqs if pend else (),
              lb.reqs if lb is not None and lb.forward_mode.is_extend() else ()]
    for group in groups:
        for r in group:
            reqs.setdefault(str(r.rid), r)
    ch = getattr(sched, "chunked_req", None)
    if ch is not None:
        reqs.setdefault(str(ch.rid), ch)
    return reqs


def pending_tokens(pend) -> dict:
    """rid -> tokens that processing the pending step will append (batch_result_processor.py:255-267 for a prefill,
    :846-858 for a decode step without speculative decoding; nothing for idle or prebuilt steps)."""
    if pend is None:
        return {}
    b = pend[0]
    if b.forward_mode.is_decode():
        return {str(r.rid): 1 for r in b.reqs if not r.finished() and not r.is_retracted}
    if b.forward_mode.is_extend():
        return {str(r.rid): 1 for r in b.reqs
                if not r.finished() and not r.is_retracted and r.inflight_middle_chunks <= 0}
    return {}


def bulk_refusal(sched) -> str:
    """Why the bulk retraction does not apply to this scheduler ("" when it does)."""
    mode = getattr(sched, "disaggregation_mode", None)
    spec = getattr(sched, "spec_algorithm", None)
    checks = (
        (type(sched.tree_cache).__name__ in _CACHES, f"tree cache {type(sched.tree_cache).__name__}"),
        (type(sched.token_to_kv_pool_allocator).__name__ in _ALLOCATORS,
         f"allocator {type(sched.token_to_kv_pool_allocator).__name__}"),
        (type(sched.req_to_token_pool).__name__ == "ReqToTokenPool", "a hybrid request-to-token pool"),
        (mode is None or getattr(mode, "value", mode) == "null", "disaggregation"),
        (spec is None or spec.is_none(), "speculative decoding"),
        (getattr(sched, "draft_worker", None) is None, "a draft worker"),
        (getattr(sched, "hisparse_coordinator", None) is None, "a sparse cache"),
        (getattr(sched, "dllm_config", None) is None, "a diffusion LM"),
        (int(getattr(getattr(sched, "server_args", None), "pp_size", 1) or 1) == 1, "pipeline parallelism"),
        (not any(getattr(r, "grammar", None) is not None for r in held(sched, pending(sched)).values()),
         "a request with a grammar"),
        (all(r.req_pool_idx is None for r in sched.waiting_queue), "a queued request holds KV"),
    )
    return next((why for ok, why in checks if not ok), "")


def retract(sched, bulk: bool) -> dict:
    """Settle the pending step, retract every request holding KV (tokens kept) and drop the old-weight KV."""
    why = bulk_refusal(sched) if bulk else "bulk off"
    if why:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams
        queued = len(sched.waiting_queue)
        sched.pause_generation(PauseGenerationReqInput(mode="retract"))   # SGLang's own: settle, release, re-queue
        tc = sched.tree_cache
        rec = {"how": "sglang", "why": why, "retracted": len(sched.waiting_queue) - queued,
               "evictable_before": int(tc.evictable_size())}
        if not sched.running_batch.reqs and rec["evictable_before"] > 0:
            tc.evict(EvictParams(num_tokens=rec["evictable_before"]))    # the prompts' old-weight KV, unlocked now
        return {**rec, **_cache_left(sched)}
    if pending(sched) is not None:              # as pause_generation does first (scheduler.py:4479-4482)
        b, r = sched.result_queue.popleft()
        sched.process_batch_result(b, r)        # streams the step's tokens; finished requests release their KV
    reqs, seen = [], set()
    lb = sched.last_batch
    for r in list(sched.running_batch.reqs) + (list(lb.reqs) if lb is not None and lb.forward_mode.is_extend() else []):
        if not r.finished() and id(r) not in seen:
            reqs.append(r)
            seen.add(id(r))
    ch = sched.chunked_req
    if ch is not None and not ch.finished() and id(ch) not in seen:
        reqs.append(ch)
    _empty(sched, reqs)                         # the retracted requests then wait in the queue and hold nothing
    for r in reqs:
        r.reset_for_retract()                   # last_node None, prefix and committed KV 0, is_retracted; tokens kept
        sched._add_request_to_queue(r)
    return {"how": "bulk", "retracted": len(reqs), **_cache_left(sched)}


def _empty(sched, reqs) -> None:
    """Take `reqs` out of their pool slots and the scheduler's batches, and reset the pools at once: release_req
    without the per-request frees (schedule_batch.py:1834-1860), then flush_cache's three resets
    (scheduler.py:4135-4142) without its idle check. Shared by the bulk retraction and the bulk drop."""
    for r in reqs:
        r.req_pool_idx = None
        r.kv = None
    ch = sched.chunked_req
    sched.last_batch = None
    sched.cur_batch_for_debug = None
    sched.running_batch.reqs = []
    sched.running_batch.batch_is_full = False
    if getattr(sched, "_pending_chunked_abort_req", None) is ch:
        sched._pending_chunked_abort_req = None
    sched.chunked_req = None
    sched.tree_cache.reset()
    sched.req_to_token_pool.clear()
    sched.token_to_kv_pool_allocator.clear()


def _cache_left(sched) -> dict:
    """What the radix cache still holds (both must be 0 after a retraction or a drop: no old-weight KV)."""
    tc = sched.tree_cache
    return {"evictable_after": int(tc.evictable_size()), "protected": int(tc.protected_size())}


def drop(sched, bulk: bool) -> dict:
    """End every request the scheduler holds (an "abort" pause) and empty the pools; returns how, and the idle check."""
    why = bulk_refusal(sched) if bulk else "bulk off"
    grammars = getattr(sched, "grammar_manager", None)
    if not why and grammars is not None and grammars.has_waiting_grammars():
        why = "a request waiting for its grammar"
    if why:
        from sglang.srt.managers.io_struct import AbortReq, PauseGenerationReqInput
        sched.pause_generation(PauseGenerationReqInput(mode="retract"))   # settle the pending step, re-queue
        queued = len(sched.waiting_queue)
        sched.abort_request(AbortReq(abort_all=True))   # pops them; its AbortReq echoes find no state in our manager
        rec = {"how": "sglang", "why": why, "dropped": queued}
    else:
        if torch.cuda.is_available():
            torch.cuda.synchronize()       # the step launched before the pause ends before any weight is written
        pend = pending(sched)
        reqs = held(sched, pend)
        if getattr(sched, "result_queue", None):
            sched.result_queue.clear()     # not processed: the step's tokens belong to the requests dropped here
        sched.waiting_queue.clear()
        _empty(sched, reqs.values())
        sched._pending_chunked_abort_req = None   # whichever request it names is dropped too
        rec = {"how": "bulk", "dropped": len(reqs)}
    rec["idle"] = bool(not sched.waiting_queue and not sched.running_batch.reqs and sched.chunked_req is None
                       and not getattr(sched, "result_queue", None))
    return {**rec, **_cache_left(sched)}
