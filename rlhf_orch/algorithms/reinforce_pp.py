"""REINFORCE++-baseline, per sample: centre within the prompt's group, then whiten over the batch's SAMPLES; no critic.

(advantages.reinforce_pp_advantages.) verl's reinforce_plus_plus_baseline whitens over TOKENS (long responses weigh
more, the token mean is subtracted): that one is `algorithm.name: reinforce_pp_baseline` (reinforce_pp_baseline.py).
This variant is kept unchanged so that existing runs stay exact.
"""
from __future__ import annotations

from torch import Tensor

from rlhf_orch.algorithms.advantages import reinforce_pp_advantages
from rlhf_orch.algorithms.base import Algorithm, register


@register("reinforce_pp")
class ReinforcePPBaseline(Algorithm):
    def outcome_advantages(self, rewards: Tensor, group_ids: Tensor, response_lengths: Tensor | None = None) -> Tensor:
        return reinforce_pp_advantages(rewards, group_ids)
