"""In-flight weight updates on vLLM 0.26.0: an `AsyncLLM` on its own event-loop thread.

`AsyncVLLMRunner` builds a `vllm.v1.engine.async_llm.AsyncLLM` inside a dedicated asyncio loop thread
and offers blocking, thread-safe methods for a threaded Ray actor:
- `generate(prompt_ids, sp, version_fn)`: every prompt at once (one request each, `sp.n` samples),
  streamed with output_kind DELTA (each output carries only the new tokens, so the front-end's work per
  request stays linear in its length; CUMULATIVE re-sent every token list each step); the runner assembles
  token ids, logprobs and text per sample and stamps each token with the weight version in force when it
  was sampled (stamped on arrival; see below).
- `pause(mode)` / `resume()` wrap `AsyncLLM.pause_generation` / `resume_generation`: "keep" freezes
  every request in the scheduler, "wait" lets running requests finish, "abort" ends them all with
  finish_reason "abort" (their partial tokens are returned; the caller re-queues them). A pause returns once
  the scheduler stopped; the outputs still on their way are drained by `resume()` (see `pause`).
- `collective_rpc`, `reset_prefix_cache`, `sleep`, `wake_up`, `is_paused`, `shutdown` forward to AsyncLLM.

The front end's collector: requests ask for flat logprobs (no dict and Logprob object per token) and the runner
freezes the process's objects once the engine is up (`gc_freeze`), so a full garbage collection, which stops the loop
thread with every stream, takes ~19 ms at 512 running requests instead of ~0.4 s (bench/RESULTS.md, eleventh session).

Version stamping: a token is stamped on arrival with its call's "version in force", refreshed from
`version_fn()` only in `resume()` (or in the `wake_up` of the last sleeping tag, which resumes scheduling,
core.py:911-912), after `_drain()` has let every output produced before the pause reach our streams (the pause
itself does not wait for them).
Exact as long as weights change only while paused. Kept requests continue on KV computed with the old
weights unless `reset_prefix_cache(reset_running_requests=True)` makes them recompute it.

`StreamingVLLMEngine` (bottom) is the RolloutEngine on top of it (`kind: vllm` with `streaming: true`). The runner
does not load or verify weights (the engine sends our WeightSyncWorkerExtension methods through
`collective_rpc`) and does not support data parallelism. docs/async_engine_notes.md has the API facts and file:line
references this is built on. vLLM is imported lazily.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlhf_orch.engines.base import PAUSE_MODES, WAKE_TAGS, Capabilities, per_prompt_params   # = vLLM's PauseMode (v1/engine/__init__.py:26)
from rlhf_orch.engines.vllm import EXTENSION, VLLMEngine
from rlhf_orch.errors import EngineError
from rlhf_orch.types import Sample

logger = logging.getLogger(__name__)


Row = tuple  # (prompt_index, completion_index, token_ids, logprobs, token_versions, finish_reason, text)


@dataclass(eq=False)
class _Call:
    """One generate() call: the version stamped on tokens arriving now, and how to refresh it."""
    version_fn: Callable[[], int]
    version: int


@dataclass
class _Completion:
    """One sample (CompletionOutput.index) of a request, assembled from DELTA outputs."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs_missing: bool = False   # a delta with tokens but without (enough) logprobs: report none


def decode_many(tok, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """The texts of many samples, each what `tok.decode` gives. A fast tokenizer's `decode_batch` runs in Rust
    without the GIL; `decode` holds it. When hundreds of requests end together (an abort) their callers' threads
    decoded ~0.5 ms per 2,048-token sample under the GIL while the pausing thread waited for it: the abort pause's
    `return_s` of 0.43 s at 512 running (bench/RESULTS.md, seventh session)."""
    if not ids:
        return []
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or getattr(tok, "clean_up_tokenization_spaces", False):   # decode() does more than Rust's
        return [tok.decode(x, skip_special_tokens=skip_special_tokens) for x in ids]
    return backend.decode_batch([list(x) for x in ids], skip_special_tokens=skip_special_tokens)


class AsyncVLLMRunner:
    def __init__(self, model: str, *, start_timeout_s: float = 1800.0, drain_timeout_s: float = 10.0,
                 gc_freeze: bool = True, **engine_kwargs: Any):
        """`engine_kwargs`: what VLLMEngine passes to `LLM(...)` (all are EngineArgs fields). `gc_freeze`: once the
        engine is up, move every object this process holds (torch, vLLM, the model's Python side) out of the
        cyclic collector's reach (`gc.freeze`, as vLLM's engine core does in its own process), so a full collection
        walks only what requests made since; the loop thread runs every stream and stops for the whole of a
        collection (bench/pause_latency.py times them)."""
        engine_kwargs.setdefault("worker_extension_cls", EXTENSION)
        engine_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        engine_kwargs.setdefault("disable_log_stats", True)   # LLM's default (entrypoints/llm.py:225)
        self.weight_version = -1          # default version_fn reads this; set it before resume()
        self.drain_timeout_s = drain_timeout_s
        self.last_pause: dict[str, float] = {}   # where the last pause() spent its time (see pause)
        self._calls: set[_Call] = set()   # touched on the loop thread only
        self._open = 0                      # requests whose stream has not ended (loop thread only)
        self._open_final = 0                # of which FINAL_ONLY: no per-token versions (loop thread only)
        self._asleep: set[str] = set()
        self._llm: Any = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-async-loop", daemon=True)
        self._thread.start()
        try:
            self._llm = self._call(self._start(model, engine_kwargs), timeout=start_timeout_s)
        except BaseException:
            self._stop_loop()
            raise
        if gc_freeze:
            gc.collect()
            gc.freeze()
        logger.info("AsyncLLM up for %s%s", model, f" ({gc.get_freeze_count()} objects frozen)" if gc_freeze else "")

    def _call(self, coro, timeout: float | None = None):
        """Run `coro` on the loop thread and block for its result. This thread wakes once `coro` ends, not through the
        task's done-callback, which the loop runs after every callback already queued (at a pause: every stream's
        wake-up, ~10 ms at 512 running; bench/RESULTS.md, nineteenth session)."""
        if threading.current_thread() is self._thread or self._loop.is_closed():   # it would wait for itself
            coro.close()
            raise EngineError("AsyncVLLMRunner: called from its own loop thread, or after shutdown")
        done, outcome = threading.Event(), []
        async def run():   # noqa: E306
            try:
                outcome.append((True, await coro))
            except BaseException as e:
                outcome.append((False, e))   # raised in the caller below, with its traceback
            finally:
                done.set()
        asyncio.run_coroutine_threadsafe(run(), self._loop)
        if not done.wait(timeout):
            raise TimeoutError(f"AsyncVLLMRunner: no answer from the loop thread within {timeout}s")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    async def _start(self, model: str, kw: dict):
        try:
            from vllm import AsyncEngineArgs
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise EngineError(f"vLLM is not installed (pip install 'rlhf_orch[vllm]'): {e}") from e
        # Built on the loop thread so AsyncLLM starts its output handler on this loop (async_llm.py:169-175).
        # LLM_CLASS: the batch sizes `LLM` gets. AsyncLLM's default context (ENGINE_CONTEXT) has no entry in
        # get_batch_defaults (arg_utils.py:2438-2512), so it fell back to SchedulerConfig's testing defaults,
        # max_num_seqs 128 and max_num_batched_tokens 2048 (config/scheduler.py:42-44), where LLM gets 1024 / 16384
        # on an H100/H200: a step's 512 samples ran in four waves on the streaming engine and in one on the other.
        return AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **kw), usage_context=UsageContext.LLM_CLASS)

    async def _drain(self) -> None:
        """Wait until outputs already received from EngineCore have reached our generate() streams. A pause's
        reply follows every earlier step output (one FIFO queue and socket, core.py:1495-1497, 1723) and the
        client queues those before resolving it (core_client.py:1005-1043), but AsyncLLM's output_handler and
        our stream tasks consume them later (async_llm.py:656-700); pause_generation sleeps only 20 ms (:787-793)."""
        q = getattr(self._llm.engine_core, "outputs_queue", None)
        deadline = self._loop.time() + self.drain_timeout_s
        quiet = 0
        while quiet < 3:   # three consecutive empty looks, each after letting every ready task run
            await asyncio.sleep(0.002)
            quiet = quiet + 1 if q is None or q.empty() else 0
            if self._loop.time() > deadline:
                logger.warning("output drain timed out after %.1fs; token versions may be off", self.drain_timeout_s)
                return

    async def _switch_versions(self) -> None:
        await self._drain()
        for call in list(self._calls):
            call.version = int(call.version_fn())

    def generate(self, prompt_ids: Sequence[Sequence[int]], sp,
                 version_fn: Callable[[], int] | None = None) -> list[Row]:
        """All prompts concurrently; rows grouped by prompt, then completion index. `sp`: one vLLM SamplingParams,
        or one per prompt; needs `logprobs=0` for logprobs (else []). While paused, requests queue until resume()."""
        if self._asleep:
            raise EngineError(f"generate called while asleep ({sorted(self._asleep)}); call wake_up() first")
        if not prompt_ids:
            return []
        fn = version_fn if version_fn is not None else (lambda: self.weight_version)
        rows = self._call(self._generate([[int(t) for t in p] for p in prompt_ids], sp, fn))
        return self._decoded(rows, sp)

    def _decoded(self, rows: list[Row], sp) -> list[Row]:
        """Text for the samples whose params say `detokenize=False`, decoded once here, on the caller's thread. vLLM
        would detokenize every token incrementally in its output processing, on the loop that also runs every stream
        (the front end's lag behind the GPU at hundreds of requests, issue #27); with no stop strings the whole
        text decoded at the end is the same string (the test in tests/gpu/test_vllm_streaming.py compares them)."""
        each = list(sp) if isinstance(sp, (list, tuple)) else [sp] * (1 + max((r[0] for r in rows), default=0))
        if all(p.detokenize for p in each):
            return rows
        out = list(rows)
        for skip in (True, False):
            todo = [i for i, r in enumerate(rows)
                    if not each[r[0]].detokenize and bool(each[r[0]].skip_special_tokens) == skip]
            for i, text in zip(todo, decode_many(self._llm.tokenizer, [rows[i][2] for i in todo], skip)):
                out[i] = (*rows[i][:6], text)
        return out

    async def _generate(self, prompts: list[list[int]], sp, version_fn) -> list[Row]:
        each = list(sp) if isinstance(sp, (list, tuple)) else [sp] * len(prompts)
        if len(each) != len(prompts):
            raise EngineError(f"{len(each)} sampling parameters for {len(prompts)} prompts")
        call = _Call(version_fn, int(version_fn()))
        self._calls.add(call)
        base = uuid.uuid4().hex[:12]
        tasks = [asyncio.ensure_future(self._one(call, f"rlhf-{base}-{i}", i, p, s))
                 for i, (p, s) in enumerate(zip(prompts, each))]
        try:
            per_prompt = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()   # AsyncLLM.generate aborts a cancelled request (async_llm.py:591-596)
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            self._calls.discard(call)
        return [row for rows in per_prompt for row in rows]

    async def _one(self, call: _Call, rid: str, i: int, prompt: list[int], sp) -> list[Row]:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # What a DELTA CompletionOutput carries (vLLM 0.26.0, RequestState._new_completion_output,
        # v1/engine/output_processor.py:385-415): token_ids = this step's new ids (with stream_interval > 1, every
        # id not sent yet, :304-310); text = the new text only (detokenizer.py:148-164); logprobs =
        # `logprobs[-len(token_ids):]` of the request's full list (:402-404), so an output with NO new token
        # carries ALL logprobs so far (`[-0:]`); finish_reason is set only on the final output (str of FinishReason).
        # Token-less outputs are always final: a step emits an output only with new tokens or a stop
        # (scheduler.py:1798-1800); the others are abort/error finals (core.py:1790-1792 -> :1813-1826 for a pause
        # in "abort" mode, output_processor.py:496-510 for a front-end abort, scheduler.py:1866-1884 for errors).
        # When we lag, the collector merges outputs in place (outputs.py:159-181: token_ids, logprobs and text
        # concatenated, finish_reason from the newest), so the spurious logprobs of a final empty delta land
        # after every real one: the first len(token_ids) logprobs of any output we see are the right ones.
        # n > 1: each output holds only the children with news, one CompletionOutput per index, a finished
        # child is not repeated (parallel_sampling.py:100-126; merge by index, outputs.py:159-181), and the
        # stream ends once every child finished (parallel_sampling.py:125, async_llm.py:579-584).
        # FINAL_ONLY (asked for by the caller, rollout.final_outputs): one output when the request ends (all
        # children, whole lists), so hundreds of running requests cost the loop nothing per step (its lag is most of
        # a pause at 512 running; that this pays is not shown yet, bench/RESULTS.md). Every token is then stamped
        # with the version in force at the end, exact only if no "keep" pause comes meanwhile (_pause refuses one).
        sp = sp.clone()
        final_only = sp.output_kind == RequestOutputKind.FINAL_ONLY
        if not final_only:
            sp.output_kind = RequestOutputKind.DELTA
        comps: dict[int, _Completion] = {}
        self._open += 1
        self._open_final += final_only
        try:
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=prompt), sp, rid):
                self._take(out, comps, call)
        finally:
            self._open -= 1
            self._open_final -= final_only
        if len(comps) != sp.n:
            raise EngineError(f"request {rid}: got {len(comps)} completions, expected n={sp.n}")
        rows: list[Row] = []
        for idx in sorted(comps):
            st = comps[idx]
            lps = [] if st.logprobs_missing else st.logprobs
            rows.append((i, idx, st.tokens, lps, st.versions, st.finish_reason, "".join(st.text)))
        return rows

    @staticmethod
    def _take(out, comps: dict, call: _Call) -> None:
        """Fold one DELTA RequestOutput into its request's completions (see the notes in `_one`)."""
        for c in out.outputs:
            st = comps.get(c.index)
            if st is None:
                st = comps[c.index] = _Completion()
            new = c.token_ids
            k = len(new)
            if k:
                version = call.version
                st.tokens.extend(int(t) for t in new)
                st.versions.extend([version] * k)
                lp = c.logprobs
                if lp is not None and len(lp) >= k and not st.logprobs_missing:
                    if hasattr(lp, "start_indices"):   # FlatLogprobs (SamplingParams.flat_logprobs)
                        vals = AsyncVLLMRunner._flat_logprobs(lp, [int(t) for t in new])
                        if vals is None:
                            st.logprobs_missing = True
                        else:
                            st.logprobs.extend(vals)
                    else:
                        # one {token_id: Logprob} per position; logprobs=0 holds the sampled one. zip stops at
                        # k: drops the all-logprobs tail of a merged final empty delta.
                        st.logprobs.extend(float(pos[int(t)].logprob) for t, pos in zip(new, lp))
                else:
                    st.logprobs_missing = True   # not requested (None), or short: never misalign
            # k == 0: an abort/error final; its logprobs (the whole list so far) are ignored.
            if c.text:
                st.text.append(c.text)
            if c.finish_reason is not None:
                st.finish_reason = c.finish_reason

    @staticmethod
    def _flat_logprobs(lp, new: list[int]) -> list[float] | None:
        """The sampled tokens' logprobs from a FlatLogprobs (vllm/logprobs.py:30-150): per position a range of
        flat lists, the sampled token first (append_logprobs_for_next_position puts it there), so no dict or
        Logprob object is made per token. Its first len(new) positions are this delta's (as with the dict list).
        None where a position does not hold its sampled token (never seen): the sample then reports none."""
        starts, ends, ids, vals = lp.start_indices, lp.end_indices, lp.token_ids, lp.logprobs
        out = []
        for j, t in enumerate(new):
            s = starts[j]
            if s >= ends[j] or ids[s] != t:
                found = [i for i in range(s, ends[j]) if ids[i] == t]
                if not found:
                    return None
                s = found[0]
            out.append(float(vals[s]))
        return out

    def pause(self, mode: str = "keep", clear_cache: bool = False, drain: bool = False) -> None:
        """Returns once the scheduler is paused ("keep"/"abort": after the engine step in progress, milliseconds).
        Outputs the engine produced before the pause may still be on their way to our streams: the front end
        (detokenizing, our stream tasks) lags the GPU by up to seconds at hundreds of running requests. They need
        no waiting here: a token is stamped with its call's version in force, which only `resume()` changes, after
        draining them (`_switch_versions`), so that drain overlaps the weight load instead of delaying the pause
        (issue #27; bench/pause_latency.py measures both). `drain=True` also waits for them here (the old pause).
        clear_cache=True resets caches when the pause completes; in "keep" mode that preempts every kept running
        request (scheduler.py:2336-2360), which recomputes its KV on resume.
        `last_pause` holds where the time went: until our coroutine ran on the loop (`loop_lag_s`), the engine
        core's pause (`core_s`), the drain (`drain_s`) and the way back to this thread (`return_s`), and how many
        requests were open then (`open_requests`: their streams had not ended, though some may have finished in the
        engine core)."""
        if mode not in PAUSE_MODES:
            raise EngineError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._call(self._pause(mode, bool(clear_cache), drain, time.perf_counter()))
        # from the coroutine's end until this thread runs again: the GIL, held by the loop thread's stream tasks
        self.last_pause["return_s"] = time.perf_counter() - self.last_pause.pop("t_end")

    async def _pause(self, mode: str, clear_cache: bool, drain: bool, t_call: float) -> None:
        ts = time.perf_counter()
        if mode == "keep" and self._open_final:
            raise EngineError(f"a keep pause with {self._open_final} running request(s) that report only their final "
                              "output: their tokens' weight versions would be lost; generate with per_token_versions "
                              "(SamplingParams) where a keep pause may come")
        open_requests = self._open   # streams not ended yet: the requests the pause stops (or, in "wait", waits for)
        if clear_cache:
            await self._llm.pause_generation(mode=mode, clear_cache=True)
        else:
            # AsyncLLM.pause_generation is this call plus a 20 ms sleep "not required for correctness"
            # (async_llm.py:786-793); our resume() drains the outputs that sleep was for.
            await self._llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=False)
        t1 = time.perf_counter()
        if drain:
            await self._drain()
        t_end = time.perf_counter()
        self.last_pause = {"loop_lag_s": ts - t_call, "core_s": t1 - ts, "drain_s": t_end - t1, "t_end": t_end,
                           "open_requests": float(open_requests)}

    async def _then_drain(self, coro, asleep: bool = False) -> None:
        await coro
        self._asleep = set(WAKE_TAGS) if asleep else self._asleep
        await self._drain()

    def resume(self) -> None:
        """Stamp later tokens with version_fn() (read now), then let the scheduler run again."""
        self._call(self._resume())

    async def _resume(self) -> None:
        await self._switch_versions()
        await self._llm.resume_generation()

    def is_paused(self) -> bool:
        return bool(self._call(self._llm.is_paused()))

    def collective_rpc(self, method: str, args: Sequence = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """One result per worker, rank order. Arguments cross msgpack: pickle dataclasses (vllm_worker.pack_arg)."""
        return self._call(self._llm.collective_rpc(method, timeout=timeout, args=tuple(args), kwargs=kwargs))

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """False while kept requests hold KV blocks unless reset_running_requests=True (which preempts them)."""
        return bool(self._call(self._llm.reset_prefix_cache(reset_running_requests=reset_running_requests)))

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Pauses the scheduler with `mode` first (core.py:873-875); level >= 1 drops the KV cache."""
        if level not in (1, 2) or mode not in PAUSE_MODES:
            raise EngineError(f"sleep needs level 1 or 2 and a mode in {PAUSE_MODES}; got {level}, {mode!r}")
        self._call(self._then_drain(self._llm.sleep(level=level, mode=mode), asleep=True))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Waking the last sleeping tag also resumes generation (core.py:911-912), even after pause():
        record the new weight version before that call."""
        tags = list(WAKE_TAGS) if tags is None else list(tags)
        if any(t not in WAKE_TAGS for t in tags):
            raise EngineError(f"unknown wake_up tags in {tags}; use {list(WAKE_TAGS)}")
        self._call(self._wake_up(tags))

    async def _wake_up(self, tags: list[str]) -> None:
        todo = [t for t in tags if t in self._asleep]
        if not todo:
            return
        if self._asleep <= set(todo):
            await self._switch_versions()
        await self._llm.wake_up(todo)
        self._asleep -= set(todo)

    def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            try:
                self._call(self._shutdown(llm), timeout=120)
            except Exception:
                logger.warning("AsyncLLM shutdown failed", exc_info=True)
        self._stop_loop()

    @staticmethod
    async def _shutdown(llm) -> None:
        llm.shutdown()
        await asyncio.sleep(0)   # let the cancelled output handler finish

    def _stop_loop(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            if not self._thread.is_alive():
                self._loop.close()


class StreamingVLLMEngine(VLLMEngine):
    """`kind: vllm` with `streaming: true`: the VLLMEngine contract on an AsyncVLLMRunner, so the rollout manager
    keeps many generate calls in flight (continuous batching across them) and a sync may pause them in "keep"
    mode (partial rollouts) or "abort" them. Weight loading, checksums and sleep are VLLMEngine's, through the
    runner's collective_rpc/sleep/wake_up, which take the same arguments as LLM's."""

    capabilities = Capabilities(own_receivers=True, aborts_syncs=True, partial_rollouts=True, concurrent_generate=True)

    def _start_llm(self, model_path: str, **kw):
        return AsyncVLLMRunner(model_path, **kw)

    def generate(self, prompts: Sequence[Sequence[int]], params) -> list[Sample]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._check_can_generate()
        if not prompts:
            return []
        each = per_prompt_params(params, len(prompts))
        made = {p: VSamplingParams(n=p.n, temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_new_tokens,
                                   logprobs=0, seed=p.seed, ignore_eos=p.ignore_eos,
                                   detokenize=False,   # decoded once per sample (AsyncVLLMRunner._decoded)
                                   # flat lists, not a dict and a Logprob per token: hundreds of running
                                   # requests held ~2 GC-tracked objects per token, and full collections
                                   # stalled the front end's loop (bench/RESULTS.md, eleventh session)
                                   flat_logprobs=True,
                                   output_kind=RequestOutputKind.DELTA if p.per_token_versions
                                   else RequestOutputKind.FINAL_ONLY)   # see AsyncVLLMRunner._one
                for p in set(each)}
        prompt_ids = [[int(t) for t in p] for p in prompts]
        try:
            rows = self.llm.generate(prompt_ids, [made[p] for p in each], version_fn=lambda: self.weight_version)
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"engine {self.name}: generate failed: {type(e).__name__}: {e}") from e
        samples = []
        for i, _idx, toks, lps, versions, reason, text in rows:
            if reason not in ("stop", "length", "abort"):
                raise EngineError(f"engine {self.name}: a request finished with {reason!r}")
            if reason != "abort" and len(lps) != len(toks):
                raise EngineError(f"engine {self.name}: vLLM returned no per-token logprobs for a completion")
            samples.append(Sample(prompt_index=i, prompt_ids=prompt_ids[i], response_ids=toks, logprobs=lps,
                                  finish_reason=reason, weight_version=versions[0] if versions else self.weight_version,
                                  engine=self.name, text=text or "", token_versions=list(versions)))
        return samples

    def pause(self, mode: str = "wait") -> None:
        if mode not in PAUSE_MODES:
            raise EngineError(f"engine {self.name}: unknown pause mode {mode!r}; use one of {PAUSE_MODES}")
        self.llm.pause(mode)          # returns once vLLM's scheduler is paused (resume() drains its last outputs)
        self.last_pause = dict(self.llm.last_pause)
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self.llm.resume()             # later tokens are stamped with the weight_version finish_sync set

    def finish_sync(self, version: int) -> None:
        """Kept requests hold KV blocks computed with the old weights: reset them too (they re-prefill on resume,
        under the new weights), so neither they nor new requests with the same prompt reuse stale KV."""
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise EngineError(f"engine {self.name}: vLLM could not reset its prefix cache")
        self.weight_version = version

    def shutdown(self) -> None:
        super().shutdown()
        self.llm.shutdown()
