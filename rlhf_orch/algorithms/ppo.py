"""PPO with a learned critic: GAE advantages per token, whitened over the step's batch; value clipping.

Token rewards: each sample's outcome reward sits on its last response token (0 elsewhere); a dense reward
function (rlhf_orch.rewards.dense) gives every response token its own value instead. The critic's
value V_t at response position t is its estimate before token t is generated (from the hidden state of
position t-1, the position that also predicts token t's logprob). GAE (verl's compute_gae_advantage_return):

    delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last response token = 0)
    A_t     = delta_t + gamma * lam * A_{t+1};      returns_t = A_t + V_t

The advantages are then whitened over every response token of the step's batch (mean 0, variance 1, as verl
does); the statistics are summed over the data-parallel ranks by the caller's `allreduce`, so the result does
not depend on how samples were split. The critic regresses `returns` with verl's clipped value loss. It needs
no groups: group_size 1 is fine. KL to the reference, when kl_coef > 0, stays in the policy loss.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from rlhf_orch.algorithms.advantages import gae_advantages, whiten_over_ranks
from rlhf_orch.algorithms.base import Algorithm, register


def token_rewards(rewards: Tensor, response_mask: Tensor) -> Tensor:
    """[B, T]: each row's outcome reward on its last response token (right padding), 0 elsewhere. Rewards that
    are already per token ([B, T], e.g. with a KL penalty) are returned as they are."""
    if rewards.dim() == 2:
        return rewards.float().to(response_mask.device)
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    pos = torch.arange(response_mask.shape[1], device=response_mask.device)
    last = torch.where(response_mask > 0, pos, -1).max(dim=1).values      # -1: no response token
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards.float().to(out.device)[rows]
    return out


@register("ppo")
class PPO(Algorithm):
    group_based = False
    needs_critic = True
    token_level = True

    def __init__(self, settings):
        super().__init__(settings)
        self.gamma = float(self.s.get("gamma", 1.0))
        self.lam = float(self.s.get("lam", 1.0))

    def outcome_advantages(self, rewards: Tensor, group_ids: Tensor, response_lengths: Tensor | None = None) -> Tensor:
        # Per-token advantages need the critic's values: `token_advantages` on the trainer ranks fills them.
        return self.zeros(rewards)

    def token_advantages(self, rewards: Tensor, values: Tensor, mask: Tensor,
                         allreduce: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor, dict[str, float]]:
        """(whitened advantages [B, T], returns [B, T], metrics) of one rank's shard; `allreduce` sums a small
        tensor over the ranks (identity with one rank)."""
        adv, returns = gae_advantages(token_rewards(rewards, mask), values, mask, self.gamma, self.lam)
        adv, mean, var = whiten_over_ranks(adv, mask, allreduce)
        return adv, returns, {"ppo/adv_raw_mean": float(mean), "ppo/adv_raw_std": float(var) ** 0.5}
