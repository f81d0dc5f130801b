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
import enum
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from rlhf_orch.engines.vllm_async import AsyncVLLMRunner
from rlhf_orch.errors import EngineError

STEP_S = 0.002


# ---------------------------------------------------------------- fake vllm modules (test-only, via sys.modules)

class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class FakeSamplingParams:
    def __init__(self, n: int = 1, max_tokens: int = 16, logprobs: int | None = 0, detokenize: bool = True,
                 skip_special_tokens: bool = True, **_: Any):
        self.n = n
        self.max_tokens = max_tokens
        self.logprobs = logprobs
        self.detokenize = detokenize
        self.skip_special_tokens = skip_special_tokens
        self.output_kind = RequestOutputKind.CUMULATIVE

    def clone(self) -> "FakeSamplingParams":
        c = FakeSamplingParams(self.n, self.max_tokens, self.logprobs, self.detokenize, self.skip_special_tokens)
        c.output_kind = self.output_kind
        return c


class FakeTokenizer:
    """What the runner decodes with when vLLM did not detokenize: the text the fake's detokenizer writes."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(txt(int(t)) for t in ids)


def TokensPrompt(*, prompt_token_ids):   # a TypedDict in vLLM
    return {"prompt_token_ids": list(prompt_token_ids)}


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


# ---------------------------------------------------------------- expected stream content

def tok(prompt: list[int], idx: int, j: int) -> int:
    return (sum(prompt) * 31 + idx * 1009 + j * 7) % 50000 + 1


def lp(prompt: list[int], idx: int, j: int) -> float:
    return -((sum(prompt) % 13) * 0.01 + idx * 0.1 + j * 0.001) - 0.5


def txt(t: int) -> str:
    return f"<{t}>"


@dataclass
class Logprob:
    logprob: float
    rank: int = 1
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool


# ---------------------------------------------------------------- fake AsyncLLM

@dataclass
class _Child:
    idx: int
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)   # vLLM's per-request running list
    done: bool = False

    @property
    def n_tokens(self) -> int:
        return len(self.logprobs)


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    sp: FakeSamplingParams
    children: list[_Child]
    step: int = 0
    inflight: bool = False   # a pause took effect while this request's step was in flight
    aborted: bool = False


class FakeAsyncLLM:
    """DELTA streaming, pause keep/wait/abort, queued requests while paused, utility calls recorded."""

    def __init__(self, step_s: float = STEP_S, merge_abort: bool = False, burst_every: int = 5):
        self.step_s = step_s
        self.merge_abort = merge_abort       # abort final merged behind one pending token delta
        self.burst_every = burst_every       # child 0 gets 2 tokens in one output every k steps (merged deltas)
        self.engine_core = types.SimpleNamespace(outputs_queue=asyncio.Queue(),
                                                 pause_scheduler_async=self._pause_scheduler)
        self.tokenizer = FakeTokenizer()
        self.paused: str | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.active: dict[str, _Req] = {}
        self.max_active = 0
        self.tokens_emitted = 0
        self.emitted_at_resume: list[dict[tuple[str, int], int]] = []
        self.kinds_seen: list[Any] = []
        self.rpc_calls: list[tuple] = []
        self.reset_calls: list[bool] = []
        self.pause_calls: list[tuple[str, bool]] = []
        self.shut_down = False

    # -- requests
    async def generate(self, prompt, sp, request_id):
        assert isinstance(prompt, dict) and "prompt_token_ids" in prompt
        self.kinds_seen.append(sp.output_kind)
        assert sp.output_kind is RequestOutputKind.DELTA, "the runner must stream DELTA"
        req = _Req(request_id, list(prompt["prompt_token_ids"]), sp, [_Child(i) for i in range(sp.n)])
        await self._resumed.wait()           # queued while paused (any mode)
        self.active[request_id] = req
        self.max_active = max(self.max_active, len(self.active))
        try:
            while True:
                await asyncio.sleep(self.step_s)
                if req.aborted:
                    yield self._abort_output(req)
                    return
                if self.paused and not req.inflight:
                    await self._resumed.wait()
                    continue
                out = self._step(req)
                if req.inflight:             # the step that was in flight when the pause took effect
                    req.inflight = False
                    self.engine_core.outputs_queue.get_nowait()
                if out is not None:
                    yield out
                if all(c.done for c in req.children):
                    return
        finally:
            self.active.pop(request_id, None)

    def _step(self, req: _Req) -> RequestOutput | None:
        req.step += 1
        outs = []
        for c in req.children:
            if c.done or req.step % (c.idx + 1):      # child i has news every (i+1) steps
                continue
            k = 2 if (c.idx == 0 and self.burst_every and req.step % self.burst_every == 0) else 1
            k = min(k, req.sp.max_tokens - c.n_tokens)
            ids = [tok(req.prompt, c.idx, c.n_tokens + j) for j in range(k)]
            for j, t in enumerate(ids):
                c.logprobs.append({t: Logprob(lp(req.prompt, c.idx, c.n_tokens))})
            self.tokens_emitted += k
            c.done = c.n_tokens >= req.sp.max_tokens
            delta = c.logprobs[-k:] if req.sp.logprobs is not None else None
            text = "".join(txt(t) for t in ids) if req.sp.detokenize else ""
            outs.append(CompletionOutput(c.idx, text, ids, None, delta, "length" if c.done else None))
        if not outs:
            return None
        return RequestOutput(req.rid, outs, all(c.done for c in req.children))

    def _abort_output(self, req: _Req) -> RequestOutput:
        outs = []
        for c in req.children:
            if c.done:
                continue
            c.done = True
            ids: list[int] = []
            delta: list = []
            if self.merge_abort and c.n_tokens < req.sp.max_tokens:
                # A pending one-token delta, then the empty abort delta merged onto it (outputs.py:168-170):
                # its logprobs are the new one followed by the whole running list (logprobs[-0:]).
                t = tok(req.prompt, c.idx, c.n_tokens)
                c.logprobs.append({t: Logprob(lp(req.prompt, c.idx, c.n_tokens))})
                self.tokens_emitted += 1
                ids, delta = [t], c.logprobs[-1:]
            text = "".join(txt(t) for t in ids) if req.sp.detokenize else ""
            lps = (delta + c.logprobs[-0:]) if req.sp.logprobs is not None else None
            outs.append(CompletionOutput(c.idx, text, ids, None, lps, "abort"))
        if req.inflight:
            req.inflight = False
            self.engine_core.outputs_queue.get_nowait()
        return RequestOutput(req.rid, outs, True)

    # -- pause / resume
    async def pause_generation(self, *, mode: str = "abort", wait_for_inflight_requests=None, clear_cache=True):
        await self._pause_scheduler(mode=mode, clear_cache=clear_cache)
        await asyncio.sleep(0.02)   # as AsyncLLM.pause_generation (async_llm.py:793)

    async def _pause_scheduler(self, *, mode: str, clear_cache: bool):   # engine_core.pause_scheduler_async
        self.pause_calls.append((mode, clear_cache))
        self.paused = mode
        self._resumed.clear()
        if mode == "wait":
            while self.active:
                await asyncio.sleep(self.step_s)
            return
        for req in self.active.values():
            # The last step (and for abort, the abort final) reaches the stream after we return, as in vLLM
            # (async_llm.py:787-793); the runner's drain must wait for it.
            req.inflight = True
            req.aborted = req.aborted or mode == "abort"
            self.engine_core.outputs_queue.put_nowait(req.rid)

    async def resume_generation(self):
        self.emitted_at_resume.append({(r.rid, c.idx): c.n_tokens for r in self.active.values()
                                       for c in r.children})
        self.paused = None
        self._resumed.set()

    async def is_paused(self):
        return self.paused is not None

    # -- utilities
    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpc_calls.append((method, tuple(args), kwargs, timeout))
        return [f"{method}:rank0", f"{method}:rank1"]

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.reset_calls.append(reset_running_requests)
        kept = self.paused == "keep" and bool(self.active)
        return bool(reset_running_requests or not kept)

    def shutdown(self):
        self.shut_down = True


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
        runner = AsyncVLLMRunner("fake-model", drain_timeout_s=5.0)
        made.append((runner, fakes[0]))
        return runner, fakes[0]

    yield make
    for runner, fake in made:
        runner.shutdown()
        assert fake.shut_down


# ---------------------------------------------------------------- helpers

def expected(prompt: list[int], idx: int, n_tokens: int):
    toks = [tok(prompt, idx, j) for j in range(n_tokens)]
    return toks, [lp(prompt, idx, j) for j in range(n_tokens)], "".join(txt(t) for t in toks)


class Bg(threading.Thread):
    """runner.generate on another thread (the runner is used from a threaded Ray actor)."""

    def __init__(self, fn, *a, **kw):
        super().__init__(daemon=True)
        self.fn, self.a, self.kw, self.result, self.error = fn, a, kw, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn(*self.a, **self.kw)
        except BaseException as e:   # noqa: BLE001 - re-raised in get()
            self.error = e

    def get(self, timeout: float = 30.0):
        self.join(timeout)
        assert not self.is_alive(), "generate did not return"
        if self.error is not None:
            raise self.error
        return self.result


def wait_for(cond, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


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


@pytest.mark.parametrize("merge_abort", [False, True])
def test_abort_returns_partial_tokens_without_duplicated_logprobs(make_runner, merge_abort):
    runner, fake = make_runner(merge_abort=merge_abort)
    prompts = [[21, 22], [23, 24, 25]]
    job = Bg(runner.generate, prompts, FakeSamplingParams(n=2, max_tokens=500), version_fn=lambda: 3)
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
    assert runner.collective_rpc("rlhf_receive_broadcast", args=[True], timeout=3) == \
        ["rlhf_receive_broadcast:rank0", "rlhf_receive_broadcast:rank1"]
    assert fake.rpc_calls == [("rlhf_receive_broadcast", (True,), None, 3)]
    assert runner.is_paused() is False
    runner.pause("wait", clear_cache=True)
    assert fake.pause_calls == [("wait", True)] and runner.is_paused()
    runner.resume()
    assert not runner.is_paused()
    with pytest.raises(EngineError, match="pause mode"):
        runner.pause("later")
