"""A fake vLLM for the CPU tests of AsyncVLLMRunner (tests/unit/test_vllm_async_runner.py, whose fixtures put it in
sys.modules and build a runner on it, and whose docstring says what it models): the module-level names vLLM's would
give (SamplingParams, RequestOutputKind, TokensPrompt), an AsyncLLM that streams DELTA outputs as vLLM 0.26.0 makes
them (`FakeAsyncLLM`), the stream content a test expects, and two helpers for calling the runner from threads.
"""
from __future__ import annotations

import asyncio
import enum
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

STEP_S = 0.002


# ---------------------------------------------------------------- fake vllm modules (test-only, via sys.modules)

class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class FakeSamplingParams:
    def __init__(self, n: int = 1, max_tokens: int = 16, logprobs: int | None = 0, detokenize: bool = True,
                 skip_special_tokens: bool = True, flat_logprobs: bool = False, **_: Any):
        self.flat_logprobs = flat_logprobs
        self.n = n
        self.max_tokens = max_tokens
        self.logprobs = logprobs
        self.detokenize = detokenize
        self.skip_special_tokens = skip_special_tokens
        self.output_kind = RequestOutputKind.CUMULATIVE

    def clone(self) -> "FakeSamplingParams":
        c = FakeSamplingParams(self.n, self.max_tokens, self.logprobs, self.detokenize, self.skip_special_tokens,
                               self.flat_logprobs)
        c.output_kind = self.output_kind
        return c


class FakeTokenizer:
    """What the runner decodes with when vLLM did not detokenize: the text the fake's detokenizer writes."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(txt(int(t)) for t in ids)


def TokensPrompt(*, prompt_token_ids):   # a TypedDict in vLLM
    return {"prompt_token_ids": list(prompt_token_ids)}


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
class FlatLogprobs:
    """What `SamplingParams.flat_logprobs=True` gives instead of a dict per position (vllm/logprobs.py:30-150): per
    position a [start, end) range of flat lists, the sampled token first; `of` puts a rival token after it at every
    position (as logprobs=k > 0 would), so a reader must take the range's first entry."""
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, positions: list[dict[int, "Logprob"]]) -> "FlatLogprobs":
        flat = cls()
        for pos in positions:
            flat.start_indices.append(len(flat.logprobs))
            for t, l in pos.items():
                flat.token_ids += [t, t + 1]
                flat.logprobs += [l.logprob, l.logprob - 1.0]
            flat.end_indices.append(len(flat.logprobs))
        return flat

    def __len__(self) -> int:
        return len(self.start_indices)


def as_sent(sp, positions: list[dict[int, "Logprob"]] | None):
    """An output's logprobs as vLLM sends them for these params: None, a dict list, or FlatLogprobs."""
    if positions is None or not getattr(sp, "flat_logprobs", False):
        return positions
    return FlatLogprobs.of(positions)


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
        assert sp.output_kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY), "DELTA or FINAL_ONLY only"
        req = _Req(request_id, list(prompt["prompt_token_ids"]), sp, [_Child(i) for i in range(sp.n)])
        # FINAL_ONLY: the same steps, one output once every child ended (parallel_sampling.py:114-120)
        final = sp.output_kind is RequestOutputKind.FINAL_ONLY
        await self._resumed.wait()           # queued while paused (any mode)
        self.active[request_id] = req
        self.max_active = max(self.max_active, len(self.active))
        try:
            while True:
                await asyncio.sleep(self.step_s)
                if req.aborted:
                    out = self._abort_output(req)
                    yield self._final_output(req, {c.index for c in out.outputs}) if final else out
                    return
                if self.paused and not req.inflight:
                    await self._resumed.wait()
                    continue
                out = self._step(req)
                if req.inflight:             # the step that was in flight when the pause took effect
                    req.inflight = False
                    self.engine_core.outputs_queue.get_nowait()
                if out is not None and not final:
                    yield out
                if all(c.done for c in req.children):
                    if final:
                        yield self._final_output(req, set())
                    return
        finally:
            self.active.pop(request_id, None)

    @staticmethod
    def _final_output(req: _Req, aborted: set[int]) -> RequestOutput:
        """FINAL_ONLY's one output: each child's whole token and logprob lists (output_processor.py:396-402), the
        children in `aborted` ended as "abort"."""
        outs = []
        for c in req.children:
            ids = [next(iter(pos)) for pos in c.logprobs]
            lps = list(c.logprobs) if req.sp.logprobs is not None else None
            text = "".join(txt(t) for t in ids) if req.sp.detokenize else ""
            outs.append(CompletionOutput(c.idx, text, ids, None, as_sent(req.sp, lps),
                                         "abort" if c.idx in aborted else "length"))
        return RequestOutput(req.rid, outs, True)

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
            outs.append(CompletionOutput(c.idx, text, ids, None, as_sent(req.sp, delta),
                                         "length" if c.done else None))
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
            outs.append(CompletionOutput(c.idx, text, ids, None, as_sent(req.sp, lps), "abort"))
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
