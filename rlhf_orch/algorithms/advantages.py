"""Outcome-reward advantage estimators for group-sampled RL (GRPO, RLOO, REINFORCE++).

Each estimator maps one scalar reward per sample to one advantage per sample, using the samples
generated from the same prompt (same group id) as the baseline. All share the signature

    fn(rewards: Tensor[N] float, group_ids: Tensor[N] long, eps: float = 1e-6, **opts) -> Tensor[N]

Groups may differ in size and group ids need not be contiguous or sorted. Everything is vectorised
over groups (scatter / index_add after `torch.unique(return_inverse=True)`), with no Python loop
over samples.

Conventions shared by all estimators: a group of one sample, or a group whose rewards are all
equal, carries no learning signal and gets advantage exactly 0 (also when eps=0).

This module does not broadcast advantages over tokens, mask anything or compute losses: see
`losses.py`. It holds no state beyond the `ADVANTAGE_ESTIMATORS` registry.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from rlhf_orch.errors import ConfigError

AdvantageFn = Callable[..., Tensor]


class _Groups:
    """Per-group statistics of `rewards`, computed once and shared by the estimators.

    Statistics are computed in float64: rewards are few (one per sample), and the extra precision
    keeps centred values of equal rewards from drifting off zero.
    """

    def __init__(self, rewards: Tensor, group_ids: Tensor):
        if rewards.dim() != 1 or group_ids.shape != rewards.shape:
            raise ValueError(
                f"rewards and group_ids must both be 1-D of the same length, got "
                f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}")
        r = rewards.detach().to(torch.float64)
        uniq, inv = torch.unique(group_ids, return_inverse=True)
        g = uniq.numel()

        def per_group(values: Tensor) -> Tensor:
            return torch.zeros(g, dtype=r.dtype, device=r.device).index_add_(0, inv, values)

        count = per_group(torch.ones_like(r))
        total = per_group(r)
        mean = total / count.clamp(min=1)
        self.n = count[inv]                      # [N] size of each sample's group
        self.centred = r - mean[inv]             # [N] r - group mean
        sq = per_group(self.centred ** 2)
        # Unbiased (correction=1) variance, as torch.std; undefined for n=1, which we treat as 0.
        var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.zeros_like(sq))
        self.std = var.sqrt()[inv]               # [N] group std of each sample's group
        gmax = torch.full((g,), float("-inf"), dtype=r.dtype, device=r.device)
        gmin = torch.full((g,), float("inf"), dtype=r.dtype, device=r.device)
        gmax = gmax.scatter_reduce(0, inv, r, reduce="amax")
        gmin = gmin.scatter_reduce(0, inv, r, reduce="amin")
        # Exact test for "no signal": rounding in the mean can leave 1e-17 residues that eps=0
        # (or a tiny std) would blow up to +-1, so such groups are zeroed explicitly.
        self.informative = ((gmax > gmin) & (count > 1))[inv]   # [N] bool

    def finish(self, adv: Tensor, like: Tensor) -> Tensor:
        adv = torch.where(self.informative, adv, torch.zeros_like(adv))
        out_dtype = like.dtype if like.is_floating_point() else torch.float32
        return adv.to(out_dtype)


def grpo_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6, *,
                    norm_by_std: bool = True) -> Tensor:
    """GRPO: (r - group_mean) / (group_std + eps), group_std unbiased (correction=1).

    Shapes: rewards [N] float, group_ids [N] long -> advantages [N] float (rewards' dtype).
    `norm_by_std=False` only centres (Dr. GRPO), removing the per-prompt difficulty reweighting.
    Groups of one and groups of equal rewards get 0.
    """
    st = _Groups(rewards, group_ids)
    adv = st.centred / (st.std + eps) if norm_by_std else st.centred
    return st.finish(adv, rewards)


def rloo_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """RLOO: r_i - mean_{j != i, same group} r_j, which equals n / (n - 1) * (r_i - group_mean).

    Shapes: rewards [N] float, group_ids [N] long -> advantages [N] float (rewards' dtype).
    `eps` is unused (no division by a statistic of the data) and kept for the common signature.
    Groups of one (no other sample to form a baseline) get 0.
    """
    del eps
    st = _Groups(rewards, group_ids)
    adv = st.n / (st.n - 1).clamp(min=1) * st.centred
    return st.finish(adv, rewards)


def reinforce_pp_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ with baseline (verl's reinforce_plus_plus_baseline).

    Centre within the group (r - group_mean), then whiten over the whole batch: divide by the
    unbiased batch std of the centred values, plus eps. The batch mean of the centred values is 0
    by construction, so it is not subtracted again. A zero (or undefined, N < 2) batch std gives
    all zeros. Unlike verl, a group of one is centred to 0 rather than kept as its raw reward,
    consistent with the other estimators here.

    Shapes: rewards [N] float, group_ids [N] long -> advantages [N] float (rewards' dtype).
    """
    st = _Groups(rewards, group_ids)
    c = torch.where(st.informative, st.centred, torch.zeros_like(st.centred))
    if c.numel() < 2:
        return st.finish(torch.zeros_like(c), rewards)
    std = c.std()
    if not bool(std > 0):
        return st.finish(torch.zeros_like(c), rewards)
    return st.finish(c / (std + eps), rewards)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}


def get_advantage_fn(name: str) -> AdvantageFn:
    """The estimator registered as `name`; ConfigError naming `algorithm.name` if there is none."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        valid = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ConfigError(
            f"algorithm.name: unknown advantage estimator {name!r}; use one of: {valid}") from None


def compute_advantages(name: str, rewards: Tensor, group_ids: Tensor, **kwargs) -> Tensor:
    """Look up estimator `name` and apply it: rewards [N], group_ids [N] -> advantages [N].

    `kwargs` go to the estimator (e.g. `eps`, or `norm_by_std` for "grpo").
    """
    return get_advantage_fn(name)(rewards, group_ids, **kwargs)
