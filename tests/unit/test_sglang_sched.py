"""The scheduler side of the streaming SGLang engine's pauses (rlhf_orch/engines/sglang_sched.py), on CPU, against a
fake of the SGLang 0.5.17 Scheduler state it reads and writes: the overlap loop's pending step (last_batch and one
queued result), the running batch, the waiting queue, a chunked request and the three pools. The fake's
process_batch_result appends one token per request by SGLang's rules (a decode step: every unfinished, unretracted
request; a prefill: the same less middle chunks); the real scheduler is exercised by tests/gpu/test_sglang_streaming.py.
"""
from __future__ import annotations

import collections
import json
import sys
import types
from dataclasses import dataclass

import pytest

from rlhf_orch.engines.sglang_sched import PREFIX, bulk_refusal, held, rlhf_sglang_census


@dataclass
class PauseGenerationReqInput:
    mode: str = "abort"


@dataclass
class AbortReq:
    abort_all: bool = False


@dataclass
class EvictParams:
    num_tokens: int = 0


@pytest.fixture(autouse=True)
def fake_sglang(monkeypatch):
    for name in ("sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.managers.io_struct",
                 "sglang.srt.mem_cache", "sglang.srt.mem_cache.base_prefix_cache"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["sglang.srt.managers.io_struct"].PauseGenerationReqInput = PauseGenerationReqInput
    sys.modules["sglang.srt.managers.io_struct"].AbortReq = AbortReq
    sys.modules["sglang.srt.mem_cache.base_prefix_cache"].EvictParams = EvictParams


class Mode:
    def __init__(self, kind):
        self.kind = kind

    def is_decode(self):
        return self.kind == "decode"

    def is_extend(self):
        return self.kind == "extend"


class Req:
    def __init__(self, rid, n, max_new=100, middle=0):
        self.rid, self.output_ids, self.max_new = rid, list(range(n)), max_new
        self.inflight_middle_chunks, self.is_retracted, self.grammar = middle, False, None
        self.req_pool_idx, self.kv, self.resets = 7, object(), 0

    def finished(self):
        return len(self.output_ids) >= self.max_new

    def reset_for_retract(self):
        assert self.kv is None, "expect it is already released"
        self.resets += 1
        self.is_retracted = True


class Batch:
    def __init__(self, kind, reqs):
        self.forward_mode, self.reqs, self.batch_is_full = Mode(kind), reqs, True


class RadixCache:
    def __init__(self):
        self.evictable, self.protected, self.resets, self.evicted = 40, 12, 0, 0

    def evictable_size(self):
        return self.evictable

    def protected_size(self):
        return self.protected

    def reset(self):
        self.evictable = self.protected = 0
        self.resets += 1

    def evict(self, params):
        self.evicted += params.num_tokens
        self.evictable -= params.num_tokens


class ReqToTokenPool:
    cleared = 0

    def clear(self):
        self.cleared += 1


class TokenToKVPoolAllocator(ReqToTokenPool):
    pass


class GrammarManager:
    def __init__(self):
        self.grammar_queue = []

    def has_waiting_grammars(self):
        return bool(self.grammar_queue)


class Scheduler:
    """The state sglang_sched touches, after an in_place pause with `pend` launched and unprocessed."""

    def __init__(self, running, waiting, pend: Batch | None, chunked=None):
        self.waiting_queue, self.running_batch = list(waiting), Batch("decode", list(running))
        self.enable_overlap, self.last_batch = True, pend
        self.result_queue = collections.deque([(pend, "result")] if pend else [])
        self.chunked_req, self._pending_chunked_abort_req, self.cur_batch_for_debug = chunked, None, pend
        self.tree_cache, self.req_to_token_pool = RadixCache(), ReqToTokenPool()
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator()
        self.tp_rank, self._engine_paused, self.processed, self.sglang_pauses = 0, True, 0, []
        self.grammar_manager, self.echoes = GrammarManager(), []

    def process_batch_result(self, batch, result):
        assert result == "result"
        self.processed += 1
        for r in batch.reqs:
            if not r.finished() and not r.is_retracted and (batch.forward_mode.is_decode() or r.inflight_middle_chunks <= 0):
                r.output_ids.append(len(r.output_ids))
                if r.finished():
                    r.req_pool_idx = r.kv = None     # released (inserted into the tree) by SGLang

    def _add_request_to_queue(self, req):
        self.waiting_queue.append(req)

    def pause_generation(self, req):                 # SGLang's own retract, as far as sglang_sched relies on it
        self.sglang_pauses.append(req.mode)
        if self.last_batch is not None and self.result_queue:
            self.process_batch_result(*self.result_queue.popleft())
        for r in [r for r in self.running_batch.reqs if not r.finished()]:
            r.req_pool_idx = r.kv = None
            r.reset_for_retract()
            self.waiting_queue.append(r)
        self.running_batch.reqs, self.last_batch = [], None
        self.tree_cache.protected = 0

    def abort_request(self, req):                    # abort_all after a retract: every queued request popped, echoed
        assert req.abort_all
        self.echoes += [r.rid for r in self.waiting_queue]
        self.waiting_queue = []

    def process_input_requests(self, names):        # the update handler runs a few frames below the scheduler
        _weight_updater(names)


def _weight_updater(names):
    rlhf_sglang_census(None, [(n, None) for n in names])


def call(sched, tmp_path, op, seq=1, bulk=True) -> dict:
    sched.process_input_requests([PREFIX + json.dumps({"dir": str(tmp_path), "seq": seq, "op": op, "bulk": bulk})])
    return json.loads((tmp_path / "census0.json").read_text())


def decode_case():
    """a and b decode on; f ends in the pending step; z ended before it; c waits, fresh."""
    a, b, f, z = Req("a", 3), Req("b", 5), Req("f", 5, max_new=6), Req("z", 9, max_new=9)
    fresh = Req("c", 0)
    fresh.req_pool_idx = fresh.kv = None
    return Scheduler([a, b, f, z], [fresh], Batch("decode", [a, b, f, z])), (a, b, fresh)


def test_count_predicts_the_pending_step_and_changes_nothing(tmp_path):
    sched, (a, b, fresh) = decode_case()
    rec = call(sched, tmp_path, "count", seq=3)
    # a, b and f get the pending step's token; the fresh request none; the finished one is not counted
    assert rec["census"] == {"a": 4, "b": 6, "f": 6, "c": 0} and rec["pending"] == 3 and rec["seq"] == 3
    assert rec["paused"] and rec["op"] == "count"
    assert sched.processed == 0 and len(sched.result_queue) == 1 and len(a.output_ids) == 3
    assert sched.running_batch.reqs and sched.tree_cache.resets == 0 and a.req_pool_idx == 7


def test_count_sees_a_fresh_prefill_and_skips_a_middle_chunk(tmp_path):
    d, e, mid = Req("d", 0), Req("e", 0), Req("m", 0, middle=1)
    sched = Scheduler([Req("a", 2)], [], Batch("extend", [d, e, mid]), chunked=mid)
    rec = call(sched, tmp_path, "count")
    # prefilled requests sit in the extend batch only (not yet merged into the running batch); a middle chunk adds
    # no token; the running request is not in this step
    assert rec["census"] == {"a": 2, "d": 1, "e": 1, "m": 0}


@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_bulk_retract_settles_retracts_and_empties_the_pools(tmp_path, kind):
    if kind == "decode":
        sched, _ = decode_case()
    else:
        d, mid = Req("d", 0), Req("m", 0, middle=1)
        sched = Scheduler([Req("a", 2)], [], Batch("extend", [d, mid]), chunked=mid)
    predicted = call(sched, tmp_path, "count", seq=1)["census"]
    rec = call(sched, tmp_path, "retract", seq=2)
    assert rec["how"] == "bulk" and rec["op"] == "retract" and sched.processed == 1 and not sched.result_queue
    # the exact counts after the step equal the pause's prediction, less the request that ended in that step
    assert rec["census"] == {rid: n for rid, n in predicted.items() if rid != "f"}
    assert not sched.running_batch.reqs and sched.last_batch is None and sched.chunked_req is None
    assert not sched.running_batch.batch_is_full
    assert {str(r.rid) for r in sched.waiting_queue} == set(rec["census"])
    for r in sched.waiting_queue:   # held nothing, or was reset once as SGLang's retract resets it (tokens kept)
        assert r.req_pool_idx is None and r.kv is None and r.resets == (r.rid != "c")
    assert (sched.tree_cache.resets, sched.req_to_token_pool.cleared, sched.token_to_kv_pool_allocator.cleared) == (1, 1, 1)
    assert rec["evictable_after"] == 0 and rec["protected"] == 0 and rec["retracted"] == len(rec["census"]) - (kind == "decode")


def test_retract_falls_back_to_sglang_where_bulk_does_not_apply(tmp_path):
    sched, (a, _, _) = decode_case()
    a.grammar = object()
    assert bulk_refusal(sched) == "a request with a grammar"
    predicted = call(sched, tmp_path, "count")["census"]
    rec = call(sched, tmp_path, "retract", seq=2)
    assert rec["how"] == "sglang" and rec["why"] == "a request with a grammar" and sched.sglang_pauses == ["retract"]
    assert rec["retracted"] == 2, "a and b; f ended in the pending step, c was queued already"
    assert rec["census"] == {rid: n for rid, n in predicted.items() if rid != "f"}
    assert sched.tree_cache.evicted == 40 and rec["evictable_after"] == 0
    a.grammar = None
    sched, _ = decode_case()
    assert bulk_refusal(sched) == ""
    rec = call(sched, tmp_path, "retract", seq=3, bulk=False)      # the benchmark's "sglang" variant
    assert rec["how"] == "sglang" and rec["why"] == "bulk off"
    sched, _ = decode_case()
    sched.token_to_kv_pool_allocator = type("SWATokenToKVPoolAllocator", (), {})()
    assert bulk_refusal(sched) == "allocator SWATokenToKVPoolAllocator"


def test_bulk_retract_leaves_a_queued_request_holding_kv_to_sglang(tmp_path):
    sched, (_, _, fresh) = decode_case()
    fresh.req_pool_idx = 3
    rec = call(sched, tmp_path, "retract")
    assert rec["how"] == "sglang" and rec["why"] == "a queued request holds KV"


def test_errors_are_reported_not_raised(tmp_path):
    """An exception leaving a custom loader would kill SGLang's scheduler: the hook reports it instead (the actor
    raises it); only a tensor that is no census request at all is refused outright."""
    sched, _ = decode_case()
    with pytest.raises(RuntimeError, match="only takes a census"):
        rlhf_sglang_census(None, [("model.embed_tokens.weight", None)])
    rlhf_sglang_census(None, [(PREFIX + json.dumps({"dir": str(tmp_path), "seq": 5}), None)])
    rec = json.loads((tmp_path / "census0.json").read_text())
    assert rec["seq"] == 5 and "no SGLang Scheduler" in rec["error"]
    assert "unknown op 'evict'" in call(sched, tmp_path, "evict", seq=6)["error"]
    sched.process_batch_result = lambda batch, result: 1 / 0          # the settle fails inside SGLang
    assert "ZeroDivisionError" in call(sched, tmp_path, "retract", seq=7)["error"]


@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_bulk_drop_ends_every_request_without_a_step_and_leaves_the_scheduler_idle(tmp_path, kind):
    """An "abort" pause: the step launched before it is not processed (its tokens belong to groups re-queued whole),
    queued, running, just-prefilled and mid-chunk requests all go, and the pools are emptied: flush_cache's idle."""
    if kind == "decode":
        sched, _ = decode_case()
    else:
        d, mid = Req("d", 0), Req("m", 0, middle=1)
        sched = Scheduler([Req("a", 2)], [Req("c", 0)], Batch("extend", [d, mid]), chunked=mid)
        sched.waiting_queue[0].req_pool_idx = sched.waiting_queue[0].kv = None
    before = held(sched, sched.result_queue[0])
    rec = call(sched, tmp_path, "drop")
    assert rec["op"] == "drop" and rec["how"] == "bulk" and rec["idle"] and rec["census"] == {}
    assert rec["dropped"] == len(before) == (5 if kind == "decode" else 4)
    assert sched.processed == 0 and not sched.result_queue, "the pending step is discarded, not processed"
    assert not sched.waiting_queue and not sched.running_batch.reqs and sched.last_batch is None
    assert sched.chunked_req is None and not sched.running_batch.batch_is_full and not sched.sglang_pauses
    assert (sched.tree_cache.resets, sched.req_to_token_pool.cleared, sched.token_to_kv_pool_allocator.cleared) == (1, 1, 1)
    assert rec["evictable_after"] == 0 and rec["protected"] == 0 and not sched.echoes


def test_drop_falls_back_to_sglangs_retract_and_abort_all(tmp_path):
    sched, (a, _, _) = decode_case()
    a.grammar = object()
    rec = call(sched, tmp_path, "drop")
    assert rec["how"] == "sglang" and rec["why"] == "a request with a grammar" and sched.sglang_pauses == ["retract"]
    # SGLang's retract settled the pending step (f ended in it), re-queued a and b behind c; abort_all popped them
    assert sched.processed == 1 and rec["dropped"] == 3 and sorted(sched.echoes) == ["a", "b", "c"]
    assert rec["idle"] and rec["census"] == {}
    a.grammar = None
    sched, _ = decode_case()
    sched.grammar_manager.grammar_queue.append(Req("g", 0))
    rec = call(sched, tmp_path, "drop", seq=2)
    assert rec["how"] == "sglang" and rec["why"] == "a request waiting for its grammar"
    sched, _ = decode_case()
    assert call(sched, tmp_path, "drop", seq=3, bulk=False)["why"] == "bulk off"
