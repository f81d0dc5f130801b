"""AsyncSGLangRunner (rlhf_orch/engines/sglang_async.py) against a fake of SGLang 0.5.17's async API, on CPU.

The fake keeps what the runner depends on: `Engine.async_generate(stream=True)` streams non-incremental outputs
whose output_ids / output_token_logprobs are the request's live, growing lists (tokenizer_manager.py:2327-2400);
the TokenizerManager's pause_generation is fire-and-forget (the scheduler acts on it later, in order with the other
messages), new requests wait on is_pause before they are sent (`ReqState.dispatched` marks the send), a retract
moves running requests back to the waiting queue, and tokens reach the TokenizerManager only after a detokenizer
delay much longer than a decode step, so many are still on their way when the pause returns. An `in_place` pause
leaves one step launched and unprocessed, as SGLang's overlap loop does: its token (sampled before the pause) is
appended only when that step is processed, by the retraction (or by continue). An abort of a queued request answers
on a direct path (overtaking those tokens) with output_ids [last] (:3181-3184). The census ops ("count": tokens
including the pending step's; "retract": process the step, retract, exact counts; "drop": discard the step and
every request; engines/sglang_sched.py) are queued behind the pause like the real custom-loader call.
"""
from __future__ import annotations

import asyncio
import sys
import threading
import time
import types
from dataclasses import dataclass, field

import pytest

from rlhf_orch.engines.sglang_async import AsyncSGLangRunner
from rlhf_orch.errors import EngineError

STEP_S = 0.002
DETOK_S = 0.03      # detokenizer latency: ~15 decode steps of tokens in flight at any time


def tok(prompt: list[int], j: int) -> int:
    return (sum(prompt) * 31 + j * 7) % 50000 + 1


def lp(prompt: list[int], j: int) -> float:
    return -((sum(prompt) % 13) * 0.01 + j * 0.001) - 0.5


@dataclass
class PauseGenerationReqInput:
    mode: str = "abort"


@dataclass
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@pytest.fixture(autouse=True)
def fake_io_struct(monkeypatch):
    mods = {}
    for name in ("sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.managers.io_struct"):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    mods["sglang.srt.managers.io_struct"].PauseGenerationReqInput = PauseGenerationReqInput
    mods["sglang.srt.managers.io_struct"].ContinueGenerationReqInput = ContinueGenerationReqInput


# ---------------------------------------------------------------- the fake

@dataclass
class SReq:                      # the scheduler's request
    rid: str
    prompt: list[int]
    max_new: int
    output_ids: list[int] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)    # scheduler epoch (number of continues) per token

    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_new


@dataclass
class State:                     # the TokenizerManager's ReqState
    event: asyncio.Event = field(default_factory=asyncio.Event)
    out_list: list = field(default_factory=list)
    finished: bool = False
    dispatched: bool = False
    abort_requested: bool = False
    output_ids: list[int] = field(default_factory=list)
    lps: list[tuple] = field(default_factory=list)


class FakeScheduler:
    def __init__(self, tm: "FakeTM"):
        self.tm, self.inbox, self.waiting, self.running = tm, [], [], []
        self.paused, self.epoch, self.all, self.dropped = False, 0, {}, 0
        self.pending: list[SReq] = []   # the step launched before an in_place pause, not processed yet
        self.task = asyncio.get_running_loop().create_task(self.loop())

    async def loop(self):
        while True:
            await asyncio.sleep(STEP_S)
            inbox, self.inbox = self.inbox, []
            for msg in inbox:
                if msg[0] == "gen":
                    self.waiting.append(msg[1])
                    self.all[msg[1].rid] = msg[1]
                elif msg[0] == "pause":
                    self.paused = True
                    if msg[1] == "retract":
                        self.waiting = self.running + self.waiting
                        self.running = []
                    else:                                          # in_place: one step in flight
                        self.pending = [r for r in self.running if not r.finished()]
                elif msg[0] == "continue":
                    self.settle()
                    self.paused = False
                    self.epoch += 1
                elif msg[0] == "abort":
                    for r in [r for r in self.waiting if msg[2] or r.rid == msg[1]]:
                        self.waiting.remove(r)
                        self.tm.deliver_abort(r.rid)                # direct path: no detokenizer delay
                elif msg[0] == "census" and msg[2] == "drop":      # the step in flight discarded, all dropped
                    self.dropped = len({r.rid for r in self.waiting + self.running})
                    self.pending, self.waiting, self.running = [], [], []
                    msg[1].set_result({})
                elif msg[0] == "census" and msg[2] == "count":
                    ahead = {r.rid for r in self.pending}
                    msg[1].set_result({r.rid: len(r.output_ids) + (r.rid in ahead)
                                       for r in self.waiting + self.running if not r.finished()})
                elif msg[0] == "census":                          # retract: process the step, then retract
                    self.settle()
                    self.waiting = self.running + self.waiting
                    self.running = []
                    msg[1].set_result({r.rid: len(r.output_ids) for r in self.waiting if not r.finished()})
            if self.paused:
                continue
            self.running += self.waiting
            self.waiting = []
            for r in list(self.running):
                self.step(r)

    def step(self, r: SReq) -> None:
        j = len(r.output_ids)
        r.output_ids.append(tok(r.prompt, j))
        r.epochs.append(self.epoch)
        done = r.finished()
        if done:
            self.running.remove(r)
        asyncio.get_running_loop().call_later(DETOK_S, self.tm.deliver, r.rid, [tok(r.prompt, j)], [lp(r.prompt, j)],
                                              {"type": "length"} if done else None)

    def settle(self) -> None:
        pending, self.pending = self.pending, []
        for r in pending:
            if r in self.running and not r.finished():
                self.step(r)

    async def census(self, op: str) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self.inbox.append(("census", fut, op))
        return await fut


class FakeTM:
    def __init__(self):
        self.is_pause = False
        self.cond = asyncio.Condition()
        self.rid_to_state: dict[str, State] = {}
        self.sched = FakeScheduler(self)
        self.tokenize_s = 0.0
        self.pause_modes: list[str] = []
        self.own_aborts = 0             # AbortReqs a cancelled generate_request sent for its own request
        self.abort_alls = 0

    async def pause_generation(self, obj):
        self.pause_modes.append(obj.mode)
        async with self.cond:
            self.is_pause = True
            self.sched.inbox.append(("pause", obj.mode))            # fire-and-forget

    async def continue_generation(self, obj):
        async with self.cond:
            self.is_pause = False
            self.sched.inbox.append(("continue",))
            self.cond.notify_all()

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self.abort_alls += abort_all
        for r, st in self.rid_to_state.items():
            if abort_all or r == rid:
                st.abort_requested = True
        self.sched.inbox.append(("abort", rid, abort_all))

    async def generate_request(self, rid, prompt, sp):
        st = self.rid_to_state[rid] = State()                      # before the first await, as in SGLang
        try:
            async with self.cond:
                await self.cond.wait_for(lambda: not self.is_pause)
            await asyncio.sleep(self.tokenize_s)
            if st.abort_requested:
                raise ValueError(f"Request {rid} was aborted")
            self.sched.inbox.append(("gen", SReq(rid, list(prompt), sp["max_new_tokens"])))
            st.dispatched = True
            while True:
                await st.event.wait()
                outs, st.out_list = st.out_list, []
                st.event.clear()
                yield outs[-1]
                if st.finished:
                    return
        except BaseException:
            if self.rid_to_state.get(rid) is st and st.dispatched:   # _discard_pending_req_states
                self.sched.inbox.append(("abort", rid, False))
                self.own_aborts += 1
            self.rid_to_state.pop(rid, None)
            raise

    def _remove_req_state(self, rid):
        return self.rid_to_state.pop(rid, None)

    def deliver(self, rid, ids, lps, finish):
        st = self.rid_to_state.get(rid)
        if st is None:
            return
        st.output_ids.extend(ids)
        st.lps.extend((v, t, None) for v, t in zip(lps, ids))
        meta = {"finish_reason": finish, "output_token_logprobs": st.lps, "completion_tokens": len(st.output_ids)}
        if finish:
            st.finished = True
            del self.rid_to_state[rid]
            out = {"text": "".join(f"<{t}>" for t in st.output_ids), "output_ids": list(st.output_ids), "meta_info": meta}
        else:
            out = {"text": None, "output_ids": st.output_ids, "meta_info": meta}     # live list, as SGLang
        st.out_list.append(out)
        st.event.set()

    def deliver_abort(self, rid):
        st = self.rid_to_state.pop(rid, None)
        if st is None:
            return
        st.finished = True
        meta = {"finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                "output_token_logprobs": st.lps, "completion_tokens": len(st.output_ids)}
        st.out_list.append({"text": "", "output_ids": st.output_ids[-1:], "meta_info": meta})
        st.event.set()


class FakeEngine:
    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.tokenizer_manager = FakeTM()

    async def async_generate(self, input_ids=None, sampling_params=None, return_logprob=False, stream=False, rid=None):
        assert stream and return_logprob and sampling_params["n"] == 1
        return self.tokenizer_manager.generate_request(rid, input_ids, sampling_params)

    async def flush_cache(self):
        return "flushed on " + threading.current_thread().name

    def blocking_flush(self):    # what sglang.Engine's blocking methods look like
        return self.loop.run_until_complete(self.flush_cache())


@pytest.fixture
def runner():
    box = {}

    def census(op):
        counts = asyncio.run_coroutine_threadsafe(box["r"].engine.tokenizer_manager.sched.census(op),
                                                  box["r"]._loop).result(10)
        sched = box["r"].engine.tokenizer_manager.sched
        return [{"census": counts, "how": "fake", "hook_s": 0.0, "dropped": sched.dropped,
                 "idle": not (sched.waiting or sched.running or sched.pending)}]

    r = box["r"] = AsyncSGLangRunner(FakeEngine, census, drain_timeout_s=5.0)
    yield r
    r.shutdown()


def sp(max_new: int) -> dict:
    return {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": max_new, "n": 1, "ignore_eos": True}


def in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.update(out=fn()))
    t.start()
    return t, box


def sched_req(runner, prompt):
    return next(r for r in runner.engine.tokenizer_manager.sched.all.values() if r.prompt == prompt)


def check_rows(runner, prompts, rows, versions_by_epoch=None, finish="length"):
    assert [row[0] for row in rows] == list(range(len(prompts)))
    for (i, toks, lps, vers, reason, text), p in zip(rows, prompts):
        n = len(toks)
        assert toks == [tok(p, j) for j in range(n)], "no token lost or repeated"
        assert lps == [lp(p, j) for j in range(n)]
        assert reason == finish
        if versions_by_epoch is not None:
            epochs = sched_req(runner, p).epochs[:n] if n else []
            assert vers == [versions_by_epoch[e] for e in epochs], (vers, epochs)
        if reason == "length":
            assert text == "".join(f"<{t}>" for t in toks)


# ---------------------------------------------------------------- tests

def test_generate_streams_and_stamps(runner):
    prompts = [[1, 2], [3], [4, 5, 6]]
    rows = runner.generate(prompts, [sp(5), sp(9), sp(1)], lambda: 3)
    check_rows(runner, prompts, rows, {0: 3})
    assert [len(r[1]) for r in rows] == [5, 9, 1]
    assert runner.in_flight() == 0


def test_engine_blocking_methods_run_on_the_loop_thread(runner):
    assert runner.engine.blocking_flush() == "flushed on sglang-async-loop"
    with pytest.raises(EngineError, match="own loop thread"):
        runner._call(_call_blocking_inside(runner.engine))


async def _call_blocking_inside(engine):
    return engine.blocking_flush()


def test_keep_pause_stamps_exactly_despite_tokens_in_flight(runner):
    """Tokens generated before the pause carry the old version, all later ones the new one, although ~15 steps
    of tokens are still in the detokenizer when SGLang's pause returns and resume follows at once. The pause does
    not wait for those tokens (issue #27: that backlog is seconds at 512 requests on a GPU); resume does."""
    v = {"v": 0}
    prompts = [[7, i] for i in range(6)]
    t, box = in_thread(lambda: runner.generate(prompts, [sp(120)] * 6, lambda: v["v"]))
    time.sleep(0.08)
    runner.pause("keep")
    tm = runner.engine.tokenizer_manager
    # in_place: the requests are still in the running batch, each with one launched step not processed yet
    assert tm.pause_modes == ["in_place"] and not tm.sched.waiting and len(tm.sched.pending) == 6
    kept = {r.rid: len(r.output_ids) + 1 for r in tm.sched.running}   # the census counts the pending token
    assert runner._counts == kept and all(0 < k < 120 for k in kept.values())
    # pause() returned before the detokenizer's backlog arrived: some pre-pause tokens are still on their way
    assert any(len(runner._reqs[rid].tokens) < k - 1 for rid, k in kept.items())
    assert runner.last_pause["kept"] == 6 and "drain_s" not in runner.last_pause
    time.sleep(0.05)
    assert all(len(runner._reqs[rid].tokens) == k - 1 for rid, k in kept.items()), "nothing generated while paused"
    runner.settle()                                   # "after the load": the pending step is processed, then retracted
    assert not tm.sched.running and len(tm.sched.waiting) == 6
    assert runner.last_pause["predicted"] and runner._counts == kept
    time.sleep(0.05)
    v["v"] = 1
    runner.resume()
    assert runner.last_pause["exact"] and runner.last_pause["drain_s"] < 0.02   # it came in while "loading"
    t.join(20)
    rows = box["out"]
    check_rows(runner, prompts, rows, {0: 0, 1: 1})
    assert all(0 < r[3].index(1) < 120 for r in rows)


@pytest.mark.parametrize("keep_mode", ["in_place", "retract"])
def test_keep_pause_then_resume_at_once_still_stamps_exactly(runner, keep_mode):
    """No load between: resume itself settles and waits for the tokens generated before the pause, then switches
    versions; the same with SGLang's retract pause (StreamingSGLangEngine.keep_pause, the pause before this round)."""
    v = {"v": 0}
    prompts = [[6, i] for i in range(5)]
    t, box = in_thread(lambda: runner.generate(prompts, [sp(150)] * 5, lambda: v["v"]))
    time.sleep(0.08)
    runner.pause("keep", keep_mode)
    assert runner.engine.tokenizer_manager.pause_modes == [keep_mode]
    kept = dict(runner._counts)
    v["v"] = 1
    runner.resume()                 # settles (the pending step, then the retraction) and drains
    assert runner.last_pause["predicted"] and "settle_s" in runner.last_pause
    assert runner.last_pause["exact"] and runner.last_pause["drain_s"] > 0.005   # the backlog was waited for here
    t.join(20)
    rows = box["out"]
    check_rows(runner, prompts, rows, {0: 0, 1: 1})
    assert sorted(r[3].index(1) for r in rows) == sorted(kept.values())   # old version exactly up to the pause


def test_keep_pause_with_requests_not_yet_sent(runner):
    """Requests still tokenizing at the pause reach the scheduler only after resume: all their tokens are new."""
    v = {"v": 0}
    t1, b1 = in_thread(lambda: runner.generate([[1, 1]], [sp(80)], lambda: v["v"]))
    time.sleep(0.05)
    runner.engine.tokenizer_manager.tokenize_s = 0.1
    t2, b2 = in_thread(lambda: runner.generate([[2, 2]], [sp(10)], lambda: v["v"]))
    time.sleep(0.02)
    runner.pause("keep")
    fresh = [r for r in runner._reqs.values() if r.phase == "fresh"]
    assert len(fresh) == 1 and not fresh[0].tokens
    time.sleep(0.15)                     # tokenized while paused: sent, but the scheduler is paused
    v["v"] = 5
    runner.resume()
    t1.join(20), t2.join(20)
    check_rows(runner, [[1, 1]], b1["out"], {0: 0, 1: 5})
    assert b2["out"][0][3] == [5] * 10


@pytest.mark.parametrize("abort_mode", ["in_place", "retract"])
def test_abort_pause_returns_partial_tokens(runner, abort_mode):
    v = {"v": 0}
    prompts = [[9, i] for i in range(4)]
    t1, b1 = in_thread(lambda: runner.generate(prompts, [sp(500)] * 4, lambda: v["v"]))
    time.sleep(0.06)
    runner.engine.tokenizer_manager.tokenize_s = 0.2
    t2, b2 = in_thread(lambda: runner.generate([[8, 8]], [sp(5)], lambda: v["v"]))
    time.sleep(0.02)
    runner.pause("abort", abort_mode=abort_mode)
    t1.join(5), t2.join(5)
    assert not t1.is_alive() and not t2.is_alive(), "an abort pause ends every request before it returns"
    check_rows(runner, prompts, b1["out"], {0: 0}, finish="abort")
    made = [list(sched_req(runner, p).output_ids) for p in prompts]
    for row, ids in zip(b1["out"], made):
        # the tokens that reached the stream, in the scheduler's order; the rest of its backlog is not waited for
        # (the group is re-queued whole), and nothing is decoded after the pause
        assert 0 < len(row[1]) <= len(ids) < 500 and row[1] == ids[:len(row[1])]
    time.sleep(0.1)
    assert [list(sched_req(runner, p).output_ids) for p in prompts] == made
    assert b2["out"][0][1:] == ([], [], [], "abort", "")   # never reached the scheduler
    tm = runner.engine.tokenizer_manager
    assert tm.pause_modes == [abort_mode] and tm.own_aborts == 0, "no AbortReq per request"
    if abort_mode == "retract":
        assert tm.abort_alls == 1
    else:   # in_place: no abort message at all; the scheduler dropped the 4 requests it held, with no step more
        assert tm.abort_alls == 0 and runner.last_pause["dropped"] == 4 and runner.last_pause["drop"] == "fake"
    assert not (tm.sched.waiting or tm.sched.running or tm.sched.pending), "the scheduler holds nothing"
    assert runner.in_flight() == 0
    v["v"] = 1
    runner.resume()
    rows = runner.generate([[3, 3]], [sp(4)], lambda: v["v"])
    assert rows[0][3] == [1] * 4 and rows[0][4] == "length"


def test_wait_pause_lets_requests_finish_and_holds_new_ones(runner):
    v = {"v": 0}
    t1, b1 = in_thread(lambda: runner.generate([[4, 4]], [sp(30)], lambda: v["v"]))
    time.sleep(0.03)
    runner.pause("wait")
    assert runner.in_flight() == 0
    t1.join(2)
    assert b1["out"][0][4] == "length" and b1["out"][0][3] == [0] * 30
    assert runner.engine.tokenizer_manager.pause_modes == []     # SGLang itself is never paused for "wait"
    t2, b2 = in_thread(lambda: runner.generate([[5, 5]], [sp(3)], lambda: v["v"]))
    time.sleep(0.1)
    assert t2.is_alive() and runner.in_flight() == 0, "a request made while paused waits for resume"
    with pytest.raises(EngineError, match="already paused"):
        runner.pause("keep")
    v["v"] = 2
    runner.resume()
    t2.join(10)
    assert b2["out"][0][3] == [2, 2, 2]


def test_many_calls_from_threads_run_concurrently(runner):
    out = {}
    ts = [threading.Thread(target=lambda i=i: out.update({i: runner.generate([[i, 1], [i, 2]], [sp(40)] * 2, lambda: 0)}))
          for i in range(5)]
    t0 = time.perf_counter()
    [t.start() for t in ts]
    [t.join(20) for t in ts]
    assert len(out) == 5 and all(len(r[1]) == 40 for rows in out.values() for r in rows)
    assert time.perf_counter() - t0 < 5 * 40 * STEP_S + 1.0


def test_bad_pause_mode(runner):
    with pytest.raises(EngineError, match="pause mode"):
        runner.pause("sleep")
