"""Token-level RL losses: PPO clipped surrogate, KL estimators, masked reductions, entropy.

Tensors follow the convention in `rlhf_orch.types`: token-level tensors are [B, T] over the whole
(prompt + response) sequence, position t of a logprob tensor holds the logprob of token t, and
`response_mask` [B, T] float marks the generated tokens that count in losses. Advantages are [B]
(one per sequence, broadcast over its tokens) or already [B, T].

These are pure functions. This module does not compute logprobs from a model, does not compute
advantages (see `advantages.py`), and does not all-reduce anything across data-parallel ranks:
`aggregate_token_loss` takes the global token count from its caller.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_orch.errors import ConfigError

# Bound on |log-ratio| before exp: exp(20) ~ 5e8 is finite in float32 and far beyond any clip
# range, so the clamp changes no loss value that matters, but it keeps a stray huge log-ratio
# (e.g. a masked padding position) from producing inf and then NaN gradients.
_LOG_RATIO_CLAMP = 20.0

KL_ESTIMATORS = ("k1", "k2", "k3")


def _zero_off_mask(x: Tensor, mask: Tensor) -> Tensor:
    """x * mask, but 0 (not NaN) where mask == 0 even if x is inf or NaN there."""
    return torch.where(mask != 0, x * mask, torch.zeros_like(x))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of x * mask, over all elements (scalar) or along `dim`.

    Shapes: x and mask broadcastable to the same shape (typically [B, T]). Positions where mask is
    0 contribute exactly 0, whatever x holds there.
    """
    y = _zero_off_mask(x, mask)
    return y.sum() if dim is None else y.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x weighted by mask, over all elements (scalar) or along `dim`.

    Shapes: x, mask [B, T] (or any broadcastable pair) -> scalar, or the shape with `dim` reduced.
    A fully masked input (or a fully masked row when `dim` is given) yields 0, never NaN.
    """
    mask = mask.to(x.dtype) if x.is_floating_point() else mask.float()
    num = masked_sum(x, mask, dim)
    den = torch.broadcast_to(mask, torch.broadcast_shapes(x.shape, mask.shape))
    den = den.sum() if dim is None else den.sum(dim=dim)
    return torch.where(den != 0, num / torch.where(den != 0, den, torch.ones_like(den)),
                       torch.zeros_like(num))


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor,
                clip_eps_low: float = 0.2, clip_eps_high: float | None = None
                ) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate per token (asymmetric clip range as in DAPO's clip-higher).

    Shapes: logprobs, old_logprobs, response_mask [B, T]; advantages [B] (broadcast over tokens)
    or [B, T]. Returns (per_token_loss [B, T] float32, metrics).

    ratio = exp(clamp(logprobs - old_logprobs, -20, 20)) in float32;
    loss  = -min(ratio * A, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A),
    zeroed outside response_mask. clip_eps_high defaults to clip_eps_low. Reduce the result with
    `aggregate_token_loss`. old_logprobs and advantages are treated as constants (detached).

    Metrics (python floats, over response tokens; 0 when there are none):
      clip_frac  - fraction of tokens where the clipped term is strictly smaller, i.e. the min
                   picked it and it differs from the unclipped one (those tokens get no gradient);
      ratio_mean, ratio_max;
      approx_kl  - mean k3 estimate of KL(old || new): ratio - 1 - log(ratio), always >= 0.
    """
    if clip_eps_high is None:
        clip_eps_high = clip_eps_low
    if not 0.0 <= clip_eps_low <= 1.0 or clip_eps_high < 0.0:
        raise ConfigError(
            f"algorithm.clip_eps: need 0 <= clip_eps_low <= 1 and clip_eps_high >= 0, got "
            f"low={clip_eps_low}, high={clip_eps_high}")
    mask = response_mask.to(torch.float32)
    adv = advantages.detach().to(torch.float32)
    if adv.dim() == 1:
        adv = adv[:, None]
    # float32 even under bf16 autocast: exp of a bf16 log-ratio loses the ~1e-3 differences that
    # decide whether a token is clipped.
    log_ratio = (logprobs.float() - old_logprobs.detach().float()).clamp(
        -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    surr_unclipped = ratio * adv
    surr_clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    per_token = -torch.minimum(surr_unclipped, surr_clipped)
    per_token = torch.where(mask != 0, per_token, torch.zeros_like(per_token))

    with torch.no_grad():
        clipped = (surr_clipped < surr_unclipped).float()
        on = mask != 0
        metrics = {
            "clip_frac": masked_mean(clipped, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "ratio_max": ratio[on].max().item() if bool(on.any()) else 0.0,
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask).item(),
        }
    return per_token, metrics


def kl_divergence(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(policy || ref) from sampled-token logprobs (Schulman's k1/k2/k3).

    Shapes: logprobs, ref_logprobs [B, T] (any equal shapes) -> [B, T] float32.
      k1: logp - logref                                  (unbiased, can be negative)
      k2: 0.5 * (logp - logref)^2                        (biased, >= 0)
      k3: exp(logref - logp) - (logref - logp) - 1       (unbiased, >= 0, low variance)
    For k3 the log difference is clamped to [-20, 20] before exp to stay finite.
    Values are NOT masked: positions outside response_mask hold whatever the inputs give there, so
    the caller must mask or reduce with `masked_mean` / `aggregate_token_loss`.
    """
    diff = logprobs.float() - ref_logprobs.float()
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff ** 2
    if estimator == "k3":
        d = (-diff).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)   # log(ref / p)
        # exp(d) - d - 1 >= 0 in exact arithmetic; clamp the rounding residue near d = 0.
        return (torch.exp(d) - d - 1.0).clamp(min=0.0)
    raise ConfigError(
        f"algorithm.kl_estimator: unknown KL estimator {estimator!r}; use one of: "
        f"{', '.join(KL_ESTIMATORS)}")


def aggregate_token_loss(per_token_loss: Tensor, response_mask: Tensor,
                         num_tokens_global: float | None = None) -> Tensor:
    """Token-mean of a per-token loss: scalar = sum(loss * mask) / token count.

    Shapes: per_token_loss, response_mask [B, T] -> scalar (0-dim) tensor.

    Without `num_tokens_global` the count is this batch's response tokens (sum of the mask).
    With it, the masked sum is divided by that number instead: pass the response-token count of
    the whole global batch (all data-parallel ranks, all micro-batches of the step). Then the
    per-shard losses SUM to the full-batch token mean, so summed gradients equal one big batch's.
    Frameworks that AVERAGE gradients over ranks (DDP, FSDP) divide by world size, so the caller
    multiplies this loss by world size there. Returns 0 (not NaN) when there are no tokens.
    """
    total = masked_sum(per_token_loss, response_mask.to(per_token_loss.dtype))
    if num_tokens_global is None:
        count = response_mask.sum()
    else:
        count = torch.as_tensor(float(num_tokens_global), device=total.device)
    count = count.to(total.dtype)
    return torch.where(count > 0, total / torch.where(count > 0, count, torch.ones_like(count)),
                       torch.zeros_like(total))


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dim: logits [B, T, V] -> [B, T] float32.

    Computed as -sum(p * log p) with log p from log_softmax (stable for large logits). Entries
    with p = 0 (e.g. logits masked to -inf) contribute 0 instead of 0 * -inf = NaN.
    """
    logp = F.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)
