"""Reward actors: score decoded responses with the user's rule-based function, off the driver.

The function is imported (and its signature checked) at config time by the driver; the actor imports
it again in its own process. A function that raises or returns a non-finite or non-number value
fails the step with a RewardError naming the function and the offending row.
"""
from __future__ import annotations

import math

import ray

from actors.common import setup_process
from rlhf_orch.config import load_reward_fn
from rlhf_orch.errors import RewardError


@ray.remote(num_cpus=0)
class RewardActor:
    def __init__(self, function: str):
        setup_process("cpu")
        self.path = function
        self.fn = load_reward_fn(function)

    def health(self) -> dict:
        """A cheap liveness probe: this worker's process id."""
        import os
        return {"pid": os.getpid()}

    def score(self, items: list[tuple[str, dict]]) -> list[float]:
        out = []
        for response, row in items:
            try:
                value = self.fn(response, row)
            except Exception as e:
                raise RewardError(f"reward.function {self.path} raised {type(e).__name__}: {e} "
                                  f"on response {response!r} for prompt {row.get('prompt')!r}") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardError(f"reward.function {self.path} returned {value!r} for prompt {row.get('prompt')!r}; "
                                  "it must return a finite float")
            out.append(float(value))
        return out
