"""Off-policy correction of the PPO loss for rollouts sampled by an inference engine.

The engine that samples (the behaviour policy mu, logprobs `behaviour_logprobs`) is not the
trainer's policy before the update (pi_old, logprobs `old_logprobs`): kernels and precision differ,
and with asynchronous rollouts mu may be several weight versions stale. Per response token

    w = mu-to-pi_old importance weight = exp(clamp(old_logprobs - behaviour_logprobs, -20, 20))

and `off_policy_weights` turns w into a per-token weight that multiplies the per-token PPO loss of
`losses.policy_loss` (whose ratio stays pi / pi_old). Modes:

  none       weight = 1                                  no correction
  tis        weight = min(w, tis_cap)                    truncated IS (verl rollout correction TIS)
  mis        weight = w if mis_low <= w <= mis_high      masked IS (verl rollout correction MIS):
             else 0                                      tokens far off-policy are dropped
  decoupled  weight = w if w <= decoupled_cap else 0     AReaL's decoupled PPO (arXiv 2505.24298):
                                                         old_logprobs are the proximal policy's,
                                                         the PPO clip is taken against it, and
                                                         tokens with w above the cap are masked
                                                         (AReaL's behav_imp_weight_cap)

The config's default, "auto", is resolved by `resolve_off_policy` when the experiment config is
validated: decoupled when rollout.max_staleness >= 1, none at 0 (see STALE_OFF_POLICY for why).

Tensors follow `rlhf_orch.types`: token tensors [B, T], `response_mask` float [B, T]. Pure
functions: no all-reduce across ranks, no model code.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rlhf_orch.algorithms.losses import _LOG_RATIO_CLAMP, masked_mean
from rlhf_orch.errors import ConfigError

OFF_POLICY_MODES = ("none", "tis", "mis", "decoupled")

# algorithm.off_policy's default: not a mode of its own but "pick for me from rollout.max_staleness" (issue #27).
OFF_POLICY_AUTO = "auto"
# What "auto" becomes when samples may be stale (max_staleness >= 1). decoupled, not tis: the trainer's
# old_logprobs are its own recomputation at train time, i.e. AReaL's proximal policy, so decoupled PPO is
# the objective this loss already has (clip against the proximal policy, weight by proximal / behaviour), and
# it learned best in issue #27's CPU runs (configs/tiny_cpu.yaml, 600 steps, staleness 1, last-20% reward):
# decoupled 0.903 against tis 0.811 / 0.806 / 0.758, mis 0.754 and none 0.265-0.788, on-policy 0.741-0.896.
# Its cap masks a token whose weight exceeds decoupled_cap (5) instead of keeping it at tis_cap (2).
STALE_OFF_POLICY = "decoupled"


def resolve_off_policy(mode: str, max_staleness: int) -> str:
    """The correction a run uses: `mode` itself unless it is "auto", which becomes STALE_OFF_POLICY when
    max_staleness >= 1 (the engine may sample with older weights than the trainer's) and "none" at 0 (the
    synchronous loop, exactly as before: no weights, no extra metrics)."""
    if mode != OFF_POLICY_AUTO:
        return mode
    return STALE_OFF_POLICY if max_staleness > 0 else "none"


def _check_settings(mode: str, tis_cap: float, mis_low: float, mis_high: float,
                    decoupled_cap: float) -> None:
    if mode not in OFF_POLICY_MODES:
        raise ConfigError(f"algorithm.off_policy: unknown mode {mode!r}; use one of: "
                          f"{', '.join(OFF_POLICY_MODES)}")
    if not tis_cap >= 1.0:
        raise ConfigError(f"algorithm.tis_cap: need tis_cap >= 1, got {tis_cap}")
    if not 0.0 <= mis_low < 1.0 < mis_high:
        raise ConfigError(f"algorithm.mis_low/mis_high: need 0 <= mis_low < 1 < mis_high, got "
                          f"mis_low={mis_low}, mis_high={mis_high}")
    if not decoupled_cap > 1.0:
        raise ConfigError(f"algorithm.decoupled_cap: need decoupled_cap > 1, got {decoupled_cap}")


def off_policy_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, response_mask: Tensor,
                       mode: str, *, tis_cap: float = 2.0, mis_low: float = 0.5,
                       mis_high: float = 2.0, decoupled_cap: float = 5.0
                       ) -> tuple[Tensor, dict[str, float]]:
    """Per-token off-policy weights for the PPO loss (see the module docstring for the modes).

    Shapes: old_logprobs, behaviour_logprobs, response_mask [B, T]. Returns (weights [B, T]
    float32, detached, exactly 0 off the mask even where the inputs are inf/NaN there; metrics).
    Multiply `policy_loss`'s per-token loss by the weights before `aggregate_token_loss`; keep
    the token count of the mask as the denominator (masked tokens count, with weight 0).

    Metrics (python floats over response tokens; 0 when there are none):
      is_weight_mean, is_weight_max - of the raw w, before truncation or masking;
      is_truncated_frac - tis: fraction of tokens with w > tis_cap; other modes 0;
      is_masked_frac    - mis/decoupled: fraction of tokens given weight 0; other modes 0;
      logprob_gap_mean  - mean |old_logprobs - behaviour_logprobs|.
    All settings are checked whatever the mode: ConfigError names the offending field.
    """
    _check_settings(mode, tis_cap, mis_low, mis_high, decoupled_cap)
    with torch.no_grad():
        mask = response_mask.detach().to(torch.float32)
        on = mask != 0
        diff = old_logprobs.detach().float() - behaviour_logprobs.detach().float()
        diff = torch.where(on, diff, torch.zeros_like(diff))
        w = torch.exp(diff.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
        truncated = torch.zeros_like(w)
        dropped = torch.zeros_like(w)
        if mode == "none":
            weights = torch.ones_like(w)
        elif mode == "tis":
            weights = w.clamp(max=tis_cap)
            truncated = (w > tis_cap).float()
        else:
            keep = (w >= mis_low) & (w <= mis_high) if mode == "mis" else w <= decoupled_cap
            weights = torch.where(keep, w, torch.zeros_like(w))
            dropped = (~keep).float()
        weights = torch.where(on, weights, torch.zeros_like(weights))
        metrics = {
            "is_weight_mean": masked_mean(w, mask).item(),
            "is_weight_max": w[on].max().item() if bool(on.any()) else 0.0,
            "is_truncated_frac": masked_mean(truncated, mask).item(),
            "is_masked_frac": masked_mean(dropped, mask).item(),
            "logprob_gap_mean": masked_mean(diff.abs(), mask).item(),
        }
    return weights, metrics


def staleness_histogram(token_versions: Tensor, response_mask: Tensor, trained_version: int,
                        max_lag: int) -> dict[str, float]:
    """Histogram of how many versions behind the trained weights each response token was sampled.

    Shapes: token_versions [B, T] long (weight version that produced each token; ignored off the
    mask), response_mask [B, T]. lag = trained_version - version per response token. Returns
    {"staleness/lag_0": count, ..., "staleness/lag_{max_lag}": count, "staleness/max_lag",
    "staleness/mean_lag"} as python floats (max and mean 0 when there are no response tokens).
    Raises ValueError if a response token's lag is < 0 (sampled by weights newer than the trained
    ones) or > max_lag (staler than allowed); the message names the lag and the bound.
    """
    if max_lag < 0:
        raise ValueError(f"max_lag must be >= 0, got {max_lag}")
    lags = trained_version - token_versions.detach().long()[response_mask != 0]
    if lags.numel() and int(lags.min()) < 0:
        raise ValueError(f"token lag {int(lags.min())} < 0: a token has version "
                         f"{trained_version - int(lags.min())} newer than trained version "
                         f"{trained_version}")
    if lags.numel() and int(lags.max()) > max_lag:
        raise ValueError(f"token lag {int(lags.max())} exceeds max_lag {max_lag} "
                         f"(trained version {trained_version})")
    counts = torch.bincount(lags, minlength=max_lag + 1) if lags.numel() else \
        torch.zeros(max_lag + 1, dtype=torch.long)
    out = {f"staleness/lag_{k}": float(counts[k]) for k in range(max_lag + 1)}
    out["staleness/max_lag"] = float(lags.max()) if lags.numel() else 0.0
    out["staleness/mean_lag"] = float(lags.float().mean()) if lags.numel() else 0.0
    return out
