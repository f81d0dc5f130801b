"""AsyncVLLMRunner (rlhf_orch/engines/vllm_async.py) against a fake AsyncLLM on CPU, without vLLM.

The fake streams RequestOutputKind.DELTA outputs shaped as vLLM 0.26.0 makes them: per step only the children
(n > 1) with news, sometimes several tokens in one output (the collector merges deltas when the consumer lags,
outputs.py:152-181), and an abort final with no new token whose logprobs are *all* logprobs so far
(`logprobs[-0:]`, output_processor.py:402-404), optionally merged behind a pending token delta. A pause's
in-flight step reaches the stream only after pause_generation returned, announced on `engine_core.outputs_queue`
(what the runner's drain watches), as in vLLM.
"""
from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
import types

import pytest

from fake_async_llm import (Bg, FakeAsyncLLM, FakeSamplingParams, FlatLogprobs, RequestOutputKind, TokensPrompt,
                            expected, wait_for)
from rlhf_orch.engines.vllm_async import AsyncVLLMRunner, decode_many
from rlhf_orch.errors import EngineError
from rlhf_orch.models import build_tokenizer


# ---------------------------------------------------------------- the fake vLLM in place (tests/fake_async_llm.py)

@pytest.fixture
def fake_vllm(monkeypatch):
    root = types.ModuleType("vllm")
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = TokensPrompt
    sp_mod = types.ModuleType("vllm.sampling_params")
    sp_mod.RequestOutputKind = RequestOutputKind
    sp_mod.SamplingParams = FakeSamplingParams
    root.inputs, root.sampling_params, root.SamplingParams = inputs, sp_mod, FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", root)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp_mod)
    return root


@pytest.fixture
def make_runner(monkeypatch, fake_vllm):
    made: list[tuple[AsyncVLLMRunner, FakeAsyncLLM]] = []

    def make(**fake_kw) -> tuple[AsyncVLLMRunner, FakeAsyncLLM]:
        fakes: list[FakeAsyncLLM] = []

        async def _start(self, model, kw):
            assert kw["worker_extension_cls"] and kw["logprobs_mode"] == "processed_logprobs"
            fakes.append(FakeAsyncLLM(**fake_kw))   # built on the runner's loop thread
            return fakes[-1]

        monkeypatch.setattr(AsyncVLLMRunner, "_start", _start)
        runner = AsyncVLLMRunner("fake-model", drain_timeout_s=5.0, gc_freeze=fake_kw.pop("gc_freeze", False))
        made.append((runner, fakes[0]))
        return runner, fakes[0]

    yield make
    for runner, fake in made:
        runner.shutdown()
        assert fake.shut_down



# ---------------------------------------------------------------- tests

def test_n2_tokens_logprobs_text_assembled_from_deltas(make_runner):
    runner, fake = make_runner()
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    rows = runner.generate(prompts, FakeSamplingParams(n=2, max_tokens=23), version_fn=lambda: 7)
    assert set(fake.kinds_seen) == {RequestOutputKind.DELTA}
    assert [(r[0], r[1]) for r in rows] == [(i, k) for i in range(len(prompts)) for k in range(2)]
    for i, idx, toks, lps, versions, reason, text in rows:
        e_toks, e_lps, e_text = expected(prompts[i], idx, 23)
        assert toks == e_toks and all(isinstance(t, int) for t in toks)
        assert lps == pytest.approx(e_lps) and len(lps) == len(toks)
        assert versions == [7] * 23
        assert reason == "length"
        assert text == e_text


def test_text_decoded_once_at_the_end_when_vllm_does_not_detokenize(make_runner):
    """detokenize=False (what StreamingVLLMEngine asks for): the fake writes no text per token, and the runner
    decodes each sample once with the engine's tokenizer; per-prompt params may mix both."""
    runner, fake = make_runner()
    prompts = [[1, 2], [3, 4, 5]]
    each = [FakeSamplingParams(n=2, max_tokens=17, detokenize=False), FakeSamplingParams(n=2, max_tokens=17)]
    rows = runner.generate(prompts, each, version_fn=lambda: 0)
    for i, idx, toks, _lps, _v, _reason, text in rows:
        assert toks == expected(prompts[i], idx, 17)[0] and text == expected(prompts[i], idx, 17)[2]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_many_gives_what_decode_gives(skip):
    """The real built-in fast tokenizer: its GIL-free decode_batch path gives each sample's decode() text, special
    tokens kept or skipped; a tokenizer whose decode() also cleans up spaces, or the fake, keeps decode()."""
    tok = build_tokenizer()
    ids = [tok.encode("12+7=19"), [tok.eos_token_id, *tok.encode("3*4")], [], tok.encode("x") * 300]
    want = [tok.decode(x, skip_special_tokens=skip) for x in ids]
    assert decode_many(tok, ids, skip) == want and decode_many(tok, [], skip) == []
    calls = []

    class CleanUp:   # decode() with clean-up: the per-sample path, not Rust's decode_batch
        clean_up_tokenization_spaces, backend_tokenizer = True, tok.backend_tokenizer

        def decode(self, x, skip_special_tokens):
            calls.append(len(x))
            return tok.decode(x, skip_special_tokens=skip_special_tokens)
    assert decode_many(CleanUp(), ids, skip) == want and calls == [len(x) for x in ids]


def test_flat_logprobs_give_what_dict_logprobs_give(make_runner):
    """flat_logprobs=True (what StreamingVLLMEngine asks for): vLLM sends FlatLogprobs instead of a dict per token;
    the fake's put a rival token after the sampled one at every position. Streamed and FINAL_ONLY rows are equal
    to the dict-logprob rows, bit for bit."""
    runner, fake = make_runner()
    prompts = [[1, 2, 3], [4, 5], [6]]
    dicts = runner.generate(prompts, FakeSamplingParams(n=2, max_tokens=23), version_fn=lambda: 4)
    flat = runner.generate(prompts, FakeSamplingParams(n=2, max_tokens=23, flat_logprobs=True), version_fn=lambda: 4)
    final = final_only(n=2, max_tokens=23)
    final.flat_logprobs = True
    flat_final = runner.generate(prompts, final, version_fn=lambda: 4)
    assert flat == dicts == flat_final and all(len(r[3]) == 23 for r in flat)


def test_flat_logprobs_without_the_sampled_token_report_none():
    """A FlatLogprobs position whose range lacks the sampled token (vLLM always puts it first; never seen) gives no
    logprobs rather than a neighbour's; a sampled token found later in its range is taken from there."""
    flat = FlatLogprobs(start_indices=[0, 2], end_indices=[2, 4], token_ids=[7, 8, 9, 5], logprobs=[-1, -2, -3, -4])
    assert AsyncVLLMRunner._flat_logprobs(flat, [7, 5]) == [-1.0, -4.0]
    assert AsyncVLLMRunner._flat_logprobs(flat, [7, 6]) is None


def test_the_process_objects_are_frozen_once_the_engine_is_up(make_runner):
    """gc_freeze (the runner's default; off in the other tests here, which share one pytest process): after the
    start every object the process holds is in the collector's permanent generation, so a full collection on the
    loop thread walks only what came later."""
    gc.unfreeze()
    try:
        make_runner()
        assert gc.get_freeze_count() == 0
        runner, _ = make_runner(gc_freeze=True)
        assert gc.get_freeze_count() > 10_000   # torch and the rest of this process
        assert len(runner.generate([[1]], FakeSamplingParams(max_tokens=5))[0][2]) == 5
    finally:
        gc.unfreeze()


def test_pause_records_its_parts_and_the_open_requests(make_runner):
    """The pause is the engine core's own call (no AsyncLLM.pause_generation sleep); last_pause says where it spent
    its time and how many requests were open (sync/pause_* in a run)."""
    runner, fake = make_runner(step_s=0.003)
    job = Bg(runner.generate, [[1], [2], [3]], FakeSamplingParams(n=2, max_tokens=80))
    wait_for(lambda: fake.tokens_emitted >= 12)
    runner.pause("keep")
    p = runner.last_pause
    assert set(p) == {"loop_lag_s", "core_s", "drain_s", "return_s", "open_requests"} and p["open_requests"] == 3
    assert all(p[k] >= 0 for k in p) and p["drain_s"] < 1e-3 and p["core_s"] < 0.02   # no drain, no 20 ms sleep
    runner.resume()
    assert len(job.get()) == 6
    runner.pause("keep")
    assert runner.last_pause["open_requests"] == 0
    runner.resume()


def test_the_pause_returns_without_waiting_for_callbacks_queued_on_the_loop(make_runner):
    """pause() (through _call) wakes the caller as soon as its coroutine ends, not once the loop has run the
    callbacks queued before the task's own done-callback (at 512 running: every stream's wake-up). Here one such
    callback blocks the loop until the caller lets it go: a caller that waited for it would find `finished` set."""
    runner, _ = make_runner()
    gate, finished = threading.Event(), threading.Event()

    def queued():
        gate.wait(10)
        finished.set()

    async def ends_after_queueing():
        asyncio.get_running_loop().call_soon(queued)
        return 7

    assert runner._call(ends_after_queueing()) == 7
    assert not finished.is_set()
    gate.set()
    wait_for(finished.is_set)

    async def fails():
        raise EngineError("from the loop")

    with pytest.raises(EngineError, match="from the loop"):   # an exception reaches the caller
        runner._call(fails())


def test_no_logprobs_requested_gives_empty_logprobs(make_runner):
    runner, _ = make_runner()
    rows = runner.generate([[3, 4]], FakeSamplingParams(n=2, max_tokens=9, logprobs=None), version_fn=lambda: 0)
    assert [len(r[2]) for r in rows] == [9, 9] and [r[3] for r in rows] == [[], []]


def test_keep_pause_version_bump_resume_restamps_later_tokens(make_runner):
    runner, fake = make_runner(step_s=0.003)
    runner.weight_version = 0
    prompts = [[11, 12], [13], [14, 15, 16]]
    job = Bg(runner.generate, prompts, FakeSamplingParams(n=2, max_tokens=60))
    wait_for(lambda: fake.tokens_emitted >= 40)
    runner.pause("keep")
    assert runner.is_paused()
    # The pause does not wait for the in-flight step's outputs (they reach the streams later, issue #27): resume()
    # drains them before it stamps later tokens with the new version (checked exactly below).
    assert not fake.engine_core.outputs_queue.empty()
    wait_for(lambda: fake.engine_core.outputs_queue.empty())   # those outputs arrive; nothing new is generated
    frozen = fake.tokens_emitted
    time.sleep(0.05)
    assert fake.tokens_emitted == frozen                # nothing is generated while kept
    assert runner.reset_prefix_cache() is False         # kept requests hold KV
    assert runner.reset_prefix_cache(reset_running_requests=True) is True
    runner.weight_version = 1
    runner.resume()
    rows = job.get()
    assert fake.pause_calls == [("keep", False)]
    at_resume = fake.emitted_at_resume[0]
    for i, idx, toks, lps, versions, reason, text in rows:
        assert toks == expected(prompts[i], idx, 60)[0] and len(lps) == 60 and reason == "length"
        assert len(versions) == len(toks)
        assert versions == sorted(versions) and set(versions) == {0, 1}
        # exact: every token emitted before resume (in-flight step included) is stamped 0, the rest 1
        n_old = at_resume[(_rid(fake, i), idx)]
        assert versions == [0] * n_old + [1] * (60 - n_old)


def _rid(fake: FakeAsyncLLM, i: int) -> str:
    (rid,) = {rid for (rid, _idx) in fake.emitted_at_resume[0] if rid.endswith(f"-{i}")}
    return rid


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("merge_abort", [False, True])
def test_abort_returns_partial_tokens_without_duplicated_logprobs(make_runner, merge_abort, flat):
    runner, fake = make_runner(merge_abort=merge_abort)
    prompts = [[21, 22], [23, 24, 25]]
    job = Bg(runner.generate, prompts, FakeSamplingParams(n=2, max_tokens=500, flat_logprobs=flat),
             version_fn=lambda: 3)
    wait_for(lambda: fake.tokens_emitted >= 30)
    runner.pause("abort")
    rows = job.get()
    assert fake.engine_core.outputs_queue.empty()
    assert len(rows) == 4
    for i, idx, toks, lps, versions, reason, text in rows:
        assert reason == "abort"
        assert 0 < len(toks) < 500
        assert len(lps) == len(toks) == len(versions)      # the abort's all-logprobs list was not appended
        e_toks, e_lps, e_text = expected(prompts[i], idx, len(toks))
        assert toks == e_toks and lps == pytest.approx(e_lps) and text == e_text
        assert versions == [3] * len(toks)
    # requests sent while paused wait for resume, then run normally
    later = Bg(runner.generate, [[1]], FakeSamplingParams(n=1, max_tokens=5), version_fn=lambda: 4)
    time.sleep(0.05)
    assert later.is_alive() and runner.is_paused()
    runner.resume()
    (row,) = later.get()
    assert row[2] == expected([1], 0, 5)[0] and row[4] == [4] * 5 and row[5] == "length"


def test_abort_before_any_token_of_a_child(make_runner):
    runner, fake = make_runner(step_s=0.02)
    job = Bg(runner.generate, [[5, 6]], FakeSamplingParams(n=3, max_tokens=100), version_fn=lambda: 0)
    # child 2 has news only every 3rd step: abort right after the first step, before its first token
    wait_for(lambda: fake.tokens_emitted >= 1)
    runner.pause("abort")
    rows = job.get()
    assert [r[1] for r in rows] == [0, 1, 2] and {r[5] for r in rows} == {"abort"}
    for _i, _idx, toks, lps, versions, _reason, _text in rows:
        assert len(lps) == len(toks) == len(versions)
    assert any(len(r[2]) == 0 for r in rows)


def test_per_prompt_sampling_params(make_runner):
    runner, _ = make_runner()
    prompts = [[1], [2, 2], [3, 3, 3]]
    sps = [FakeSamplingParams(n=1, max_tokens=4), FakeSamplingParams(n=3, max_tokens=11),
           FakeSamplingParams(n=2, max_tokens=7, logprobs=None)]
    rows = runner.generate(prompts, sps, version_fn=lambda: 2)
    assert [(r[0], r[1]) for r in rows] == [(0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
    for i, idx, toks, lps, versions, reason, _text in rows:
        n_tok = sps[i].max_tokens
        assert toks == expected(prompts[i], idx, n_tok)[0] and versions == [2] * n_tok and reason == "length"
        assert lps == ([] if sps[i].logprobs is None else pytest.approx(expected(prompts[i], idx, n_tok)[1]))
    assert all(sp.output_kind is RequestOutputKind.CUMULATIVE for sp in sps)   # caller's params not mutated
    with pytest.raises(EngineError, match="2 sampling parameters for 3 prompts"):
        runner.generate(prompts, sps[:2])
    assert runner.generate([], sps) == []


def test_generate_from_several_threads_at_once(make_runner):
    runner, fake = make_runner()
    jobs = []
    for t in range(8):
        prompts = [[t, j] for j in range(3)]
        jobs.append((prompts, 5 + t, Bg(runner.generate, prompts, FakeSamplingParams(n=2, max_tokens=5 + t),
                                        version_fn=lambda t=t: 100 + t)))
    for prompts, n_tok, job in jobs:
        rows = job.get()
        assert len(rows) == 6
        for i, idx, toks, lps, versions, reason, text in rows:
            e_toks, e_lps, e_text = expected(prompts[i], idx, n_tok)
            assert (toks, text, reason) == (e_toks, e_text, "length")
            assert lps == pytest.approx(e_lps) and versions == [versions[0]] * n_tok
            assert versions[0] == 100 + prompts[0][0]
    assert fake.max_active > 3   # the calls overlapped in the engine


def test_utility_calls_forward(make_runner):
    runner, fake = make_runner()
    assert runner.collective_rpc("rlhf_receive", args=[True], timeout=3) == \
        ["rlhf_receive:rank0", "rlhf_receive:rank1"]
    assert fake.rpc_calls == [("rlhf_receive", (True,), None, 3)]
    assert runner.is_paused() is False
    runner.pause("wait", clear_cache=True)
    assert fake.pause_calls == [("wait", True)] and runner.is_paused()
    runner.resume()
    assert not runner.is_paused()
    with pytest.raises(EngineError, match="pause mode"):
        runner.pause("later")


def test_asyncllm_gets_the_batch_sizes_llm_gets(monkeypatch, fake_vllm):
    """AsyncLLM built with its own default context fell back to vLLM's testing defaults (128 sequences, 2,048 batched
    tokens) where `LLM` gets 1024 / 16,384 on an H100: the streaming engine must be built in LLM's context."""
    made = {}

    class UsageContext:   # vllm/usage/usage_lib.py
        LLM_CLASS, ENGINE_CONTEXT = "LLM_CLASS", "ENGINE_CONTEXT"

    class AsyncLLM:
        @classmethod
        def from_engine_args(cls, engine_args, start_engine_loop=True, usage_context=UsageContext.ENGINE_CONTEXT):
            made.update(args=engine_args, usage_context=usage_context)
            return "llm"

    usage = types.ModuleType("vllm.usage.usage_lib")
    usage.UsageContext = UsageContext
    async_llm = types.ModuleType("vllm.v1.engine.async_llm")
    async_llm.AsyncLLM = AsyncLLM
    fake_vllm.AsyncEngineArgs = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm.usage.usage_lib", usage)
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", async_llm)
    assert asyncio.run(AsyncVLLMRunner._start(None, "m", {"max_num_seqs": 7})) == "llm"
    assert made == {"args": {"model": "m", "max_num_seqs": 7}, "usage_context": "LLM_CLASS"}


def final_only(**kw) -> FakeSamplingParams:
    sp = FakeSamplingParams(**kw)
    sp.output_kind = RequestOutputKind.FINAL_ONLY
    return sp


def test_final_only_requests_give_what_streamed_ones_give(make_runner):
    """FINAL_ONLY (what StreamingVLLMEngine asks for without partial rollouts): one output per request at its end;
    the rows equal the DELTA-streamed ones, every token stamped with the version in force."""
    runner, fake = make_runner()
    prompts = [[1, 2, 3], [4, 5], [6]]
    streamed = runner.generate(prompts, FakeSamplingParams(n=2, max_tokens=23), version_fn=lambda: 4)
    final = runner.generate(prompts, final_only(n=2, max_tokens=23), version_fn=lambda: 4)
    assert fake.kinds_seen == [RequestOutputKind.DELTA] * 3 + [RequestOutputKind.FINAL_ONLY] * 3
    assert final == streamed and all(r[4] == [4] * 23 and r[5] == "length" for r in final)


def test_final_only_requests_wait_and_abort_pauses_but_refuse_keep(make_runner):
    """No keep pause while a FINAL_ONLY request runs (its tokens' versions would be lost): the pause raises before
    stopping anything; an abort pause hands the requests back unfinished, as with DELTA."""
    runner, fake = make_runner(step_s=0.003)
    job = Bg(runner.generate, [[1], [2]], final_only(n=2, max_tokens=400), version_fn=lambda: 0)
    wait_for(lambda: fake.tokens_emitted >= 12)
    with pytest.raises(EngineError, match="keep pause with 2 running request"):
        runner.pause("keep")
    assert fake.pause_calls == [] and fake.paused is None
    runner.pause("abort")
    runner.resume()
    rows = job.get()
    assert len(rows) == 4 and {r[5] for r in rows} == {"abort"}
    for i, idx, toks, lps, _v, _reason, _text in rows:
        assert 0 < len(toks) < 400 and toks == expected([[1], [2]][i], idx, len(toks))[0] and len(lps) == len(toks)
