"""REINFORCE++ (verl's reinforce_plus_plus): discounted returns of the outcome reward, whitened over every
response token of the step; no critic, no groups.

    returns_t = sum_{k >= t} gamma^(k - t) r_k      (r: the outcome reward on the last response token)
    A_t       = (returns_t - mean) / sqrt(var + 1e-8) over the batch's response tokens (all ranks)

(advantages.reinforce_pp_returns). The group-baseline variants are `reinforce_pp_baseline` (verl's, token
whitening) and `reinforce_pp` (sample whitening).
"""
from __future__ import annotations

from torch import Tensor

from rlhf_orch.algorithms.advantages import discounted_returns, whiten_over_ranks
from rlhf_orch.algorithms.base import Algorithm, register
from rlhf_orch.algorithms.losses import masked_extrema
from rlhf_orch.algorithms.ppo import token_rewards


@register("reinforce_pp_gamma")
class ReinforcePP(Algorithm):
    group_based = False
    token_level = True

    def outcome_advantages(self, rewards: Tensor, group_ids: Tensor, response_lengths: Tensor | None = None) -> Tensor:
        return self.zeros(rewards)   # per token, on the trainer ranks

    def token_advantages(self, rewards, values, mask, allreduce):
        # advantages.reinforce_pp_returns on one batch; here the whitening statistics are the whole step's.
        returns = discounted_returns(token_rewards(rewards, mask), mask, float(self.s.get("gamma", 1.0)))
        adv, mean, _ = whiten_over_ranks(returns, mask, allreduce)
        # Max and min over every rank's response tokens when the caller's reducer has a max (the trainer's does:
        # token_step._RankReduce); a plain summing function gives this shard's.
        hi, lo = masked_extrema(returns, mask, getattr(allreduce, "max", None))
        return adv, returns, {"reinforce_pp/returns_mean": float(mean), "reinforce_pp/returns_max": hi,
                              "reinforce_pp/returns_min": lo}
