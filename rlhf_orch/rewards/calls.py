"""Call the rule-based reward function on a chunk of samples, in any of its four forms, bounded by reward.timeout_s.

    per sample, sync    fn(response, row) -> float, once per sample, in order (the original form)
    per sample, async   async def fn(response, row) -> float; a chunk's calls are awaited concurrently
    batch, sync         fn(responses, rows) -> list[float], one call per chunk
    batch, async        async def fn(responses, rows) -> list[float]

A function is a batch function when it carries the `rlhf_orch.rewards.batched` decorator or `reward.batch` is true;
it is async when it is an `async def` (or an object whose __call__ is). A batch function is never called with
empty lists (the reward workers' start-up probe scores no samples).

`timeout_s` (None: no limit) bounds each call: each sample's call, or a batch's one call. A sync function then runs
in a daemon worker thread and the caller stops waiting when the time is up. Python cannot kill a thread: a hung call
keeps running (and holding what it holds) until it returns or the process exits; the RewardError fails the step,
which ends the run. Async calls run on one event loop per RewardFunction, in its own daemon thread (kept across
chunks, so a client made by the function stays on one loop); a call past the limit is cancelled. A coroutine that
blocks the loop with sync code cannot be cancelled, so the wait for the whole chunk is bounded too.

A per-sample sync function with no timeout is called exactly as before this module existed: in the caller's
thread, one sample after another, so rewards are bit for bit those of earlier versions.

A value must be a finite int or float (not a bool); a dense function's value (`dense=True`, or the
rlhf_orch.rewards.dense decorator) is a list of them, one per response token: len(row["response_ids"]). An
exception, any other value, a batch result of the wrong length, or a timeout is a RewardError naming the function,
the prompt and what it returned. No Ray, no torch.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import threading

from rlhf_orch.errors import RewardError
from rlhf_orch.rewards import is_batched, is_dense

_TIMED_OUT = object()   # what a per-call wait returns when the call did not finish in time


class _LoopBlocked(Exception):
    """The wait for a chunk on the event loop ran out: a coroutine blocks the loop. Turned into a RewardError."""


def is_async(fn) -> bool:
    """An `async def` function (or functools.partial of one), or an object with an `async def __call__`."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(type(fn), "__call__", None))


def short(value, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters (a function that returns a whole document must not flood the log)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def in_thread(call, timeout_s: float, name: str):
    """call() in a daemon thread, waiting at most timeout_s: its value, or _TIMED_OUT. Its exception is re-raised.

    Not concurrent.futures: its worker threads are joined at interpreter exit, so one hung call would keep the
    process from exiting. A daemon thread is simply abandoned; it cannot be killed."""
    box: dict = {}

    def target():
        try:
            box["value"] = call()
        except BaseException as e:   # handed to the caller, which decides how to report it
            box["error"] = e

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return _TIMED_OUT
    if "error" in box:
        raise box["error"]
    return box["value"]


class RewardFunction:
    """The configured reward function, callable on a chunk: `fn_call(items)` -> one float per (response, row), or
    (dense) one list of floats per (response, row), as long as the row's "response_ids"."""

    def __init__(self, fn, path: str, batch: bool = False, timeout_s: float | None = None, dense: bool = False):
        self.fn, self.path, self.timeout_s = fn, path, timeout_s
        self.batch = bool(batch) or is_batched(fn)
        self.dense = bool(dense) or is_dense(fn)
        self.is_async = is_async(fn)
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def form(self) -> str:
        return f"{'dense ' if self.dense else ''}{'batch' if self.batch else 'per-sample'} {'async' if self.is_async else 'sync'}"

    def __call__(self, items: list[tuple[str, dict]]) -> list:
        if self.batch:
            return self._batch(items)
        if self.is_async:
            return self._async_samples(items)
        if self.timeout_s is None:
            return [self._call(response, row) for response, row in items]   # the original path, unchanged
        return [self._bounded_call(response, row) for response, row in items]

    # ---- per sample ---------------------------------------------------------------------------------------------
    def _call(self, response: str, row: dict) -> float:
        try:
            value = self.fn(response, row)
        except Exception as e:
            raise self._raised(e, f"on response {response!r} for prompt {row.get('prompt')!r}") from None
        return self._checked(value, row)

    def _bounded_call(self, response: str, row: dict) -> float:
        where = f"on response {response!r} for prompt {row.get('prompt')!r}"
        try:
            value = in_thread(lambda: self.fn(response, row), self.timeout_s, "reward-call")
        except Exception as e:
            raise self._raised(e, where) from None
        if value is _TIMED_OUT:
            raise self._timed_out(where, thread_note=True)
        return self._checked(value, row)

    def _async_samples(self, items: list[tuple[str, dict]]) -> list[float]:
        if not items:
            return []
        done = [False] * len(items)   # which calls came back: the first that did not is named if the loop is blocked

        async def one(i: int, response: str, row: dict):
            try:
                return await self._awaited(lambda: self.fn(response, row))
            finally:
                done[i] = True

        async def chunk():
            return await asyncio.gather(*(one(i, r, row) for i, (r, row) in enumerate(items)), return_exceptions=True)

        try:
            outcomes = self._on_loop(chunk())
        except _LoopBlocked:
            first = next((i for i, d in enumerate(done) if not d), 0)
            raise self._loop_blocked(items[first][1].get("prompt")) from None
        values = []
        for (response, row), out in zip(items, outcomes):
            where = f"on response {response!r} for prompt {row.get('prompt')!r}"
            if out is _TIMED_OUT:
                raise self._timed_out(where)
            if isinstance(out, (KeyboardInterrupt, SystemExit)):
                raise out
            if isinstance(out, BaseException):   # an Exception, or a CancelledError the function raised itself
                raise self._raised(out, where)
            values.append(self._checked(out, row))
        return values

    # ---- batch --------------------------------------------------------------------------------------------------
    def _batch(self, items: list[tuple[str, dict]]) -> list[float]:
        if not items:
            return []
        responses, rows = [r for r, _ in items], [row for _, row in items]
        where = f"on a batch of {len(items)} responses (first prompt {rows[0].get('prompt')!r})"
        call = lambda: self.fn(responses, rows)   # noqa: E731
        try:
            if self.is_async:
                out = self._on_loop(self._awaited(call))
            elif self.timeout_s is None:
                out = call()
            else:
                out = in_thread(call, self.timeout_s, "reward-batch")
        except _LoopBlocked:
            raise self._loop_blocked(rows[0].get("prompt")) from None
        except Exception as e:
            raise self._raised(e, where) from None
        if out is _TIMED_OUT:
            raise self._timed_out(where, thread_note=not self.is_async)
        if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):
            out = out.tolist()   # a numpy array or a torch tensor of scores
        each = "list of finite floats (one per response token)" if self.dense else "finite float"
        values = "lists of finite floats (one per response token)" if self.dense else "finite floats"
        if not isinstance(out, (list, tuple)):
            raise RewardError(f"reward.function {self.path} (a batch function) returned {short(out)} {where}; it must "
                              f"return a list of {len(items)} {values}, one per response, in order")
        if len(out) != len(items):
            raise RewardError(f"reward.function {self.path} (a batch function) returned {len(out)} values {where}; it "
                              f"must return one {each} per response ({len(items)}), in order")
        return [self._checked(v, row) for v, row in zip(out, rows)]

    # ---- the event loop -----------------------------------------------------------------------------------------
    async def _awaited(self, make):
        """Await the coroutine make() returns, at most timeout_s; _TIMED_OUT (and the call cancelled) past it."""
        if self.timeout_s is None:
            return await make()
        task = asyncio.ensure_future(make())
        done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        if not done:
            task.cancel()   # not awaited: a coroutine that swallows the cancellation must not hold the chunk up
            return _TIMED_OUT
        return task.result()

    def _on_loop(self, coro):
        """Run `coro` on this function's loop. Every call in it is bounded by _awaited, so the loop returns within
        about timeout_s unless a coroutine blocks it with sync code: the outer wait catches that."""
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="reward-loop", daemon=True).start()
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        limit = None if self.timeout_s is None else self.timeout_s * 1.1 + 1.0
        try:
            return future.result(limit)
        except concurrent.futures.TimeoutError:
            if future.done():   # the function's own TimeoutError (the same class since Python 3.11)
                raise
            future.cancel()
            self._loop = None   # that loop stays blocked: a later call (if any) gets a fresh one
            raise _LoopBlocked() from None

    def close(self) -> None:
        """Stop this function's event loop thread, if it has one (the reward workers' lives with their process)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    # ---- messages -----------------------------------------------------------------------------------------------
    def _checked(self, value, row: dict):
        if self.dense:
            return self._checked_dense(value, row)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RewardError(f"reward.function {self.path} returned {short(value)} for prompt {row.get('prompt')!r}; "
                              "it must return a finite float")
        return float(value)

    def _checked_dense(self, value, row: dict) -> list[float]:
        n = len(row["response_ids"])   # the rollout manager (and the pre-launch check) add them: with_response_ids
        if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
            value = value.tolist()     # a numpy array or a torch tensor
        fix = (f"a dense function returns one finite float per response token: a list of len(row['response_ids']) "
               f"= {n} values")
        if not isinstance(value, (list, tuple)):
            raise RewardError(f"reward.function {self.path} returned {short(value)} for prompt {row.get('prompt')!r}; "
                              f"{fix} (a plain per-response reward: drop reward.dense / the dense decorator)")
        if len(value) != n:
            raise RewardError(f"reward.function {self.path} returned {len(value)} values for prompt "
                              f"{row.get('prompt')!r}; {fix}")
        bad = next((i for i, v in enumerate(value)
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)), None)
        if bad is not None:
            raise RewardError(f"reward.function {self.path} returned {short(value[bad])} for response token {bad} of "
                              f"prompt {row.get('prompt')!r}; {fix}")
        return [float(v) for v in value]

    def _raised(self, e: BaseException, where: str) -> RewardError:
        return RewardError(f"reward.function {self.path} raised {type(e).__name__}: {e} {where}")

    def _loop_blocked(self, prompt) -> RewardError:
        return RewardError(f"reward.function {self.path} did not return within reward.timeout_s={self.timeout_s} s "
                           f"for prompt {prompt!r}, and its event loop stayed blocked (sync code such as time.sleep or "
                           "a blocking request inside the async def?); await non-blocking calls, or make it a plain def")

    def _timed_out(self, where: str, thread_note: bool = False) -> RewardError:
        # A sync call cannot be stopped: say so, since it may go on using CPU, memory or a connection.
        note = " (the call goes on in its thread: Python cannot stop a thread)" if thread_note else ""
        return RewardError(f"reward.function {self.path} did not return within reward.timeout_s={self.timeout_s} s "
                           f"{where}{note}; make it faster or raise reward.timeout_s")
