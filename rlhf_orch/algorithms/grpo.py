"""GRPO (and Dr. GRPO): group-relative advantages from outcome rewards, no critic.

advantage = (r - group mean) / (group std + eps) (unbiased std); `norm_adv_by_std: false` only centres
(Dr. GRPO). Groups of one and groups of equal rewards get 0 (advantages.grpo_advantages).
"""
from __future__ import annotations

from torch import Tensor

from rlhf_orch.algorithms.advantages import grpo_advantages
from rlhf_orch.algorithms.base import Algorithm, register


@register("grpo")
class GRPO(Algorithm):
    def outcome_advantages(self, rewards: Tensor, group_ids: Tensor, response_lengths: Tensor | None = None) -> Tensor:
        return grpo_advantages(rewards, group_ids, norm_by_std=self.s.get("norm_adv_by_std", True))
