"""One train step of a token-level algorithm on one data-parallel rank: the critic's values (if it has a
critic), the algorithm's per-token advantages and returns (whitened over all ranks), the policy's update
(unless the critic is still warming up), then the critic's update (PPO; REINFORCE++ with gamma has no critic).

`token_level_step` runs it all with the critic in the policy rank's process (critic.placement: colocated). With a
critic group of its own the actor shell calls the parts: `advantages` on values the group computed, then
`policy_update` while the group trains on the returns. The all-reduce is over the policy ranks' process group.
No Ray: actors/trainer.py calls it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf_orch.algorithms.losses import explained_variance, kl_divergence, masked_extrema
from rlhf_orch.algorithms.ppo import token_rewards
from rlhf_orch.types import TrainBatch


class _RankReduce:
    """Reduces a small tensor over the data-parallel ranks: calling it sums (whitening and explained-variance
    statistics), `.max` takes the elementwise max (the max/min metrics: losses.masked_extrema). Identity with one
    rank."""

    def __init__(self, device: torch.device):
        self.device = device

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = t.to(self.device)
            dist.all_reduce(t, op=op)
        return t.cpu()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.SUM)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.MAX)


def _allreduce(device: torch.device) -> _RankReduce:
    return _RankReduce(device)


def _kl_penalised(trainer, batch: TrainBatch, allreduce) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's apply_kl_penalty: token rewards minus beta x KL(policy || reference) on every response token, as a
    [B, T] tensor the algorithm takes in place of the outcome rewards; then the controller sees the step's KL."""
    algo, ctrl = trainer.algo, trainer.algo.kl_ctrl
    ref = trainer.reference_logprobs(batch)
    old = trainer.logprobs(batch)
    batch.old_logprobs = old                 # the update clips against these (saves a forward there)
    mask = batch.response_mask
    kl = kl_divergence(old, ref, algo.kl_estimator) * mask
    beta = ctrl.value
    rewards = token_rewards(batch.rewards, mask) - beta * kl
    n_tok = mask.sum(1)
    has = n_tok > 0
    seq_mean = torch.where(has, kl.sum(1) / n_tok.clamp(min=1), torch.zeros_like(n_tok))
    s = allreduce(torch.stack([seq_mean.sum().double(), has.sum().double()]))
    current = float(s[0] / s[1].clamp(min=1))   # verl: the batch mean of each sequence's token-mean KL
    ctrl.update(current, int(s[1]))
    return rewards, {"kl_ctrl/beta": beta, "kl_ctrl/kl": current}


def advantages(trainer, batch: TrainBatch, values: torch.Tensor | None) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The algorithm's per-token advantages (set on `batch`) and returns from the batch's rewards (KL-penalised
    when the algorithm keeps KL in the reward) and the critic's `values` (None: no critic); with a critic, verl's
    value statistics. Every policy rank calls it together (whitening is over all of them)."""
    allreduce = _allreduce(trainer.device)
    mask = batch.response_mask.to(trainer.device)
    if values is not None:
        values = values.to(trainer.device)   # a critic group's values come over Ray, on the CPU
    rewards, m = batch.rewards, {}
    if trainer.algo.kl_in_reward:
        rewards, m = _kl_penalised(trainer, batch, allreduce)
    adv, returns, am = trainer.algo.token_advantages(rewards, values, mask, allreduce)
    m.update(am)
    batch.advantages = adv.cpu()
    if values is None:
        return returns, m
    m["critic/explained_var"] = explained_variance(values, returns, mask, allreduce)
    m["critic/vf_explained_var"] = m["critic/explained_var"]          # verl's name for it
    m["critic/values_mean"] = float((values * mask).sum() / mask.sum().clamp(min=1))
    m["critic/returns_mean"] = float((returns * mask).sum() / mask.sum().clamp(min=1))
    # verl's values/returns max and min, over every rank's response tokens (every rank reports the same numbers).
    m["critic/values_max"], m["critic/values_min"] = masked_extrema(values, mask, allreduce.max)
    m["critic/returns_max"], m["critic/returns_min"] = masked_extrema(returns, mask, allreduce.max)
    return returns, m


def policy_update(trainer, batch: TrainBatch, num_tokens_global: float, frozen: bool) -> dict[str, float]:
    """The policy's step on the advantages `advantages` set; `frozen` (the critic still warming up, verl's
    critic_warmup): no step, only the engine/trainer logprob check."""
    if not frozen:
        return trainer.train_step(batch, num_tokens_global)
    lp = trainer.logprobs(batch)
    diff = (lp - batch.engine_logprobs).abs() * batch.response_mask
    return {"train/logprob_diff_sum": float(diff.sum()), "train/logprob_diff_max": float(diff.max()),
            "train/tokens": float(batch.response_mask.sum()), "train/policy_frozen": 1.0}


def token_level_step(trainer, critic, warmup_steps: int, batch: TrainBatch, num_tokens_global: float) -> dict[str, float]:
    """The whole step with the critic (if any) in this process: values, advantages, policy, critic."""
    values = critic.values(batch) if critic is not None else None
    returns, m = advantages(trainer, batch, values)
    m.update(policy_update(trainer, batch, num_tokens_global, critic is not None and critic.steps < warmup_steps))
    if critic is not None:
        m.update(critic.train_step(batch, returns, values, num_tokens_global))
    return m
