"""Token-level RL losses: PPO clipped surrogate (with dual clip), KL estimators, loss aggregation
modes, value loss, entropy, with verl's semantics and names (verl/trainer/ppo/core_algos.py).

Tensors follow the convention in `rlhf_orch.types`: token-level tensors are [B, T] over the whole
(prompt + response) sequence, position t of a logprob tensor holds the logprob of token t, and
`response_mask` [B, T] float marks the generated tokens that count in losses. Advantages are [B]
(one per sequence, broadcast over its tokens) or already [B, T].

These are pure functions. This module does not compute logprobs from a model, does not compute
advantages (see `advantages.py`), and does not all-reduce anything across data-parallel ranks:
`aggregate_token_loss` / `aggregate_loss` take the global token and sequence counts from their
caller. docs/algorithms.md has every formula and each difference from verl.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_orch.algorithms.advantages import whiten_mean_var, whiten_stats
from rlhf_orch.errors import ConfigError

# Bound on |log-ratio| before exp: exp(20) ~ 5e8 is finite in float32 and far beyond any clip
# range, so the clamp changes no loss value that matters, but it keeps a stray huge log-ratio
# (e.g. a masked padding position) from producing inf and then NaN gradients.
_LOG_RATIO_CLAMP = 20.0

# verl's kl_penalty names (core_algos.kl_penalty_forward); "kl"/"k1", "mse"/"k2" and
# "low_var_kl"/"k3" are aliases there, and all but k3/low_var_kl are bit-identical aliases here too.
# "k3_clamped" (the default) is ours: k3 with its estimate capped at verl's low_var_kl bound.
_KL_BASE = ("k1", "k2", "k3", "kl", "abs", "mse", "low_var_kl", "k3_clamped")
# Every name kl_divergence accepts: the base names, then their straight-through "+" variants
# (verl's kl_penalty with a "+" suffix: forward value of the named estimator, gradient of k2).
KL_ESTIMATORS = _KL_BASE + tuple(f"{name}+" for name in _KL_BASE)

# verl's loss_agg_mode names (core_algos.agg_loss). "token-mean" is aggregate_token_loss.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# verl's low_var_kl clamps the estimate itself to this range after the [-20, 20] log-ratio clamp.
_LOW_VAR_KL_CLAMP = 10.0

# The estimator a run uses when algorithm.kl_estimator is not given (issue #27): unclamped k3 grows as
# exp(log(ref / p)): e^20 - 21 = 4.85e8 per token once log(ref / p) reaches the +-20 clamp (e.g. at 29), i.e.
# 4.85e8 x kl_coef in the loss, so one token far from the reference could dominate a step's gradient. k3_clamped caps each token at 10 and is
# k3, bit for bit, everywhere below the cap, so runs whose k3 never reached 10 are unchanged.
DEFAULT_KL_ESTIMATOR = "k3_clamped"


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
                clip_eps_low: float = 0.2, clip_eps_high: float | None = None,
                clip_ratio_c: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate per token (asymmetric clip range as in DAPO's clip-higher), with
    optional dual clip (verl's compute_policy_loss_vanilla / compute_policy_loss).

    Shapes: logprobs, old_logprobs, response_mask [B, T]; advantages [B] (broadcast over tokens)
    or [B, T]. Returns (per_token_loss [B, T] float32, metrics).

    ratio = exp(clamp(logprobs - old_logprobs, -20, 20)) in float32;
    loss  = -min(ratio * A, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A)
          = max(-ratio * A, -clip(ratio) * A)                   (verl's clip_pg_losses1),
    zeroed outside response_mask. clip_eps_high defaults to clip_eps_low. Reduce the result with
    `aggregate_loss` (or `aggregate_token_loss`). old_logprobs and advantages are treated as
    constants (detached).

    Dual clip (Ye et al. 2019, arXiv 1912.09729; verl's clip_ratio_c, default 3.0 there): with
    `clip_ratio_c` set (must be > 1), tokens with A < 0 get
        loss = min(max(-ratio * A, -clip(ratio) * A), -clip_ratio_c * A),
    which bounds the loss of a negative-advantage token whose ratio has grown far above 1 (those
    tokens then get no gradient). Tokens with A >= 0 are unchanged. `clip_ratio_c=None` (the
    default) applies no dual clip and gives bit-identical results to the function before it had
    the argument.

    Metrics (python floats, over response tokens; 0 when there are none):
      clip_frac  - fraction of tokens where the clipped term is strictly smaller, i.e. the min
                   picked it and it differs from the unclipped one (those tokens get no gradient);
      pg_clipfrac - verl's name for the same fraction (-clip(r) * A > -r * A), equal to clip_frac;
      pg_clipfrac_lower - verl's: fraction of tokens with A < 0 where the dual clip bound
                   -clip_ratio_c * A is strictly smaller than the clipped loss (the dual clip
                   decides the loss); 0 when clip_ratio_c is None;
      ratio_mean, ratio_max;
      approx_kl  - mean k3 estimate of KL(old || new): ratio - 1 - log(ratio), always >= 0;
      ppo_kl     - verl's ppo_kl: the k1 mean over response tokens of old - new, i.e.
                   masked_mean(-negative_approx_kl) with negative_approx_kl = the clamped log-ratio
                   (can be negative).
    """
    if clip_eps_high is None:
        clip_eps_high = clip_eps_low
    if not 0.0 <= clip_eps_low <= 1.0 or clip_eps_high < 0.0:
        raise ConfigError(
            f"algorithm.clip_eps: need 0 <= clip_eps_low <= 1 and clip_eps_high >= 0, got "
            f"low={clip_eps_low}, high={clip_eps_high}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ConfigError(
            f"algorithm.clip_ratio_c: the dual-clip bound must be > 1 (verl's default is 3.0), "
            f"got {clip_ratio_c}")
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
    dual = None
    if clip_ratio_c is not None:
        lower = -adv * clip_ratio_c                              # verl's pg_losses3
        negative = adv < 0
        dual = negative & (per_token > lower)                    # the bound decides the loss
        per_token = torch.where(negative, torch.minimum(per_token, lower), per_token)
    per_token = torch.where(mask != 0, per_token, torch.zeros_like(per_token))

    with torch.no_grad():
        clipped = (surr_clipped < surr_unclipped).float()
        on = mask != 0
        clip_frac = masked_mean(clipped, mask).item()
        metrics = {
            "clip_frac": clip_frac,
            "ratio_mean": masked_mean(ratio, mask).item(),
            "ratio_max": ratio[on].max().item() if bool(on.any()) else 0.0,
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask).item(),
            "ppo_kl": masked_mean(-log_ratio, mask).item(),
            "pg_clipfrac": clip_frac,
            "pg_clipfrac_lower": (masked_mean(torch.broadcast_to(dual, mask.shape).float(), mask).item()
                                  if dual is not None else 0.0),
        }
    return per_token, metrics


def _kl_unknown(estimator: str) -> ConfigError:
    return ConfigError(
        f"algorithm.kl_estimator: unknown KL estimator {estimator!r}; use one of: "
        f"{', '.join(KL_ESTIMATORS)}")


def _kl_forward(logprobs: Tensor, ref_logprobs: Tensor, name: str) -> Tensor:
    """Forward value of a base (no "+") estimator, float32 [B, T]."""
    diff = logprobs.float() - ref_logprobs.float()
    if name in ("k1", "kl"):
        return diff
    if name in ("k2", "mse"):
        return 0.5 * diff ** 2
    if name == "abs":
        return diff.abs()
    if name in ("k3", "k3_clamped"):
        d = (-diff).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)   # log(ref / p)
        # exp(d) - d - 1 >= 0 in exact arithmetic; clamp the rounding residue near d = 0.
        k3 = (torch.exp(d) - d - 1.0).clamp(min=0.0)
        # k3_clamped: the same tensor, capped at 10 (verl's low_var_kl bound); identical wherever k3 <= 10.
        return k3 if name == "k3" else k3.clamp(max=_LOW_VAR_KL_CLAMP)
    if name == "low_var_kl":
        # verl's kl_penalty_forward("low_var_kl") exactly: log-ratio clamped to [-20, 20], the
        # estimate clamped to [-10, 10].
        kl = (ref_logprobs.float() - logprobs.float()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        kld = torch.exp(kl) - kl - 1.0
        return kld.clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)
    raise _kl_unknown(name)


def kl_divergence(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = DEFAULT_KL_ESTIMATOR) -> Tensor:
    """Per-token estimate of KL(policy || ref) from sampled-token logprobs (Schulman's k1/k2/k3),
    under our names and verl's (core_algos.kl_penalty / kl_penalty_forward).

    Shapes: logprobs, ref_logprobs [B, T] (any equal shapes) -> [B, T] float32 (inputs are cast to
    float32 first; verl computes in the inputs' dtype). With d = logp - logref:
      k1, kl:          d                                  (unbiased, can be negative)
      k2, mse:         0.5 * d^2                          (biased, >= 0)
      abs:             |d|
      k3:              exp(-d') + d' - 1, d' = clamp(d, -20, 20), then clamped to >= 0
                       (unbiased, >= 0, low variance; our k3, unchanged since before verl names)
      low_var_kl:      verl's k3 exactly: x = clamp(-d, -20, 20); clamp(exp(x) - x - 1, -10, 10)
      k3_clamped:      min(k3, 10)  (THE DEFAULT: bounded like low_var_kl, and bit-identical to k3
                       wherever k3 <= 10, so runs recorded with k3 reproduce unless a token reached 10)
    "k3" and "low_var_kl" agree except where the estimate exceeds 10 (low_var_kl caps it at 10,
    k3 does not; that is d < -2.611 or d > 11.000) and where float32
    rounding leaves a negative residue near d = 0 (k3 clamps it to 0, low_var_kl keeps it). verl's
    own "k3" is its low_var_kl; ours keeps the old behaviour so existing runs stay exact. Unclamped
    k3 is unbounded (e^20 - 21 = 4.85e8 per token at |d| >= 20): choose it only on purpose.

    Straight-through variants: any name above with a "+" suffix ("k1+", "k3+", "low_var_kl+", ...)
    returns the forward VALUE of the named estimator with the GRADIENT of k2 (0.5 * d^2, whose
    gradient d is an unbiased estimate of the gradient of KL(policy || ref) for on-policy samples),
    as verl's kl_penalty: k2 - k2.detach() + named.detach(). "k2+" / "mse+" equal k2 / mse.

    "full" (verl's exact KL over the vocabulary) needs the full distributions, which this
    function's sampled-token logprobs do not carry: it raises ConfigError (verl raises
    NotImplementedError for it too).

    Values are NOT masked: positions outside response_mask hold whatever the inputs give there, so
    the caller must mask or reduce with `masked_mean` / `aggregate_loss`.
    """
    if estimator in ("full", "full+"):
        raise ConfigError(
            f"algorithm.kl_estimator: {estimator!r} (exact KL over the whole vocabulary) is not "
            f"supported: it needs the full distributions, and the loss only has the sampled "
            f"tokens' logprobs; use one of: {', '.join(KL_ESTIMATORS)}")
    if estimator not in KL_ESTIMATORS:
        raise _kl_unknown(estimator)
    if not estimator.endswith("+"):
        return _kl_forward(logprobs, ref_logprobs, estimator)
    forward = _kl_forward(logprobs, ref_logprobs, estimator[:-1])
    backward = 0.5 * (logprobs.float() - ref_logprobs.float()).square()
    return backward - backward.detach() + forward.detach()


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


def check_loss_agg_mode(mode: str) -> str:
    """`mode` if it is one of LOSS_AGG_MODES, else ConfigError naming `algorithm.loss_agg_mode`."""
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(
            f"algorithm.loss_agg_mode: unknown loss aggregation mode {mode!r}; use one of: "
            f"{', '.join(LOSS_AGG_MODES)}")
    return mode


def _safe_div(total: Tensor, count: Tensor) -> Tensor:
    return torch.where(count > 0, total / torch.where(count > 0, count, torch.ones_like(count)),
                       torch.zeros_like(total))


def aggregate_loss(per_token: Tensor, mask: Tensor, mode: str = "token-mean",
                   num_tokens_global: float | None = None, num_seqs_global: float | None = None,
                   norm_len: float | None = None) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar with verl's loss_agg_mode (core_algos.agg_loss),
    written so that a step's batch may be split over ranks and micro-batches.

    Shapes: per_token, mask [B, T] (rows are sequences) -> scalar (0-dim) tensor. Positions where
    mask is 0 contribute exactly 0, whatever per_token holds there. With S_i = sum_t mask * loss
    (sequence i's token sum), n_i = sum_t mask (its loss tokens), and only sequences with n_i > 0
    counted:
      token-mean               sum_i S_i / N_tok           N_tok = num_tokens_global
                               (exactly `aggregate_token_loss`, bit for bit)
      seq-mean-token-sum       sum_i S_i / N_seq           N_seq = num_seqs_global
      seq-mean-token-mean      sum_i (S_i / n_i) / N_seq
      seq-mean-token-sum-norm  (sum_i S_i / N_seq) / norm_len
    The sums run over THIS call's sequences only; the denominators are the GLOBAL counts of the
    whole step batch (all ranks, all micro-batches): N_tok its response tokens, N_seq its sequences
    with at least one loss token. Then the micro-batch losses of a step SUM to the full-batch value
    (every mode is linear in the per-token loss), and so do their gradients. Without the global
    counts, the counts of this call are used (verl's default: N_tok = sum of the mask, N_seq = the
    sequences with a token). As with `aggregate_token_loss`, a framework that averages gradients
    over ranks (DeepSpeed, DDP, FSDP) needs the result multiplied by the world size, which is
    verl's `* dp_size` inside agg_loss; the caller does it here. A zero denominator gives 0.

    seq-mean-token-sum-norm is Dr. GRPO's constant normaliser: the sequence token sums are divided
    by a constant instead of each sequence's length. verl (agg_loss, current main) computes it as
    seq-mean-token-sum divided by `loss_scale_factor`, which defaults to loss_mask.shape[-1], the
    padded response length of the batch. Here `norm_len` is REQUIRED for this mode (ValueError
    without it): our masks span prompt + response and micro-batches trim their padding, so the
    mask's width is neither the response length nor constant across micro-batches, and a
    varying divisor would break the exact sum. Pass a constant, the same every step: the maximum
    response length (the engines' sampling.max_new_tokens) or verl's actor.loss_scale_factor. Older
    verl (<= 0.5) divided sum_i S_i by the response length WITHOUT dividing by the number of
    sequences; that value is N_seq times ours.

    seq-mean-token-mean divides each S_i by n_i exactly; verl divides by (n_i + 1e-8), which in
    float32 is the same number for every n_i >= 1.
    """
    if mode == "token-mean":
        return aggregate_token_loss(per_token, mask, num_tokens_global)
    check_loss_agg_mode(mode)
    if mode == "seq-mean-token-sum-norm":
        if norm_len is None:
            raise ValueError(
                "aggregate_loss: loss_agg_mode 'seq-mean-token-sum-norm' needs norm_len (a constant "
                "such as the maximum response length); the mask width is not one here")
        if not norm_len > 0:
            raise ValueError(f"aggregate_loss: norm_len must be > 0, got {norm_len}")
    if per_token.dim() != 2 or mask.shape != per_token.shape:
        raise ValueError(
            f"aggregate_loss: mode {mode!r} needs per_token and mask of the same shape [B, T], got "
            f"{tuple(per_token.shape)} and {tuple(mask.shape)}")
    dtype = per_token.dtype if per_token.is_floating_point() else torch.float32
    m = mask.to(dtype)
    seq_sum = masked_sum(per_token.to(dtype), m, dim=-1)            # [B] S_i
    seq_tokens = m.sum(dim=-1)                                       # [B] n_i
    has = seq_tokens > 0
    if mode == "seq-mean-token-mean":
        seq_val = _safe_div(seq_sum, seq_tokens)
    else:                                                            # token-sum (-norm)
        seq_val = torch.where(has, seq_sum, torch.zeros_like(seq_sum))
    total = seq_val.sum()
    if num_seqs_global is None:
        count = has.sum().to(dtype)
    else:
        count = torch.as_tensor(float(num_seqs_global), dtype=dtype, device=total.device)
    loss = _safe_div(total, count)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / float(norm_len)
    return loss


def entropy_bonus(entropy: Tensor, mask: Tensor, coef: float, mode: str = "token-mean",
                  num_tokens_global: float | None = None, num_seqs_global: float | None = None,
                  norm_len: float | None = None) -> Tensor:
    """The entropy term the trainer SUBTRACTS from the policy loss: coef * aggregate_loss(entropy).

    Shapes: entropy, mask [B, T] -> scalar tensor. As verl's actor (dp_actor.update_policy with
    compute_entropy_loss / agg_loss): policy_loss = pg_loss - entropy_coeff * agg_loss(entropy,
    response_mask, loss_agg_mode), so the caller writes

        loss = aggregate_loss(per_tok, mask, mode, ...) - entropy_bonus(ent, mask, coef, mode, ...)

    with the same mode and global counts as the policy loss, so micro-batch terms sum to the
    full-batch value. Every mode is linear, so this equals subtracting coef * entropy per token
    before one aggregate_loss call (up to float rounding). `entropy` must carry gradients (e.g.
    `entropy_from_logits` of logits that do) for the bonus to change the update. coef == 0
    returns an exact 0 without reading `entropy`.
    """
    if coef == 0:
        return torch.zeros((), dtype=torch.float32, device=entropy.device)
    return coef * aggregate_loss(entropy.float(), mask, mode, num_tokens_global, num_seqs_global,
                                 norm_len)


def value_loss(vpreds: Tensor, values_old: Tensor, returns: Tensor, mask: Tensor,
               cliprange_value: float | None, mode: str = "token-mean",
               num_tokens_global: float | None = None, num_seqs_global: float | None = None,
               norm_len: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss (verl's compute_value_loss, from TRL's PPO trainer).

    Shapes: vpreds (the critic's current predictions, with gradients), values_old (its predictions
    when the batch was made), returns (targets, e.g. from `gae_advantages`), mask [B, T] ->
    (scalar loss tensor, metrics). Computed in float32; values_old and returns are detached.

      vpredclipped = clamp(vpreds, values_old - cliprange_value, values_old + cliprange_value)
      vf_losses1   = (vpreds - returns)^2
      vf_losses2   = (vpredclipped - returns)^2
      loss         = 0.5 * aggregate_loss(max(vf_losses1, vf_losses2), mask, mode, <global counts>)

    `cliprange_value=None` disables the clip (loss = 0.5 * aggregated vf_losses1; verl has no such
    option); a negative value raises ConfigError. The global counts work as in `aggregate_loss`:
    micro-batch losses sum to the full-batch loss; multiply by world size where gradients are
    averaged over ranks.

    Metrics (python floats): vf_loss - this call's loss (its share of the step's when global
    counts are given, so micro-batch values add up); vf_clipfrac - fraction of mask tokens where
    the clipped error is strictly larger (vf_losses2 > vf_losses1: the clip decides the loss and
    the token gets no gradient); vpred_mean - masked mean of vpreds (verl's critic/vpred_mean).
    """
    if cliprange_value is not None and not cliprange_value >= 0:
        raise ConfigError(f"critic.cliprange_value: must be >= 0 (or null for no clip), got "
                          f"{cliprange_value}")
    v = vpreds.float()
    old = values_old.detach().float()
    ret = returns.detach().float()
    losses1 = (v - ret) ** 2
    if cliprange_value is None:
        losses2 = losses1
    else:
        vclipped = torch.max(torch.min(v, old + cliprange_value), old - cliprange_value)
        losses2 = (vclipped - ret) ** 2
    per_token = torch.max(losses1, losses2)
    loss = 0.5 * aggregate_loss(per_token, mask, mode, num_tokens_global, num_seqs_global, norm_len)
    with torch.no_grad():
        m = mask.to(torch.float32)
        metrics = {
            "vf_loss": float(loss.detach()),
            "vf_clipfrac": masked_mean((losses2 > losses1).float(), m).item(),
            "vpred_mean": masked_mean(v.detach(), m).item(),
        }
    return loss, metrics


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor, allreduce=None) -> float:
    """1 - Var(returns - values) / (Var(returns) + 1e-5) over the mask tokens (verl's
    critic/vf_explained_var in metric_utils.compute_data_metrics; unbiased variances).

    Shapes: values, returns, mask [B, T] -> python float. 1 is a perfect critic, 0 one no better
    than the mean, negative worse. Fewer than 2 tokens give nan (torch.var of one element), as
    verl. The variances come from sums (advantages.whiten_stats): with `allreduce` (a function that
    sums a small tensor over the data-parallel ranks) they are the whole batch's however it is split.
    """
    stats = torch.stack([*whiten_stats(returns, mask), *whiten_stats(returns - values, mask)])
    if allreduce is not None:
        stats = allreduce(stats)
    if float(stats[2]) < 2:
        return float("nan")
    var_r = whiten_mean_var(*stats[:3])[1]
    var_d = whiten_mean_var(*stats[3:])[1]
    return float(1.0 - var_d / (var_r + 1e-5))


def masked_extrema(x: Tensor, mask: Tensor, reduce_max=None) -> tuple[float, float]:
    """(max, min) of x over the mask tokens, as python floats (verl's critic/values_max, returns_min, ...).

    Shapes: x, mask [B, T] (or any broadcastable pair). `reduce_max`, when given, takes the elementwise max of
    a small float64 tensor over the data-parallel ranks, so the result is the whole batch's however it is
    split (the min travels as the max of -x); a rank without mask tokens contributes -inf there, which any
    other rank's value beats. No mask token anywhere gives (0.0, 0.0), as masked_mean gives 0.
    """
    on = torch.broadcast_to(mask != 0, torch.broadcast_shapes(x.shape, mask.shape))
    vals = torch.broadcast_to(x, on.shape)[on].detach().double()
    t = (torch.stack([vals.max(), -vals.min()]) if vals.numel()
         else torch.full((2,), float("-inf"), dtype=torch.float64))
    if reduce_max is not None:
        t = reduce_max(t)
    if not bool(torch.isfinite(t).all()):
        return 0.0, 0.0
    return float(t[0]), float(-t[1])


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dim: logits [B, T, V] -> [B, T] float32.

    Computed as -sum(p * log p) with log p from log_softmax (stable for large logits). Entries
    with p = 0 (e.g. logits masked to -inf) contribute 0 instead of 0 * -inf = NaN.
    """
    logp = F.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)
