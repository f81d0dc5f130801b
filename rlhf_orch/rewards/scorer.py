"""Combine the reward sources of one reward worker: reward = function_weight * fn + model_weight * rm.

`fn` is the rule-based `reward.function` (per sample or batched, sync or async, bounded by `reward.timeout_s`:
calls.py), `rm` the learned reward model's score (model.py, batched). Either may be absent: without a model the
reward is function_weight * fn, which with the default weight 1.0 is exactly fn (bit for bit, as before reward
models existed); without a function
(`reward.function: null`) it is model_weight * rm. `score_parts` also returns each source's values, for
per-source metrics.

A dense function (one value per response token, calls.py) adds "token_rewards": per sample, function_weight times
each token's value, with the model's weighted score added on the last token. "rewards" stays one number per sample,
function_weight * sum(token values) + model_weight * rm: what outcome algorithms, metrics and evaluation use.

A function that raises, returns a non-finite or non-number value, or runs past reward.timeout_s fails the step
with a RewardError naming the function and the offending row. No Ray here: actors/reward.py is the shell that
hosts a RewardScorer.
"""
from __future__ import annotations

from rlhf_orch.errors import RewardError
from rlhf_orch.rewards import NO_FUNCTION, load_reward_fn
from rlhf_orch.rewards.calls import RewardFunction


class RewardScorer:
    def __init__(self, function: str | None, model=None, function_weight: float = 1.0, model_weight: float = 1.0,
                 batch: bool = False, timeout_s: float | None = None, dense: bool = False):
        self.path = function if function and function != NO_FUNCTION else None
        self.fn = load_reward_fn(self.path) if self.path else None
        self.call = RewardFunction(self.fn, self.path, batch, timeout_s, dense) if self.fn is not None else None
        self.dense = self.call is not None and self.call.dense
        self.model = model      # a rewards.model.RewardModel, or None
        self.function_weight, self.model_weight = float(function_weight), float(model_weight)
        if self.fn is None and self.model is None:
            raise RewardError("no reward source: reward.function is null and reward.model_path is not set")

    def score(self, items: list[tuple[str, dict]]) -> list[float]:
        """One reward per (response, dataset row)."""
        return self.score_parts(items)["rewards"]

    def score_parts(self, items: list[tuple[str, dict]]) -> dict[str, list]:
        """{"rewards": [...], "function": [...] if a function is set, "model": [...] if a model is set,
        "token_rewards": [[...], ...] if the function is dense}."""
        parts: dict[str, list] = {}
        per_token = None
        if self.fn is not None:
            values = self.call(items)
            if self.dense:
                per_token, values = values, [sum(v) for v in values]
            parts["function"] = values
        if self.model is not None:
            parts["model"] = self.model.score([str(row.get("prompt", "")) for _, row in items],
                                              [response for response, _ in items])
        if self.model is None:
            rewards = [self.function_weight * f for f in parts["function"]]
        elif self.fn is None:
            rewards = [self.model_weight * m for m in parts["model"]]
        else:
            rewards = [self.function_weight * f + self.model_weight * m for f, m in zip(parts["function"], parts["model"])]
        if per_token is not None:
            parts["token_rewards"] = [self._token_rewards(v, parts["model"][i] if "model" in parts else None)
                                      for i, v in enumerate(per_token)]
        return {"rewards": rewards, **parts}

    def _token_rewards(self, values: list[float], model_score: float | None) -> list[float]:
        out = [self.function_weight * v for v in values]
        if model_score is not None and out:    # the model scores the whole response: its last token
            out[-1] += self.model_weight * model_score
        return out
