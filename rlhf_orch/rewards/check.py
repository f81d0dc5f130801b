"""Call the reward function once before launch, so a function that cannot score fails in seconds, not at step 1.

`check_reward_function(reward, rows)` calls `reward.function` (through calls.py, so in its configured form: per
sample or batched, sync or async, bounded by `reward.timeout_s`) on the first two dataset rows with two
placeholder responses: "" (an engine may stop at once) and a short sentence. Every value must be a finite float
(a batch function: a list of two); a dense function's rows carry the placeholders' token ids (`tokenize`) and it
must return one finite float per token. An exception, None, a string, nan, a list of the wrong length or a timeout
raises a one-line RewardError naming the function, the prompt and what it returned; launch.main() prints it as
one `error:` line, before Ray starts.

It checks the function's contract, not its scores: any finite value passes. With `reward.function: null` (a
reward model alone) it does nothing. The rows are deep copies, so a function that edits its row cannot change the
dataset, and Python's and numpy's global RNG states are restored afterwards, so the run draws what it would have.
The calls happen in the driver process: a function with side effects (a file it appends to, a counter) sees two
calls there before the reward workers' own. No Ray here.
"""
from __future__ import annotations

import copy
import random

from rlhf_orch.errors import RewardError
from rlhf_orch.rewards import AGENT_REWARD, NO_FUNCTION, load_reward_fn, with_response_ids
from rlhf_orch.rewards.calls import RewardFunction

DUMMY_RESPONSES = ("", "The answer is 42.")


def check_reward_function(reward, rows: list[dict], tokenize=None) -> None:
    """Raise RewardError (one line) unless `reward.function` gives finite floats on two of `rows`.

    `reward` is the config's reward section (anything with .function, .batch, .timeout_s and .dense); `tokenize`
    (str -> token ids; the model's tokenizer) gives a dense function its placeholder responses' ids."""
    path = reward.function
    if not path or path == NO_FUNCTION or not rows:
        return
    dense = bool(getattr(reward, "dense", False))
    call = RewardFunction(load_reward_fn(path), path, reward.batch, reward.timeout_s, dense)
    picked = [rows[i % len(rows)] for i in range(len(DUMMY_RESPONSES))]   # one row twice if there is only one
    items = [(response, copy.deepcopy(row)) for response, row in zip(DUMMY_RESPONSES, picked)]
    if path == AGENT_REWARD:   # what the rollout manager adds to the row of a sample whose agent returned a reward
        items = [(response, {**row, "agent_reward": 0.0}) for response, row in items]
    if call.dense:
        tokenize = tokenize or (lambda text: list(range(len(text.split()))))   # one id per word, without a tokenizer
        items = [(response, with_response_ids(row, tokenize(response))) for response, row in items]
    state = _rng_state()
    try:
        call(items)
    except RewardError as e:
        text = " ".join(str(e).split())   # one line: an exception's message may span several
        raise RewardError(f"{text} (found before launch: the {call.form} function was called on the first 2 "
                          f"dataset rows with the placeholder responses {DUMMY_RESPONSES[0]!r} and "
                          f"{DUMMY_RESPONSES[1]!r})") from None
    finally:
        call.close()
        _restore_rng(state)


def _rng_state():
    import numpy as np
    return random.getstate(), np.random.get_state()


def _restore_rng(state) -> None:
    import numpy as np
    random.setstate(state[0])
    np.random.set_state(state[1])
