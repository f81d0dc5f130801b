"""One train step of a token-level algorithm on one data-parallel rank: the critic's values (if it has a
critic), the algorithm's per-token advantages and returns (whitened over all ranks), the policy's update
(unless the critic is still warming up), then the critic's update (PPO; REINFORCE++ with gamma has no critic).

A function over a policy trainer and a critic living in the same process; the all-reduce is over their
shared process group. No Ray: actors/trainer.py calls it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf_orch.types import TrainBatch


def _allreduce(device: torch.device):
    def fn(t: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = t.to(device)
            dist.all_reduce(t)
        return t.cpu()
    return fn


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, allreduce) -> float:
    """1 - Var(returns - values) / Var(returns) over the response tokens of every rank (verl's vf_explained_var)."""
    m = mask.double()
    r, d = returns.double() * m, (returns - values).double() * m
    s = allreduce(torch.stack([m.sum(), r.sum(), (r * r).sum(), d.sum(), (d * d).sum()]))
    n, rs, rsq, ds, dsq = (float(x) for x in s)
    if n < 2:
        return 0.0
    var_r = rsq / n - (rs / n) ** 2
    var_d = dsq / n - (ds / n) ** 2
    return 1.0 - var_d / var_r if var_r > 0 else 0.0


def token_level_step(trainer, critic, warmup_steps: int, batch: TrainBatch, num_tokens_global: float) -> dict[str, float]:
    allreduce = _allreduce(trainer.device)
    mask = batch.response_mask.to(trainer.device)
    values = critic.values(batch) if critic is not None else None
    adv, returns, m = trainer.algo.token_advantages(batch.rewards, values, mask, allreduce)
    batch.advantages = adv.cpu()
    if critic is None:
        m.update(trainer.train_step(batch, num_tokens_global))
        return m
    m["critic/explained_var"] = explained_variance(values, returns, mask, allreduce)
    m["critic/values_mean"] = float((values * mask).sum() / mask.sum().clamp(min=1))
    m["critic/returns_mean"] = float((returns * mask).sum() / mask.sum().clamp(min=1))
    if critic.steps >= warmup_steps:
        m.update(trainer.train_step(batch, num_tokens_global))
    else:
        # The policy waits for the critic (verl's critic_warmup); the engine/trainer logprob check still runs.
        lp = trainer.logprobs(batch)
        diff = (lp - batch.engine_logprobs).abs() * batch.response_mask
        m.update({"train/logprob_diff_sum": float(diff.sum()), "train/logprob_diff_max": float(diff.max()),
                  "train/tokens": float(batch.response_mask.sum()), "train/policy_frozen": 1.0})
    m.update(critic.train_step(batch, returns, values, num_tokens_global))
    return m
