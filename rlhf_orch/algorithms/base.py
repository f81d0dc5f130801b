"""Algorithms as objects: what models a run needs, how advantages are made, and the policy's loss.

An `Algorithm` is built from the `algorithm:` config section (a plain dict, so it travels to every actor)
and answers three questions:

- `roles`: the models it needs besides the policy: "reference" (a frozen copy for KL in the loss, when
  kl_coef > 0) and "critic" (a value model, PPO). The builder starts what is listed; nothing else asks
  which algorithm runs. Before any actor starts, config/checks.role_problems refuses a listed role that
  cannot work as configured (a critic.model_path that is not a causal LM folder, a separate reference
  with more workers than shards), and reward_source_problems a run without a reward that counts.
- `outcome_advantages(rewards, group_ids, response_lengths)`: one advantage per sample from outcome rewards,
  computed where the step's batch is assembled (the rollout manager). Algorithms whose advantages need a critic return
  zeros here and set `token_advantages` (called on the trainer ranks, where the values are).
- `policy_loss(...)`: the per-token policy loss of one micro-batch and its metrics. The trainer calls it
  and aggregates the result; it holds no loss code of its own.

Each algorithm is one module of this package that subclasses `Algorithm` and registers itself with
`@register("name")`; `make_algorithm(settings)` looks the name up. Adding an algorithm is one new module
plus, if it has new settings, their fields in the config schema's algorithm section.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from rlhf_orch.algorithms.losses import (DEFAULT_KL_ESTIMATOR, aggregate_loss, aggregate_token_loss,
                                         check_loss_agg_mode, entropy_bonus, kl_divergence, masked_mean, policy_loss)
from rlhf_orch.algorithms.off_policy import OFF_POLICY_AUTO, off_policy_weights
from rlhf_orch.errors import ConfigError

_REGISTRY: dict[str, type["Algorithm"]] = {}
_OFF_POLICY_KEYS = ("tis_cap", "mis_low", "mis_high", "decoupled_cap")


def register(name: str):
    """Class decorator: make the algorithm available as `algorithm.name: <name>`."""
    def deco(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def algorithm_names() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def make_algorithm(settings: dict[str, Any]) -> "Algorithm":
    """The algorithm named by `settings["name"]`, configured by the rest of the section."""
    _load_all()
    name = settings.get("name", "grpo")
    if name not in _REGISTRY:
        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; use one of: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](settings)


def _load_all() -> None:
    # Every module of this package may define algorithms; they register themselves on import, so a new
    # algorithm is a new file here and nothing else. (The package's folder is this module's: no self-import.)
    for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"{__package__}.{mod.name}")


class KLController:
    """The weight of the KL penalty in the reward (verl's FixedKLController / AdaptiveKLController, after Ziegler
    et al. 2019). Adaptive: after each step with mean KL `kl` over `n` samples,

        error = clip(kl / target_kl - 1, -0.2, 0.2);   value *= 1 + error * n / horizon
    """

    def __init__(self, type: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1, horizon: float = 10000):
        self.type, self.value, self.target, self.horizon = type, float(kl_coef), float(target_kl), float(horizon)

    def update(self, kl: float, n: int) -> None:
        if self.type == "adaptive":
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n / self.horizon


class Algorithm:
    name: ClassVar[str] = ""
    group_based: ClassVar[bool] = True      # its advantages compare the samples of one prompt
    needs_critic: ClassVar[bool] = False
    token_level: ClassVar[bool] = False     # its advantages are per token: `token_advantages` on the trainer ranks

    def __init__(self, settings: dict[str, Any]):
        self.s = dict(settings)
        self.clip_low = self.s.get("clip_eps", 0.2)
        self.clip_high = self.s.get("clip_eps_high")
        self.kl_coef = float(self.s.get("kl_coef", 0.0))
        self.kl_estimator = self.s.get("kl_estimator", DEFAULT_KL_ESTIMATOR)
        # A bare settings dict without off_policy is the on-policy loop ("none"). "auto" depends on
        # rollout.max_staleness, which only the experiment config knows: it resolves it (config/checks.py).
        self.off_policy = self.s.get("off_policy", "none")
        if self.off_policy == OFF_POLICY_AUTO:
            raise ConfigError("algorithm.off_policy: 'auto' is resolved from rollout.max_staleness when the experiment "
                              "config is validated; an algorithm built from a settings dict needs the mode itself "
                              "(none, tis, mis or decoupled)")
        self.off_policy_kwargs = {k: self.s[k] for k in _OFF_POLICY_KEYS if k in self.s}
        self.clip_ratio_c = self.s.get("clip_ratio_c")
        self.loss_agg_mode = check_loss_agg_mode(self.s.get("loss_agg_mode", "token-mean"))
        self.entropy_coeff = float(self.s.get("entropy_coeff", 0.0))
        self.norm_len = self.s.get("loss_norm_len")
        self.kl_in_reward = bool(self.s.get("use_kl_in_reward", False))
        self.kl_ctrl = KLController(**self.s.get("kl_ctrl", {})) if self.kl_in_reward else None

    # ---- what the run needs ---------------------------------------------------------------------
    @property
    def roles(self) -> tuple[str, ...]:
        out = ["policy"]
        if self.kl_coef > 0 or self.kl_in_reward:
            out.append("reference")
        if self.needs_critic:
            out.append("critic")
        return tuple(out)

    def problems(self) -> list[str]:
        """Config problems of this algorithm's settings (checked before any actor starts)."""
        p = []
        if self.group_based and self.s.get("group_size", 8) < 2:
            p.append(f"algorithm.group_size: {self.name} compares the samples of one prompt, so it needs "
                     "group_size >= 2 (a group of one gets no learning signal); raise it or use algorithm.name: ppo")
        return p

    # ---- advantages -----------------------------------------------------------------------------
    def outcome_advantages(self, rewards: Tensor, group_ids: Tensor, response_lengths: Tensor | None = None) -> Tensor:
        """[N] advantages from [N] outcome rewards (the rollout manager's step batch); `response_lengths` [N] are
        the samples' response-token counts (the loss tokens), for estimators that weigh samples by length
        (reinforce_pp_baseline's token-level whitening); the others ignore them."""
        raise NotImplementedError

    def token_advantages(self, rewards: Tensor, values: Tensor | None, mask: Tensor,
                         allreduce) -> tuple[Tensor, Tensor, dict[str, float]]:
        """Token-level algorithms: (advantages [B, T], returns [B, T], metrics) of one rank's shard from its
        outcome rewards [B] and, with a critic, its values [B, T]; `allreduce` sums a small tensor over the
        ranks, so batch statistics (whitening) are the whole step's."""
        raise NotImplementedError

    # ---- the policy's loss ----------------------------------------------------------------------
    def policy_loss(self, logprobs: Tensor, old_logprobs: Tensor, engine_logprobs: Tensor, advantages: Tensor,
                    mask: Tensor, ref_logprobs: Tensor | None) -> tuple[Tensor, dict[str, float]]:
        """Per-token loss [b, w] of one micro-batch and its metrics: the clipped surrogate against the old
        (proximal) policy, the off-policy correction against the engine's behaviour policy, and KL to the
        reference in the loss. Aggregation over tokens is the trainer's (one normalisation for every algorithm)."""
        per_tok, m = policy_loss(logprobs, old_logprobs, advantages, mask, self.clip_low, self.clip_high,
                                 self.clip_ratio_c)
        if self.off_policy != "none":
            weights, wm = off_policy_weights(old_logprobs, engine_logprobs, mask, self.off_policy, **self.off_policy_kwargs)
            per_tok = per_tok * weights
            m.update(wm)
        if ref_logprobs is not None:
            kl = kl_divergence(logprobs, ref_logprobs, self.kl_estimator)
            per_tok = per_tok + self.kl_coef * kl * mask
            m["kl"] = float(masked_mean(kl.detach(), mask))
        return per_tok, m

    @property
    def needs_seq_count(self) -> bool:
        return self.loss_agg_mode != "token-mean"

    def aggregate(self, per_tok: Tensor, mask: Tensor, entropy: Tensor | None, num_tokens_global: float,
                  num_seqs_global: float | None) -> Tensor:
        """One micro-batch's share of the step's loss (global counts: the shares sum to the batch's loss), minus
        the entropy bonus. token-mean without a bonus is the trainer's original reduction, op for op."""
        if self.loss_agg_mode == "token-mean" and not self.entropy_coeff:
            return aggregate_token_loss(per_tok, mask, num_tokens_global)
        args = (self.loss_agg_mode, num_tokens_global, num_seqs_global, self.norm_len)
        loss = aggregate_loss(per_tok, mask, *args)
        if self.entropy_coeff:
            loss = loss - entropy_bonus(entropy, mask, self.entropy_coeff, *args)
        return loss

    def zeros(self, rewards: Tensor) -> Tensor:
        return torch.zeros_like(rewards, dtype=torch.float32 if not rewards.is_floating_point() else rewards.dtype)
