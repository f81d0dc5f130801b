"""In-flight weight updates on SGLang 0.5.17: `sglang.Engine` driven from its own event-loop thread.

`AsyncSGLangRunner` builds the Engine inside a dedicated asyncio loop thread (so `Engine.loop`, which its
TokenizerManager runs on, is that loop; engine.py:302-306) and offers blocking, thread-safe methods:
- `generate(prompts, sampling_params, version_fn)`: one `Engine.async_generate(stream=True, return_logprob=True)`
  request per prompt, all in flight at once; every token is stamped on arrival with its call's version.
- `pause(mode)` / `resume()` for the modes of engines/base.py: "wait" (running requests finish, new ones wait),
  "keep" (SGLang's `in_place` pause, O(1): requests stay where they are until the weights have loaded; then the
  scheduler retracts them, tokens kept, and drops the old-weight KV, so after `continue_generation` they re-prefill
  prompt + tokens under the new weights), "abort" (SGLang's `in_place` pause too, then our streams end at once with
  finish_reason "abort" and the tokens they have, and the scheduler drops every request in one pass (op "drop",
  after waiting for the step in flight); the caller re-queues them whole, so nothing more is waited for).
Engine's own blocking methods (`update_weights_from_*`, `flush_cache`, ...) call `self.loop.run_until_complete`,
which cannot drive a loop another thread runs; `Engine.loop` is replaced by `_OnLoop`, which runs them there.

Why `in_place` (issue #27: pauses under 50 ms at 512 running requests): SGLang's retract pause releases each request's
KV in turn (0.18 ms per request, bench/RESULTS.md). A "keep" pause takes a light census in the scheduler
(engines/sglang_sched.py, op "count": it waits for the GPU step in flight, so no weight is written under a running
forward); after the load, `finish_sync` (or `resume`) has it retract (op "retract"). Continuing in place on old-weight
KV is never done: later tokens would not be the new policy's. An "abort" pause has it drop (op "drop").

Exact version stamps. SGLang's pause is fire-and-forget (tokenizer_manager.py:1974-1993) and the tokens of the last
steps reach the TokenizerManager through the detokenizer process, after the pause returned. So the pause asks the
paused scheduler, in a control message queued behind the pause (one socket, FIFO), how many tokens each of its
requests has (or will have once the pending step is processed). The retraction reports the exact counts; before the
versions switch, each stream must have received exactly that many (requests that finished before the pause: their
final output): `resume()` waits for that, so a "keep" pause returns without waiting for the detokenizer's backlog
(seconds at hundreds of running requests on vLLM, issue #27), which arrives while the weights load. Nothing is
generated until `resume()` sends continue_generation, and it switches the versions first: tokens sampled before the
pause carry the old version, all after it the new one.

Not supported: sleep with requests in flight or kept (SGLang asserts an idle scheduler), stop strings, data/pipeline
parallelism, SGLang's own n > 1 (n is flattened to n requests, as in SGLangEngine). Weight loading and verification
are SGLangEngine's, unchanged; SGLang is imported lazily.
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from rlhf_orch.engines.base import PAUSE_MODES, Capabilities
from rlhf_orch.engines.sglang import HOOK, SGLangEngine
from rlhf_orch.engines.sglang_sched import CENSUS, PREFIX
from rlhf_orch.errors import EngineError
from rlhf_orch.types import Sample

logger = logging.getLogger(__name__)
Row = tuple   # (prompt_index, token_ids, logprobs (None: missing), token_versions, finish_reason, text)


# ---- the runner (in the rollout actor) -----------------------------------------------------------
class _OnLoop:
    """Stands in for `Engine.loop`: run_until_complete runs the awaitable on the runner's loop thread and waits."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread):
        self._loop, self._thread = loop, thread

    def run_until_complete(self, aw):
        if threading.current_thread() is self._thread:
            getattr(aw, "close", lambda: None)()
            raise EngineError("a blocking sglang.Engine method was called from the runner's own loop thread")
        return asyncio.run_coroutine_threadsafe(_await(aw), self._loop).result()

    def __getattr__(self, name):
        return getattr(self._loop, name)


async def _await(aw):
    return await aw


@dataclass(eq=False)
class _Call:
    version_fn: Callable[[], int]
    version: int


@dataclass(eq=False)
class _Req:
    rid: str
    call: _Call
    task: Any = None
    started: bool = False          # async_generate entered: SGLang holds a ReqState for it (or held one)
    phase: str = ""                # at the last pause: "fresh" (not sent to the scheduler), "sent", "ended"
    target: int | None = 0         # tokens generated before the pause; None: all (it finished before it)
    aborted: bool = False
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    lp_missing: bool = False
    finish: str | None = None
    text: str = ""


class AsyncSGLangRunner:
    def __init__(self, make_engine: Callable[[], Any], census: Callable[[str], list[dict]], *,
                 start_timeout_s: float = 1800.0, drain_timeout_s: float = 10.0, gc_freeze: bool = True):
        """`make_engine()` builds the engine (called on the loop thread); `census(op)` (called from the pausing
        thread, after SGLang's pause) returns every TP rank's record of engines/sglang_sched.py's op ("count",
        "retract" or "drop"), whose "census" is {rid: tokens} of the requests the paused scheduler holds. `gc_freeze`:
        as AsyncVLLMRunner's: the objects made at start-up leave the cyclic collector's reach, so a full collection
        (it stops the loop thread) walks only what requests made since (was ~430 ms each)."""
        self.census = census
        self.drain_timeout_s = drain_timeout_s
        self.paused_mode: str | None = None
        self.last_pause: dict = {}
        self._counts: dict[str, int] | None = None   # a "keep" pause's census, drained in resume()
        self._settled = True                          # a "keep" pause's retraction has run (settle())
        self._calls: set[_Call] = set()
        self._reqs: dict[str, _Req] = {}       # admitted and not ended (loop thread only)
        self._open = asyncio.Event()
        self._open.set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-async-loop", daemon=True)
        self._thread.start()
        try:
            self.engine = self._call(self._build(make_engine), timeout=start_timeout_s)
        except BaseException:
            self._stop_loop()
            raise
        self.engine.loop = _OnLoop(self._loop, self._thread)
        if gc_freeze:
            gc.collect()
            gc.freeze()

    @staticmethod
    async def _build(make_engine):
        return make_engine()   # on the loop thread: Engine takes the running loop as its own (engine.py:302-306)

    def _call(self, coro, timeout: float | None = None):
        if threading.current_thread() is self._thread or self._loop.is_closed():
            coro.close()
            raise EngineError("AsyncSGLangRunner: called from its own loop thread, or after shutdown")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def tm(self):
        return self.engine.tokenizer_manager

    def in_flight(self) -> int:
        """Requests admitted and not ended (running, parked by a "keep" pause, or queued in SGLang)."""
        return len(self._reqs)

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling_params: Sequence[dict],
                 version_fn: Callable[[], int]) -> list[Row]:
        """One request per prompt (SGLang sampling-params dicts, n=1), all at once; rows in prompt order. While
        paused, the requests wait until resume()."""
        if len(sampling_params) != len(prompt_ids):
            raise EngineError(f"{len(sampling_params)} sampling parameters for {len(prompt_ids)} prompts")
        prompts = [[int(t) for t in p] for p in prompt_ids]
        return self._call(self._generate(prompts, list(sampling_params), version_fn)) if prompts else []

    async def _generate(self, prompts, sps, version_fn) -> list[Row]:
        call = _Call(version_fn, int(version_fn()))
        self._calls.add(call)
        base = uuid.uuid4().hex[:12]
        tasks = [asyncio.ensure_future(self._one(call, f"rlhf-{base}-{i}", i, p, sp))
                 for i, (p, sp) in enumerate(zip(prompts, sps))]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            for i in range(len(tasks)):   # a cancelled consumer does not stop SGLang's request
                if f"rlhf-{base}-{i}" in getattr(self.tm, "rid_to_state", {}):
                    self.tm.abort_request(f"rlhf-{base}-{i}")
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            self._calls.discard(call)

    async def _one(self, call: _Call, rid: str, i: int, prompt: list[int], sp: dict) -> Row:
        while not self._open.is_set():
            await self._open.wait()
        r = self._reqs[rid] = _Req(rid, call, task=asyncio.current_task())
        try:
            r.started = True   # no await until SGLang's ReqState exists (generate_request's first step)
            gen = await self.engine.async_generate(input_ids=prompt, sampling_params=sp, return_logprob=True,
                                                   stream=True, rid=rid)
            async for out in gen:
                self._take(r, out)
        except asyncio.CancelledError:
            if not r.aborted:
                raise
            getattr(r.task, "uncancel", lambda: None)()
            r.finish = "abort"
        except Exception as e:
            if not r.aborted:
                raise EngineError(f"request {rid} failed in SGLang: {type(e).__name__}: {e}") from e
            r.finish = "abort"     # e.g. aborted before it reached the scheduler
        finally:
            self._reqs.pop(rid, None)
        if r.finish is None:
            raise EngineError(f"request {rid}: SGLang's stream ended without a finish reason")
        return (i, r.tokens, None if r.lp_missing else r.logprobs, r.versions, r.finish, r.text)

    def _take(self, r: _Req, out: dict) -> None:
        """One streamed output. Non-incremental streaming (SGLang's default): output_ids and
        meta_info["output_token_logprobs"] hold every token so far (live lists; tokenizer_manager.py:2327-2400),
        except an abort of a queued request, whose output_ids is [last] (:3181-3184)."""
        meta = out.get("meta_info") or {}
        fr = meta.get("finish_reason")
        kind = fr.get("type") if isinstance(fr, dict) else fr
        ids = out.get("output_ids") or []
        n, have = len(ids), len(r.tokens)
        cumulative = kind != "abort" or meta.get("completion_tokens", -1) == n
        if n > have and cumulative:
            new = [int(t) for t in ids[have:n]]
            r.tokens.extend(new)
            r.versions.extend([r.call.version] * len(new))
            lps = meta.get("output_token_logprobs")
            if lps is not None and len(lps) >= n and not r.lp_missing:
                for (v, t, *_), tok in zip(lps[have:n], new):   # (logprob, token_id, text) per token
                    if int(t) != tok:
                        raise EngineError(f"request {r.rid}: SGLang's output_token_logprobs do not match its tokens")
                    r.logprobs.append(float(v))
            else:
                r.lp_missing = True
        if kind is not None:
            r.finish = str(kind)
            r.text = out.get("text") or ""

    # ---- pause / resume --------------------------------------------------------------------------
    def pause(self, mode: str, keep_mode: str = "in_place", abort_mode: str = "in_place") -> None:
        """Returns once paused: "wait" when every request ended; "keep" once the scheduler is paused and has said how
        many tokens each request has (those still on their way from the detokenizer are waited for in `resume`, after
        the load, before later tokens get the new version); "abort" once every request ended (with the tokens that
        reached it: the caller re-queues them). `keep_mode`, `abort_mode`: SGLang's pause for "keep" and "abort"
        ("retract": the pauses before the sixteenth and seventeenth sessions, StreamingSGLangEngine.keep_pause /
        abort_pause)."""
        if mode not in PAUSE_MODES:
            raise EngineError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if self.paused_mode is not None:
            raise EngineError(f"already paused ({self.paused_mode!r}); resume() first")
        t0 = time.perf_counter()
        stats: dict = {"mode": mode}
        collecting = gc.isenabled()
        gc.disable()   # no collection stops the loop thread inside a pause (5-12 ms median there, bench/RESULTS.md)
        try:
            self._pause(mode, keep_mode, abort_mode, stats)
        finally:
            if collecting:
                gc.enable()
        stats["pause_s"] = time.perf_counter() - t0
        self.last_pause = stats
        logger.debug("paused: %s", stats)

    def _pause(self, mode: str, keep_mode: str, abort_mode: str, stats: dict) -> None:
        self._call(self._close(mode, keep_mode if mode == "keep" else abort_mode))
        if mode == "wait":
            self._call(self._until(lambda: not self._reqs, None))
        elif mode == "keep":
            t1 = time.perf_counter()
            self._counts = self.census("count")[0]["census"]   # predicted; settle() makes them exact
            self._settled = False
            stats.update(census_s=time.perf_counter() - t1, kept=len(self._counts))
        else:
            # An aborted request's group is re-queued whole (rollout/scheduler.py on_generated): neither its census
            # nor the detokenizer's backlog of its last tokens is waited for. The scheduler takes the abort (or the
            # drop) before any later message (one FIFO socket), so no request decodes on the new weights.
            in_place = abort_mode == "in_place"
            stats["aborted"] = self._call(self._abort_all(tell_sglang=not in_place))
            if in_place:   # the scheduler ends them itself, with no step and no answer per request (op "drop")
                t1 = time.perf_counter()
                rec = self.census("drop")[0]
                stats.update(drop_s=time.perf_counter() - t1, drop_hook_s=rec.get("hook_s", 0.0),
                             dropped=rec.get("dropped", 0), drop=rec.get("how"))
                if not rec.get("idle"):   # finish_sync's flush_cache would then fail: say why first
                    logger.warning("SGLang's scheduler still holds requests after the abort's drop (%s)", rec)

    async def _close(self, mode: str, sglang_mode: str) -> None:
        self._open.clear()
        self.paused_mode = mode
        if mode == "wait":
            return
        from sglang.srt.managers.io_struct import PauseGenerationReqInput
        # in_place is O(1); then keep: the retraction after the load (settle); abort: op "drop", now. "retract"
        # (the older pauses): the step in flight is processed and the requests retracted inside the pause.
        await self.tm.pause_generation(PauseGenerationReqInput(mode=sglang_mode))
        # The pause message is queued for the scheduler; no request is sent after it without is_pause being
        # checked first. Which requests were sent before? (no await from here to the census: consistent)
        for r in self._reqs.values():
            st = self.tm.rid_to_state.get(r.rid) if r.started else None
            r.phase = ("ended" if st is None else "sent" if st.dispatched else "fresh") if r.started else "fresh"
            if mode == "abort" and r.phase == "fresh":
                r.aborted = True       # never reached the scheduler: end it here, with no tokens
                r.task.cancel()

    async def _drain(self, counts: dict[str, int]) -> bool:
        for r in self._reqs.values():
            r.target = counts.get(r.rid, None if r.phase in ("sent", "ended") else 0)
        ok = await self._until(lambda: all(len(r.tokens) >= r.target if r.target is not None else False
                                           for r in self._reqs.values()), self.drain_timeout_s)
        if not ok:
            lag = [r.rid for r in self._reqs.values() if r.target is None or len(r.tokens) < r.target]
            logger.warning("%d requests still lack tokens generated before the pause after %.1fs; their token "
                           "versions may be off (%s)", len(lag), self.drain_timeout_s, lag[:3])
        over = [r.rid for r in self._reqs.values() if r.target is not None and len(r.tokens) > r.target]
        if over:
            logger.error("requests %s got more tokens than the paused scheduler generated", over[:3])
        return ok and not over

    async def _abort_all(self, tell_sglang: bool = True) -> int:
        """Every request ends now with finish_reason "abort" and the tokens that reached its stream so far; with
        tell_sglang, SGLang's abort_request(abort_all) ends them in the scheduler (else the caller's op "drop")."""
        for r in self._reqs.values():
            r.aborted = True
        if tell_sglang:
            self.tm.abort_request(abort_all=True)   # SGLang drops them (retracted ones wait in its queue)
        # Our TokenizerManager states go first: a cancelled generate_request then finds none and sends no AbortReq
        # of its own (tokenizer_manager.py:3512-3525; abort_all covers them), and the scheduler's answers for these
        # rids are skipped (:2204-2212). 512 such sends were most of the abort pause's loop-thread time.
        drop = getattr(self.tm, "_remove_req_state", None)
        n = len(self._reqs)
        for r in list(self._reqs.values()):
            if drop is not None and r.started:
                drop(r.rid)
            r.task.cancel()                     # _one ends it as aborted, without waiting for SGLang's answer
        if not await self._until(lambda: not self._reqs, self.drain_timeout_s):
            logger.warning("%d requests did not end %.1fs after their abort", len(self._reqs), self.drain_timeout_s)
        return n

    async def _until(self, cond: Callable[[], bool], timeout: float | None) -> bool:
        deadline = None if timeout is None else self._loop.time() + timeout
        while not cond():
            if deadline is not None and self._loop.time() > deadline:
                return False
            await asyncio.sleep(0.001)
        return True

    def settle(self) -> list[dict]:
        """After a "keep" pause (once the weights loaded): the scheduler processes the step launched before the
        pause and retracts every request (op "retract"); its exact counts replace the pause's predicted ones.
        Returns every TP rank's record ([] when there is nothing to settle)."""
        if self.paused_mode != "keep" or self._settled:
            return []
        t0 = time.perf_counter()
        recs = self.census("retract")
        exact = recs[0]["census"]
        predicted = self._counts or {}
        off = [rid for rid, n in exact.items() if predicted.get(rid) != n]
        if off:   # the prediction rule (sglang_sched.pending_tokens) missed a case: the exact counts are used
            logger.warning("SGLang's token counts after the retraction differ from the pause's for %d requests (%s)",
                           len(off), off[:3])
        self._counts, self._settled = exact, True
        self.last_pause.update(settle_s=time.perf_counter() - t0, predicted=not off, retract=recs[0].get("how"),
                               retract_hook_s=recs[0].get("hook_s", 0.0))
        return recs

    def resume(self) -> None:
        """After "keep": settle() if no weight load did, then wait until the tokens generated before the pause
        reached our streams (the backlog came in while the weights loaded). Then stamp later tokens with
        version_fn() (read now) and let SGLang generate."""
        t0 = time.perf_counter()
        self.settle()
        if self._counts is not None:
            counts, self._counts = self._counts, None
            self.last_pause["exact"] = self._call(self._drain(counts))
            self.last_pause["drain_s"] = time.perf_counter() - t0
        self._call(self._resume())
        self.last_pause["resume_s"] = time.perf_counter() - t0

    async def _resume(self) -> None:
        for call in list(self._calls):
            call.version = int(call.version_fn())
        if self.paused_mode in ("keep", "abort"):
            from sglang.srt.managers.io_struct import ContinueGenerationReqInput
            await self.tm.continue_generation(ContinueGenerationReqInput(torch_empty_cache=False))
        self.paused_mode = None
        self._open.set()

    def shutdown(self, stop_engine: Callable[[], None] | None = None) -> None:
        """Cancel our requests, run `stop_engine` (Engine.shutdown and friends), then stop the loop."""
        if not self._loop.is_closed():
            try:
                self._call(self._cancel_all(), timeout=30)
            except Exception:
                logger.warning("cancelling SGLang requests at shutdown failed", exc_info=True)
        if stop_engine is not None:
            stop_engine()
        self._stop_loop()

    async def _cancel_all(self) -> None:
        tasks = [r.task for r in self._reqs.values() if r.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _stop_loop(self) -> None:
        if not self._loop.is_closed():
            def stop():
                for t in asyncio.all_tasks(self._loop):   # SGLang's handle_loop and friends
                    t.cancel()
                self._loop.call_soon(self._loop.stop)
            self._loop.call_soon_threadsafe(stop)
            self._thread.join(timeout=30)
            if not self._thread.is_alive():
                self._loop.close()


# ---- the engine ---------------------------------------------------------------------------------
class StreamingSGLangEngine(SGLangEngine):
    """`kind: sglang` with `streaming: true`: SGLangEngine on an AsyncSGLangRunner. Many generate calls in flight at
    once (continuous batching across them), pauses that keep or abort running requests (partial rollouts), and
    exact per-token versions. Weight sync (broadcast, IPC) and its verification are SGLangEngine's."""

    generation = Capabilities(partial_rollouts=True, concurrent_generate=True)
    weight_loaders = (HOOK, CENSUS)
    # How the scheduler retracts a "keep" pause's requests after the load, or drops an "abort" pause's: "bulk"
    # (engines/sglang_sched.py: one pass, where the configuration is the plain one; SGLang's own elsewhere) or
    # "sglang" (always SGLang's own). keep_pause / abort_pause: SGLang's pause mode for each; "retract" is the pause
    # before the sixteenth / seventeenth session. Not user settings: bench/pause_latency.py compares them.
    retract = "bulk"
    keep_pause = "in_place"
    abort_pause = "in_place"

    def _start_engine(self, **kw):
        from sglang.srt.entrypoints.engine import Engine   # sets SGLang's event-loop policy before our loop exists
        kw.update(stream_interval=1, incremental_streaming_output=False)   # every token streamed, cumulative lists
        self._census_seq = 0
        self.runner = AsyncSGLangRunner(lambda: Engine(**kw), self._census)
        return self.runner.engine

    def _census(self, op: str) -> list[dict]:
        """The paused scheduler's census ("count"), retraction ("retract") or drop ("drop"), one record per TP rank."""
        self._census_seq += 1
        cfg = json.dumps({"dir": self._dir, "seq": self._census_seq, "op": op, "bulk": self.retract == "bulk"})
        self._call("census", self.engine.update_weights_from_tensor, [(PREFIX + cfg, torch.empty(0))],
                   load_format=CENSUS, flush_cache=False)
        recs = self._reports(self._census_seq, prefix="census")
        for r in recs:
            if r.get("error"):
                raise EngineError(f"engine {self.name}: the scheduler's {op} failed on TP rank {r['rank']}: "
                                  f"{r['error']}")
        return recs

    def generate(self, prompts: Sequence[Sequence[int]], params) -> list[Sample]:
        flat, sp, n = self._prompt_requests(prompts, params)
        if not flat:
            return []
        try:
            rows = self.runner.generate(flat, sp, lambda: self.weight_version)
        except EngineError as e:
            raise EngineError(f"engine {self.name}: {e}") from e
        samples = []
        for j, toks, lps, versions, reason, text in rows:
            if reason not in ("stop", "length", "abort"):
                raise EngineError(f"engine {self.name}: a request finished with {reason!r}")
            if lps is None and reason != "abort":
                raise EngineError(f"engine {self.name}: SGLang returned no per-token logprobs for a completion")
            samples.append(Sample(prompt_index=j // n, prompt_ids=flat[j], response_ids=toks, logprobs=lps or [],
                                  finish_reason=reason, weight_version=versions[0] if versions else self.weight_version,
                                  engine=self.name, text=text, token_versions=list(versions)))
        return samples

    def pause(self, mode: str = "wait") -> None:
        if mode not in PAUSE_MODES:
            raise EngineError(f"engine {self.name}: unknown pause mode {mode!r}; use one of {PAUSE_MODES}")
        self.runner.pause(mode, self.keep_pause, self.abort_pause)
        # its parts in seconds (census, drain, drop); counts and flags stay in the runner's own record
        self.last_pause = {k: float(v) for k, v in self.runner.last_pause.items() if k.endswith("_s") and k != "pause_s"}
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        if self.runner.paused_mode is not None:
            self.runner.resume()

    def finish_sync(self, version: int) -> None:
        """After "keep": the scheduler retracts the kept requests now that the weights are loaded and drops the
        old-weight KV (flush_cache would fail: the retracted requests wait in its queue), so kept and new requests
        prefill under the new weights."""
        if self.runner.paused_mode != "keep":
            return super().finish_sync(version)
        for rec in self.runner.settle():
            if rec.get("protected") or rec.get("evictable_after"):
                raise EngineError(f"engine {self.name}: TP rank {rec['rank']} kept old-weight KV in its radix cache "
                                  f"({rec.get('protected')} locked, {rec.get('evictable_after')} left after evicting)")
        self.weight_version = version
        self._stale = False

    def sleep(self, level: int = 1) -> None:
        if self.runner.in_flight():
            raise EngineError(f"engine {self.name}: cannot sleep with {self.runner.in_flight()} requests in flight or "
                              "kept (SGLang releases memory only when idle); pause in 'wait' or 'abort' mode first")
        super().sleep(level)

    def shutdown(self) -> None:
        self.runner.shutdown(super().shutdown)
