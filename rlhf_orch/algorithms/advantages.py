"""Advantage estimators: outcome-reward ones for group-sampled RL (GRPO, RLOO, REINFORCE++), and
token-level ones with verl's semantics (GAE, REINFORCE++ with gamma, token-whitened
REINFORCE++-baseline) plus the masked whitening they share.

Each estimator maps one scalar reward per sample to one advantage per sample, using the samples
generated from the same prompt (same group id) as the baseline. All share the signature

    fn(rewards: Tensor[N] float, group_ids: Tensor[N] long, eps: float = 1e-6, **opts) -> Tensor[N]

Groups may differ in size and group ids need not be contiguous or sorted. Everything is vectorised
over groups (scatter / index_add after `torch.unique(return_inverse=True)`), with no Python loop
over samples.

Conventions shared by all estimators: a group of one sample, or a group whose rewards are all
equal, carries no learning signal and gets advantage exactly 0 (also when eps=0).

`reinforce_pp_baseline_advantages` (at the end) is verl's token-whitened REINFORCE++-baseline as one
value per sample: it also takes each sample's response length, since the whitening counts tokens.

The registry estimators above do not broadcast advantages over tokens, mask anything or compute
losses (see `losses.py`). The token-level functions (`gae_advantages`, `reinforce_pp_returns`,
`reinforce_pp_baseline_token_advantages`, `masked_whiten` and its helpers) take [B, T] tensors and a
[B, T] mask as verl's core_algos does, are not in the registry (they need more than rewards and
group ids), and take whitening statistics from the caller so that a batch split over ranks can
whiten with all-reduced ones: see `whiten_stats`. docs/algorithms.md has every formula and each
difference from verl. The module holds no state beyond the `ADVANTAGE_ESTIMATORS` registry.
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

    This whitens over SAMPLES (one value per sequence). verl's
    compute_reinforce_plus_plus_baseline_outcome_advantage whitens over TOKENS (each sequence's
    value counted once per response token, so long responses weigh more): that one is
    `reinforce_pp_baseline_token_advantages`. This function is kept unchanged so that existing
    runs stay exact.

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


# ----------------------------------------------------------------------------- token-level (verl)
#
# Shapes: [B, T] tensors, one row per sequence; `mask` [B, T] marks the tokens that are actions
# (the response; 0 on prompt, padding and, in multi-turn data, observation tokens). Our batches span
# prompt + response, so masks have leading zeros as well as trailing ones; verl's are response-only.
# Every function below zeroes its outputs outside the mask (verl leaves values there that no loss
# reads).

# verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8).
_WHITEN_EPS = 1e-8


def whiten_stats(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(sum, sum of squares, count) of x over the mask, float64 0-dim tensors.

    Shapes: x, mask [B, T] (any equal shapes). The three are sums, so a batch split over ranks
    all-reduces them (SUM) and passes `whiten_mean_var(*stats)` to `masked_whiten`; every rank then
    whitens with the statistics of the whole batch, as verl does on its single driver batch.
    """
    m = mask.detach().to(torch.float64)
    xd = torch.where(m != 0, x.detach().to(torch.float64), torch.zeros_like(m))
    return (xd * m).sum(), (xd * xd * m).sum(), m.sum()


def whiten_mean_var(total: Tensor | float, total_sq: Tensor | float, count: Tensor | float,
                    unbiased: bool = True) -> tuple[Tensor, Tensor]:
    """Mean and variance from `whiten_stats` sums -> (mean, var) float64 0-dim tensors.

    var = (total_sq - total^2 / count) / (count - 1) (unbiased, Bessel-corrected as verl's
    masked_var) or / count (unbiased=False); clamped at 0. count == 0 gives (0, 0); count == 1 gives
    var 0 with unbiased=True, where verl raises ValueError. This one-pass formula in float64 agrees
    with verl's two-pass float32 masked_var to float32 rounding for data of LLM-advantage scale.
    """
    t = torch.as_tensor(total, dtype=torch.float64)
    tsq = torch.as_tensor(total_sq, dtype=torch.float64, device=t.device)
    n = torch.as_tensor(count, dtype=torch.float64, device=t.device)
    safe_n = torch.where(n > 0, n, torch.ones_like(n))
    mean = torch.where(n > 0, t / safe_n, torch.zeros_like(t))
    ss = (tsq - t * mean).clamp(min=0.0)               # sum of squared deviations
    den = n - 1 if unbiased else n
    var = torch.where(den > 0, ss / torch.where(den > 0, den, torch.ones_like(den)),
                      torch.zeros_like(ss))
    return mean, var


def masked_whiten(x: Tensor, mask: Tensor, mean: Tensor | float | None = None,
                  var: Tensor | float | None = None, shift_mean: bool = True) -> Tensor:
    """verl's masked_whiten (verl.utils.torch_functional): (x - mean) * rsqrt(var + 1e-8), plus
    mean back again when shift_mean=False; zeroed outside the mask.

    Shapes: x, mask [B, T] -> [B, T] in x's dtype (float32 for integer x); computed in float64.
    `mean` and `var` are the statistics to whiten with: pass `whiten_mean_var` of all-reduced
    `whiten_stats` when the batch is split over ranks. When either is None both are computed from
    this x over this mask (verl's behaviour: unbiased variance over the mask tokens).
    """
    if mean is None or var is None:
        mean, var = whiten_mean_var(*whiten_stats(x, mask))
    mean = torch.as_tensor(mean, dtype=torch.float64, device=x.device)
    var = torch.as_tensor(var, dtype=torch.float64, device=x.device)
    xd = x.detach().to(torch.float64)
    out = (xd - mean) * torch.rsqrt(var + _WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    out = torch.where(mask != 0, out, torch.zeros_like(out))
    return out.to(x.dtype if x.is_floating_point() else torch.float32)


def whiten_over_ranks(x: Tensor, mask: Tensor, allreduce) -> tuple[Tensor, Tensor, Tensor]:
    """(masked_whiten(x), mean, var) with the statistics of the whole step: this shard's `whiten_stats`
    summed over the data-parallel ranks by `allreduce` (identity with one rank)."""
    mean, var = whiten_mean_var(*allreduce(torch.stack(whiten_stats(x, mask))))
    return masked_whiten(x, mask, mean, var), mean, var


def _check_token_shapes(name: str, mask: Tensor, *tensors: Tensor) -> None:
    if mask.dim() != 2 or any(t.shape != mask.shape for t in tensors):
        raise ValueError(f"{name}: token tensors and mask must all be [B, T] of the same shape, got "
                         f"{[tuple(t.shape) for t in tensors]} and mask {tuple(mask.shape)}")


@torch.no_grad()
def gae_advantages(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
                   lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (verl's compute_gae_advantage_return, after TRL).

    Shapes: token_rewards, values, mask [B, T] -> (advantages [B, T], returns [B, T]) float32,
    both zero outside the mask. values[:, t] is the critic's V(s_t) for the state in which token t
    is generated; token_rewards[:, t] the reward for generating it (typically the outcome reward on
    the last response token, minus any per-token KL penalty). Backwards over t, from
    nextvalue = 0 and lastgae = 0:

        delta_t   = r_t + gamma * nextvalue - V_t
        A_t       = delta_t + gamma * lam * lastgae
        where mask_t = 1: nextvalue <- V_t, lastgae <- A_t;
        where mask_t = 0: both carried unchanged (the token is skipped)
        returns_t = A_t + V_t

    Skipping masked positions (rather than stopping at them) is verl's multi-turn handling:
    observation tokens inside a response neither bootstrap nor break the chain. The advantages are
    NOT whitened (verl whitens them inside compute_gae_advantage_return): whiten them with
    `masked_whiten(adv, mask, *whiten_mean_var(*<all-reduced whiten_stats(adv, mask)>))`, or
    `masked_whiten(adv, mask)` on a whole batch, to get verl's advantages. The returns are the
    critic's targets (`value_loss`) and are not whitened in verl either.
    """
    _check_token_shapes("gae_advantages", mask, token_rewards, values)
    r = token_rewards.detach().float()
    v = values.detach().float()
    m = mask.detach().float()
    B, T = r.shape
    nextvalues = torch.zeros(B, dtype=r.dtype, device=r.device)
    lastgaelam = torch.zeros(B, dtype=r.dtype, device=r.device)
    adv = torch.zeros_like(r)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * nextvalues - v[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = v[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * m[:, t] + (1 - m[:, t]) * lastgaelam
        adv[:, t] = lastgaelam
    returns = adv + v
    on = m != 0
    return (torch.where(on, adv, torch.zeros_like(adv)),
            torch.where(on, returns, torch.zeros_like(returns)))


@torch.no_grad()
def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE++'s discounted returns (the loop in verl's compute_reinforce_plus_plus_outcome_advantage),
    carried through the holes of the mask.

    Shapes: token_rewards, mask [B, T] -> returns [B, T] float32, zero outside the mask. Backwards over t from
    G = 0: G <- r_t + g_t * G, returns_t = G, with g_t = gamma on a mask token and 1 on a masked one. So a masked
    position passes the running return on undiscounted: in a multi-turn trajectory the model's tokens before an
    observation (tool output, environment message: in the context, never trained) keep the credit of the reward
    that comes after it, discounted only by the model tokens in between, as `gae_advantages` skips masked positions.
    (verl's loop resets G at every masked position instead, which cuts that credit; the two agree on masks without
    holes, whose masked positions all lie before the first or after the last mask token and carry no reward: every
    single-turn batch, bit for bit.)
    """
    _check_token_shapes("discounted_returns", mask, token_rewards)
    r = token_rewards.detach().float()
    m = mask.detach().float()
    g = torch.where(m != 0, torch.full_like(m, gamma), torch.ones_like(m))
    returns = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + g[:, t] * running
        returns[:, t] = running
    return torch.where(m != 0, returns, torch.zeros_like(returns))


def reinforce_pp_returns(token_rewards: Tensor, mask: Tensor, gamma: float,
                         mean: Tensor | float | None = None,
                         var: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (verl's compute_reinforce_plus_plus_outcome_advantage, arXiv 2501.03262).

    Shapes: token_rewards, mask [B, T] -> (advantages [B, T], returns [B, T]) float32, zero outside
    the mask. returns = `discounted_returns(token_rewards, mask, gamma)`; advantages = returns
    whitened over all mask tokens of the batch (`masked_whiten`, unbiased variance, +1e-8). No
    baseline and no grouping: the whitening is the baseline. `mean` / `var`: the whitening
    statistics; None computes them from this batch (verl). For a batch split over ranks pass
    `whiten_mean_var(*all_reduce(whiten_stats(discounted_returns(...), mask)))`.
    """
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask, mean, var), returns


def group_centred_rewards(rewards: Tensor, group_ids: Tensor, keep_singletons: bool = True
                          ) -> Tensor:
    """r - group mean, float64 [N], as verl's REINFORCE++-baseline / GRPO centring.

    Groups whose rewards are all equal give exactly 0. A group of one has no mean to subtract:
    keep_singletons=True keeps its raw reward (verl: its id2mean is 0); False gives it 0, as our
    registry estimators do.
    """
    st = _Groups(rewards, group_ids)
    r = rewards.detach().to(torch.float64)
    c = torch.where(st.informative, st.centred, torch.zeros_like(st.centred))
    if keep_singletons:
        c = torch.where(st.n == 1, r, c)
    return c


def reinforce_pp_baseline_token_advantages(rewards: Tensor, group_ids: Tensor, mask: Tensor,
                                           mean: Tensor | float | None = None,
                                           var: Tensor | float | None = None, *,
                                           keep_singletons: bool = True) -> Tensor:
    """REINFORCE++-baseline whitened over TOKENS (verl's
    compute_reinforce_plus_plus_baseline_outcome_advantage).

    Shapes: rewards [N] float, group_ids [N] long, mask [N, T] -> advantages [N, T] (rewards'
    dtype; float32 for integer rewards), zero outside the mask.

        c_i   = r_i - mean of r over i's group      (`group_centred_rewards`)
        x_it  = c_i * mask_it                       (broadcast over the sequence's tokens)
        A_it  = (x_it - mean_x) * rsqrt(var_x + 1e-8) * mask_it

    mean_x, var_x: mean and unbiased variance of x over all mask tokens of the batch, so a
    sequence counts once per response token (this differs from `reinforce_pp_advantages`, which
    whitens one value per sequence, and from it also in subtracting the token mean). Pass `mean` /
    `var` from `whiten_mean_var` of all-reduced `whiten_stats(x, mask)` when the batch is split over
    ranks (x as above); None computes them here. A group of one keeps its raw reward as verl does
    (keep_singletons=True); keep_singletons=False gives it 0 before whitening, as our registry
    estimators. All-equal groups are exactly 0 before whitening.
    """
    if mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"reinforce_pp_baseline_token_advantages: mask must be [N, T] with N = "
                         f"{rewards.shape[0]}, got {tuple(mask.shape)}")
    c = group_centred_rewards(rewards, group_ids, keep_singletons)
    m = mask.detach().to(torch.float64)
    x = c[:, None] * m
    adv = masked_whiten(x, m, mean, var)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def reinforce_pp_baseline_advantages(rewards: Tensor, group_ids: Tensor, response_lengths: Tensor,
                                     mean: Tensor | float | None = None,
                                     var: Tensor | float | None = None) -> Tensor:
    """verl's REINFORCE++-baseline (compute_reinforce_plus_plus_baseline_outcome_advantage), one value per
    sample: what `reinforce_pp_baseline_token_advantages` gives each of the sample's response tokens.

    Shapes: rewards [N] float, group_ids [N] long, response_lengths [N] (each sample's response / loss token
    count, n_i) -> advantages [N] (rewards' dtype; float32 for integer rewards), broadcast over the sample's
    tokens by the loss.

        c_i  = r_i - mean of r over i's group   (a group of one keeps r_i, as verl: its mean is taken as 0;
                                                 a group of equal rewards gives exactly 0 before whitening)
        A_i  = (c_i - mean_x) * rsqrt(var_x + 1e-8),   0 when n_i = 0 (a fully masked row)

    mean_x, var_x: mean and unbiased variance of c_i broadcast over every response token of the batch, i.e.
    weighted by n_i: mean_x = sum n_i c_i / sum n_i, var_x = (sum n_i c_i^2 - sum n_i * mean_x^2) /
    (sum n_i - 1). Because the whitened token values of one row are all equal, this equals verl's [N, T]
    result on the row's tokens (to float64 rounding), without building [N, T]. Note that whitening moves
    equal-reward groups off 0 whenever mean_x != 0, as in verl. `mean` / `var`: statistics to use instead
    (e.g. all-reduced `whiten_stats`); None computes them from this batch.
    """
    if response_lengths.shape != rewards.shape:
        raise ValueError(f"reinforce_pp_baseline_advantages: response_lengths must be [N] like rewards, got "
                         f"{tuple(response_lengths.shape)} and {tuple(rewards.shape)}")
    c = group_centred_rewards(rewards, group_ids, keep_singletons=True)        # float64 [N]
    n = response_lengths.detach().to(device=c.device, dtype=torch.float64)
    if mean is None or var is None:
        mean, var = whiten_mean_var((c * n).sum(), (c * c * n).sum(), n.sum())
    mean = torch.as_tensor(mean, dtype=torch.float64, device=c.device)
    var = torch.as_tensor(var, dtype=torch.float64, device=c.device)
    adv = (c - mean) * torch.rsqrt(var + _WHITEN_EPS)
    adv = torch.where(n > 0, adv, torch.zeros_like(adv))
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)
