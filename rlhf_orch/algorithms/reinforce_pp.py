"""REINFORCE++-baseline: centre within the prompt's group, then whiten over the batch; no critic.

(advantages.reinforce_pp_advantages; see docs/algorithms.md for how this differs from verl's token whitening.)
"""
from __future__ import annotations

from torch import Tensor

from rlhf_orch.algorithms.advantages import reinforce_pp_advantages
from rlhf_orch.algorithms.base import Algorithm, register


@register("reinforce_pp")
class ReinforcePPBaseline(Algorithm):
    def outcome_advantages(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        return reinforce_pp_advantages(rewards, group_ids)
