"""The four forms of a reward function (rlhf_orch/rewards/calls.py through scorer.py): per sample or batched, sync or
async, and reward.timeout_s bounding each call, hung sync functions included. No Ray."""
import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rlhf_orch.config import load_config
from rlhf_orch.errors import ConfigError, RewardError
from rlhf_orch.rewards import batched, is_batched
from rlhf_orch.rewards.builtin import exact_match
from rlhf_orch.rewards.calls import RewardFunction
from rlhf_orch.rewards.scorer import RewardScorer

ROOT = Path(__file__).resolve().parents[2]
HERE = __name__   # the module pytest imported, so the scorer finds these very functions (and their state)
ITEMS = [(r, {"prompt": p, "answer": a}) for p, r, a in
         [("3+4=", "7", "7"), ("1+2=", "4", "3"), ("4+4=", "8", "8"), ("0+0=", "", "0"), ("2+1=", "3 ", "3")]]
RELEASE = threading.Event()   # set at the end of the module: lets the deliberately hung calls' threads finish
CALLS = {"threads": [], "batches": []}


@pytest.fixture(autouse=True, scope="module")
def _release_hung_threads():
    yield
    RELEASE.set()


def odd_float(response: str, row: dict) -> float:
    """Values whose bits show any change of arithmetic: 0.1 + 0.2 style sums."""
    CALLS["threads"].append(threading.current_thread())
    return exact_match(response, row) * 0.1 + 0.2 + len(response) / 3


@batched
def batch_match(responses: list[str], rows: list[dict]) -> list[float]:
    CALLS["batches"].append(len(responses))
    return [odd_float(r, row) for r, row in zip(responses, rows)]


def undecorated_batch(responses, rows):
    return np.array([odd_float(r, row) for r, row in zip(responses, rows)])   # an array is fine too


async def async_sample(response: str, row: dict) -> float:
    await asyncio.sleep(0.3)
    return odd_float(response, row)


@batched
async def async_batch(responses, rows):
    await asyncio.sleep(0.01)
    return [odd_float(r, row) for r, row in zip(responses, rows)]


async def async_raises_on_4(response, row):
    if row["prompt"] == "4+4=":
        raise ValueError("no eights")
    return 1.0


async def async_hangs_on_1(response, row):
    if row["prompt"] == "1+2=":
        await asyncio.sleep(60)
    return 1.0


async def async_blocks_the_loop(response, row):
    RELEASE.wait(5)   # sync code inside an async def: the loop cannot run anything else, nor cancel it
    return 1.0


def sync_hangs_on_4(response, row):
    if row["prompt"] == "4+4=":
        RELEASE.wait(60)
    return 1.0


@batched
def batch_hangs(responses, rows):
    RELEASE.wait(60)
    return [1.0] * len(responses)


@batched
def batch_too_short(responses, rows):
    return [1.0] * (len(responses) - 1)


@batched
def batch_none(responses, rows):
    return None


@batched
def batch_nan_on_second(responses, rows):
    return [float("nan") if i == 1 else 0.0 for i in range(len(responses))]


def expected():
    return [odd_float(r, row) for r, row in ITEMS]


def scorer(name, **kw):
    return RewardScorer(f"{HERE}:{name}", **kw)


# ---- the per-sample path -------------------------------------------------------------------------------------------
def test_per_sample_sync_without_timeout_is_the_original_path():
    want = expected()
    CALLS["threads"].clear()
    got = scorer("odd_float").score(ITEMS)
    assert [v.hex() for v in got] == [v.hex() for v in want]                 # bit for bit
    assert CALLS["threads"] == [threading.current_thread()] * len(ITEMS)     # in the caller's thread, one by one
    assert RewardScorer("rlhf_orch.rewards.builtin:exact_match").score(ITEMS) == [exact_match(r, row) for r, row in ITEMS]
    assert scorer("odd_float").score([]) == []


def test_per_sample_sync_with_a_timeout_runs_in_a_worker_thread_with_the_same_values():
    want = expected()
    CALLS["threads"].clear()
    got = scorer("odd_float", timeout_s=10).score(ITEMS)
    assert [v.hex() for v in got] == [v.hex() for v in want]
    assert threading.current_thread() not in CALLS["threads"] and len(CALLS["threads"]) == len(ITEMS)


# ---- batch ---------------------------------------------------------------------------------------------------------
def test_batched_decorator_scores_the_chunk_in_one_call():
    assert is_batched(batch_match) and not is_batched(odd_float)
    CALLS["batches"].clear()
    s = scorer("batch_match", function_weight=2.0)
    assert s.call.form == "batch sync"
    assert s.score_parts(ITEMS)["function"] == expected()
    assert s.score(ITEMS) == [2.0 * v for v in expected()]
    assert s.score([]) == [] and CALLS["batches"] == [len(ITEMS), len(ITEMS)]   # never called with empty lists


def test_reward_batch_true_declares_a_function_that_cannot_be_decorated():
    assert scorer("undecorated_batch", batch=True).score(ITEMS) == pytest.approx(expected(), abs=0)
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [f"reward.function={HERE}:undecorated_batch", "reward.batch=true"])
    assert cfg.reward.batch is True and cfg.reward.timeout_s is None


@pytest.mark.parametrize("name, message", [
    ("batch_too_short", f"reward.function {HERE}:batch_too_short (a batch function) returned 4 values on a batch of 5 "
                        "responses (first prompt '3+4='); it must return one finite float per response (5), in order"),
    ("batch_none", f"reward.function {HERE}:batch_none (a batch function) returned None on a batch of 5 responses "
                   "(first prompt '3+4='); it must return a list of 5 finite floats, one per response, in order"),
    ("batch_nan_on_second", f"reward.function {HERE}:batch_nan_on_second returned nan for prompt '1+2='; it must "
                            "return a finite float"),
])
def test_bad_batch_results(name, message):
    with pytest.raises(RewardError) as e:
        scorer(name).score(ITEMS)
    assert str(e.value) == message


# ---- async ---------------------------------------------------------------------------------------------------------
def test_async_per_sample_calls_run_concurrently_in_order():
    s = scorer("async_sample")
    assert s.call.form == "per-sample async"
    t0 = time.perf_counter()
    got = s.score(ITEMS)
    took = time.perf_counter() - t0
    assert got == expected() and took < 0.3 * len(ITEMS) / 2, took   # five 0.3 s sleeps overlap
    assert s.score(ITEMS) == expected()                              # the loop is reused across chunks


def test_async_batch():
    s = scorer("async_batch", timeout_s=5)
    assert s.call.form == "batch async" and s.score(ITEMS) == expected() and s.score([]) == []


def test_async_exception_names_the_row():
    with pytest.raises(RewardError) as e:
        scorer("async_raises_on_4").score(ITEMS)
    assert str(e.value) == (f"reward.function {HERE}:async_raises_on_4 raised ValueError: no eights on response '8' "
                            "for prompt '4+4='")


# ---- timeouts ------------------------------------------------------------------------------------------------------
def test_async_timeout_cancels_the_call_and_names_function_row_and_limit():
    t0 = time.perf_counter()
    with pytest.raises(RewardError) as e:
        scorer("async_hangs_on_1", timeout_s=0.3).score(ITEMS)
    assert time.perf_counter() - t0 < 3
    assert str(e.value) == (f"reward.function {HERE}:async_hangs_on_1 did not return within reward.timeout_s=0.3 s on "
                            "response '4' for prompt '1+2='; make it faster or raise reward.timeout_s")


def test_async_function_that_blocks_its_loop_is_bounded_too():
    t0 = time.perf_counter()
    with pytest.raises(RewardError) as e:
        scorer("async_blocks_the_loop", timeout_s=0.2).score(ITEMS[:1])
    assert time.perf_counter() - t0 < 3
    assert str(e.value).startswith(f"reward.function {HERE}:async_blocks_the_loop did not return within "
                                   "reward.timeout_s=0.2 s for prompt '3+4=', and its event loop stayed blocked")


def test_hung_sync_function_is_bounded():
    t0 = time.perf_counter()
    with pytest.raises(RewardError) as e:
        scorer("sync_hangs_on_4", timeout_s=0.3).score(ITEMS)
    assert time.perf_counter() - t0 < 3
    assert str(e.value) == (f"reward.function {HERE}:sync_hangs_on_4 did not return within reward.timeout_s=0.3 s on "
                            "response '8' for prompt '4+4=' (the call goes on in its thread: Python cannot stop a "
                            "thread); make it faster or raise reward.timeout_s")
    hung = [t for t in threading.enumerate() if t.name == "reward-call"]
    assert hung and all(t.daemon for t in hung)   # left running, but never keeps the process from exiting


def test_hung_batch_function_is_bounded():
    t0 = time.perf_counter()
    with pytest.raises(RewardError) as e:
        RewardFunction(batch_hangs, "x:batch_hangs", timeout_s=0.3)(ITEMS)
    assert time.perf_counter() - t0 < 3
    assert str(e.value).startswith("reward.function x:batch_hangs did not return within reward.timeout_s=0.3 s on a "
                                   "batch of 5 responses (first prompt '3+4=')")


def test_timeout_must_be_positive():
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/tiny_cpu.yaml", ["reward.timeout_s=0"])
    (line,) = e.value.problems
    assert line.startswith("reward.timeout_s: Input should be greater than 0")
    assert load_config(ROOT / "configs/tiny_cpu.yaml", ["reward.timeout_s=2.5"]).reward.timeout_s == 2.5
