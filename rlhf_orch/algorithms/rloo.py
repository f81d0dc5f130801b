"""RLOO: each sample's baseline is the mean reward of the other samples of its prompt; no critic.

advantage = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - group mean) (advantages.rloo_advantages).
"""
from __future__ import annotations

from torch import Tensor

from rlhf_orch.algorithms.advantages import rloo_advantages
from rlhf_orch.algorithms.base import Algorithm, register


@register("rloo")
class RLOO(Algorithm):
    def outcome_advantages(self, rewards: Tensor, group_ids: Tensor, response_lengths: Tensor | None = None) -> Tensor:
        return rloo_advantages(rewards, group_ids)
