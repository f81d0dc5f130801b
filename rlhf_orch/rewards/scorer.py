"""Combine the reward sources of one reward worker: reward = function_weight * fn + model_weight * rm.

`fn` is the rule-based `reward.function` (per sample or batched, sync or async, bounded by `reward.timeout_s`:
calls.py), `rm` the learned reward model's score (model.py, batched). Either may be absent: without a model the
reward is function_weight * fn, which with the default weight 1.0 is exactly fn (bit for bit, as before reward
models existed); without a function
(`reward.function: null`) it is model_weight * rm. `score_parts` also returns each source's values, for
per-source metrics.

A function that raises, returns a non-finite or non-number value, or runs past reward.timeout_s fails the step
with a RewardError naming the function and the offending row. No Ray here: actors/reward.py is the shell that
hosts a RewardScorer.
"""
from __future__ import annotations

from rlhf_orch.errors import RewardError
from rlhf_orch.rewards import NO_FUNCTION
from rlhf_orch.rewards.calls import RewardFunction


class RewardScorer:
    def __init__(self, function: str | None, model=None, function_weight: float = 1.0, model_weight: float = 1.0,
                 batch: bool = False, timeout_s: float | None = None):
        from rlhf_orch.config import load_reward_fn

        self.path = function if function and function != NO_FUNCTION else None
        self.fn = load_reward_fn(self.path) if self.path else None
        self.call = RewardFunction(self.fn, self.path, batch, timeout_s) if self.fn is not None else None
        self.model = model      # a rewards.model.RewardModel, or None
        self.function_weight, self.model_weight = float(function_weight), float(model_weight)
        if self.fn is None and self.model is None:
            raise RewardError("no reward source: reward.function is null and reward.model_path is not set")

    def score(self, items: list[tuple[str, dict]]) -> list[float]:
        """One reward per (response, dataset row)."""
        return self.score_parts(items)["rewards"]

    def score_parts(self, items: list[tuple[str, dict]]) -> dict[str, list[float]]:
        """{"rewards": [...], "function": [...] if a function is set, "model": [...] if a model is set}."""
        parts: dict[str, list[float]] = {}
        if self.fn is not None:
            parts["function"] = self.call(items)
        if self.model is not None:
            parts["model"] = self.model.score([str(row.get("prompt", "")) for _, row in items],
                                              [response for response, _ in items])
        if self.model is None:
            rewards = [self.function_weight * f for f in parts["function"]]
        elif self.fn is None:
            rewards = [self.model_weight * m for m in parts["model"]]
        else:
            rewards = [self.function_weight * f + self.model_weight * m for f, m in zip(parts["function"], parts["model"])]
        return {"rewards": rewards, **parts}
