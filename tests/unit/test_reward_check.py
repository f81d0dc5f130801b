"""The pre-launch reward check (rlhf_orch/rewards/check.py, called by launch.prepare): the function is called on two
dataset rows with placeholder responses, and anything but finite floats is one `error:` line, before Ray starts."""
import random
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from rlhf_orch.errors import RewardError
from rlhf_orch.rewards import NO_FUNCTION, batched
from rlhf_orch.rewards.check import DUMMY_RESPONSES, check_reward_function

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402

HERE = __name__   # the module pytest imported: the check calls these very functions
ROWS = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "4"}]
SEEN = []
RELEASE = threading.Event()


@pytest.fixture(autouse=True, scope="module")
def _release_hung_threads():
    yield
    RELEASE.set()


def returns_none(response, row):
    return None


def returns_str_on_text(response, row):
    return "0.5" if response else 0.0


def returns_nan(response, row):
    return float("nan")


def raises_on_empty(response, row):
    if not response:
        raise ValueError("empty response\nsee the log")   # a two-line message still makes one error line
    return 1.0


def hangs(response, row):
    RELEASE.wait(60)
    return 0.0


def records_and_edits_its_row(response, row):
    SEEN.append((response, dict(row)))
    row["answer"] = "changed"
    random.random(), np.random.random()   # draws from the global RNGs
    return 0.5


@batched
def batch_of_one(responses, rows):
    return [0.0]


@batched
async def async_batch_ok(responses, rows):
    return [float(len(r)) for r in responses]


def reward(name, batch=False, timeout_s=None):
    return SimpleNamespace(function=f"{HERE}:{name}", batch=batch, timeout_s=timeout_s)


def failure(name, **kw) -> str:
    with pytest.raises(RewardError) as e:
        check_reward_function(reward(name, **kw), ROWS)
    assert "\n" not in str(e.value)
    return str(e.value)


SUFFIX = (f"(found before launch: the {{form}} function was called on the first 2 dataset rows with the placeholder "
          f"responses {DUMMY_RESPONSES[0]!r} and {DUMMY_RESPONSES[1]!r})")


def test_good_functions_pass_and_see_copies_of_two_rows():
    check_reward_function(reward("async_batch_ok", timeout_s=5), ROWS)
    check_reward_function(SimpleNamespace(function="rlhf_orch.rewards.builtin:exact_match", batch=False, timeout_s=None),
                          ROWS)
    SEEN.clear()
    rng = random.getstate(), np.random.get_state()[1].copy()
    check_reward_function(reward("records_and_edits_its_row"), ROWS)
    assert SEEN == [(DUMMY_RESPONSES[0], ROWS[0]), (DUMMY_RESPONSES[1], ROWS[1])]
    assert ROWS[0]["answer"] == "7" and ROWS[1]["answer"] == "3"          # the dataset's rows are untouched
    assert random.getstate() == rng[0] and (np.random.get_state()[1] == rng[1]).all()   # and the RNGs
    SEEN.clear()
    check_reward_function(reward("records_and_edits_its_row"), ROWS[:1])   # one row: used twice
    assert [row for _, row in SEEN] == [ROWS[0], ROWS[0]]


def test_reward_model_only_is_not_checked():
    check_reward_function(SimpleNamespace(function=NO_FUNCTION, batch=False, timeout_s=None), ROWS)


@pytest.mark.parametrize("name, kw, head", [
    ("returns_none", {}, "returned None for prompt '3+4='; it must return a finite float"),
    ("returns_str_on_text", {}, "returned '0.5' for prompt '1+2='; it must return a finite float"),
    ("returns_nan", {}, "returned nan for prompt '3+4='; it must return a finite float"),
    ("raises_on_empty", {}, "raised ValueError: empty response see the log on response '' for prompt '3+4='"),
    ("batch_of_one", {}, "(a batch function) returned 1 values on a batch of 2 responses (first prompt '3+4='); it "
                         "must return one finite float per response (2), in order"),
    ("hangs", {"timeout_s": 0.2}, "did not return within reward.timeout_s=0.2 s on response '' for prompt '3+4=' (the "
                                  "call goes on in its thread: Python cannot stop a thread); make it faster or raise "
                                  "reward.timeout_s"),
])
def test_bad_functions_fail_with_one_line(name, kw, head):
    form = "batch sync" if name.startswith("batch") else "per-sample sync"
    assert failure(name, **kw) == f"reward.function {HERE}:{name} {head} {SUFFIX.format(form=form)}"


# ---- through launch.main, as a user meets it ----------------------------------------------------------------------
BASE = "engines: [{kind: hf}]\ntrainer: {num_ranks: 1}\n"


def run(capsys, tmp_path, *overrides):
    import ray
    p = tmp_path / "c.yaml"
    p.write_text(BASE)
    rc = launch.main(["--config", str(p), f"experiment.output_dir={tmp_path}", *overrides])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert not ray.is_initialized(), "no actor may start on bad input"
    return rc, err


@pytest.mark.parametrize("name, extra, what", [
    ("returns_none", [], "returned None for prompt "),
    ("raises_on_empty", [], "raised ValueError: empty response see the log on response '' for prompt "),
    ("hangs", ["reward.timeout_s=0.5"], "did not return within reward.timeout_s=0.5 s on response '' for prompt "),
])
def test_launch_with_a_bad_reward_function_prints_one_error_line(capsys, tmp_path, name, extra, what):
    rc, err = run(capsys, tmp_path, f"reward.function={HERE}:{name}", *extra)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: reward.function {HERE}:{name} {what}"), err[0]
    assert err[0].endswith(SUFFIX.format(form="per-sample sync"))
