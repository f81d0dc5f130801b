"""Reward sources. Rule-based functions live in builtin.py; users point `reward.function` at their own
`package.module:function` with the signature fn(response: str, row: dict) -> float. A learned reward model
(`reward.model_path`, an AutoModelForSequenceClassification with one label) is scored by model.py; scorer.py
combines the two as function_weight * fn + model_weight * rm.

A function may also score a whole chunk of samples at once, fn(responses: list[str], rows: list[dict]) ->
list[float]: mark it with the `batched` decorator below (or set `reward.batch: true` for a function you cannot
edit). Either form may be `async def` (per-sample coroutines of a chunk run concurrently). calls.py runs all four
forms, bounded by `reward.timeout_s`; check.py calls the function on two dataset rows before launch. math.py has
GSM8K and MATH answer rewards (math-verify, the `math` extra).

A dense function (the `dense` decorator, or `reward.dense: true`) returns one value per response token instead of
one per response: its row carries the response's token ids as row["response_ids"], and it returns a list of that
length. Token-level algorithms (ppo, reinforce_pp_gamma) use each token's value; outcome algorithms (grpo, rloo,
reinforce_pp) use their sum, as verl's outcome estimators sum its token-level rewards.

Importing this package imports neither torch nor transformers (the config loader imports it)."""
import importlib
import inspect

from rlhf_orch.errors import RewardError

# `reward.function: null` (or "") is stored as this path, so the config always names an importable function;
# the scorer recognises it and calls nothing (the reward is then the model's alone).
NO_FUNCTION = "rlhf_orch.rewards:no_function"
AGENT_REWARD = "rlhf_orch.rewards.builtin:agent_reward"   # the reward an agent function returned (rollout.agent)


def no_function(response: str, row: dict) -> float:
    """Placeholder for `reward.function: null`: never called by the scorer."""
    return 0.0


# The attribute `batched` sets; RewardFunction (calls.py) reads it.
BATCHED_ATTR = "rlhf_orch_batched"


def batched(fn):
    """Declare `fn` a batch reward: fn(responses: list[str], rows: list[dict]) -> list[float], one finite float per
    response, in order (sync or async def). Returns fn itself with an attribute set, so it stays callable as is."""
    setattr(fn, BATCHED_ATTR, True)
    return fn


def is_batched(fn) -> bool:
    return bool(getattr(fn, BATCHED_ATTR, False))


# The attribute `dense` sets; the config loader reads it (reward.dense), so the rollout manager adds token ids.
DENSE_ATTR = "rlhf_orch_dense"


def dense(fn):
    """Declare `fn` a dense reward: one finite float per response token, in order. Its row carries the response's
    token ids as row["response_ids"]; it returns a list of len(row["response_ids"]) floats (a batch function: one
    such list per response). Returns fn itself with an attribute set. Combines with `batched`."""
    setattr(fn, DENSE_ATTR, True)
    return fn


def is_dense(fn) -> bool:
    return bool(getattr(fn, DENSE_ATTR, False))


def with_response_ids(row: dict, response_ids) -> dict:
    """The row a dense function sees: a shallow copy with the response's token ids (the dataset's row is untouched)."""
    return {**row, "response_ids": list(response_ids)}


def load_reward_fn(path: str):
    """Import `package.module:function` and check it can be called as fn(response, row)."""
    mod_name, sep, fn_name = path.partition(":")
    if not sep or not mod_name or not fn_name:
        raise RewardError(f"{path!r} is not of the form 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # any import-time failure of user code is a config problem
        raise RewardError(f"cannot import module {mod_name!r} ({type(e).__name__}: {e}); check the path and that it is on PYTHONPATH") from None
    fn = getattr(mod, fn_name, None)
    if fn is None or not callable(fn):
        raise RewardError(f"module {mod_name!r} has no function {fn_name!r}")
    try:
        inspect.signature(fn).bind("response", {"prompt": "p"})
    except TypeError:
        raise RewardError(f"{path} must accept (response: str, row: dict) and return a float") from None
    except ValueError:
        pass  # builtins without a signature: trust them
    return fn


__all__ = ["AGENT_REWARD", "BATCHED_ATTR", "DENSE_ATTR", "NO_FUNCTION", "batched", "dense", "is_batched", "is_dense",
           "load_reward_fn", "no_function", "with_response_ids"]
