"""Issue #27 item 5 and part of item 4: algorithm defaults that cannot explode, verl's REINFORCE++-baseline by name,
and an off-policy correction on by default when samples may be stale. Expected values are derived by hand in the
comments beside them."""
import logging
import math
from pathlib import Path

import pytest
import torch

from rlhf_orch.algorithms import DEFAULT_KL_ESTIMATOR, kl_divergence
from rlhf_orch.algorithms.advantages import (reinforce_pp_baseline_advantages,
                                             reinforce_pp_baseline_token_advantages)
from rlhf_orch.algorithms.base import algorithm_names, make_algorithm
from rlhf_orch.algorithms.off_policy import STALE_OFF_POLICY, resolve_off_policy
from rlhf_orch.config.loader import load_config
from rlhf_orch.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny_cpu.yaml")           # GRPO, kl_coef 0.02, max_staleness 0


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def _warnings(caplog, field):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.getMessage().startswith(field)]


# ----------------------------------------------------------------------------- the KL default

def test_default_kl_estimator_is_clamped_k3_on_hand_values():
    assert DEFAULT_KL_ESTIMATOR == "k3_clamped"
    # x = log(ref / p) = ref - logp (logp = 0 here); k3 = e^x - x - 1 after clamping x to [-20, 20]
    lp = torch.zeros(1, 5)
    lr = torch.tensor([[0.0, 1.0, -2.0, 29.0, -29.0]])
    # x = 0: 1 - 0 - 1 = 0;  x = 1: e - 2 = 0.718282;  x = -2: e^-2 + 2 - 1 = 1.135335
    # x = 29: clamped to 20: e^20 - 21 = 4.85e8 -> capped at 10;  x = -29: clamped to -20: e^-20 + 19 = 19 -> 10
    want = [[0.0, math.e - 2, math.exp(-2) + 1, 10.0, 10.0]]
    close(kl_divergence(lp, lr), want)                       # the function's default
    close(kl_divergence(lp, lr, "k3_clamped"), want)
    unclamped = kl_divergence(lp, lr, "k3")
    assert unclamped[0, 3].item() == pytest.approx(math.exp(20) - 21, rel=1e-6)   # what the cap prevents: 4.85e8
    assert unclamped[0, 4].item() == pytest.approx(19.0, abs=1e-5)
    # the algorithm's and the config's defaults are the same estimator
    assert make_algorithm({"name": "grpo"}).kl_estimator == "k3_clamped"
    assert load_config(TINY).algorithm.kl_estimator == "k3_clamped"


def test_clamped_k3_is_k3_bit_for_bit_below_the_cap_values_and_gradients():
    g = torch.Generator().manual_seed(27)
    lp = (torch.randn(16, 32, generator=g) * 2).requires_grad_()
    lr = torch.randn(16, 32, generator=g) * 2
    k3, capped = kl_divergence(lp, lr, "k3"), kl_divergence(lp, lr)
    below = k3 <= 10.0
    assert bool(below.any()) and bool((~below).any())   # the draw has tokens on both sides of the cap
    assert torch.equal(capped[below], k3[below])
    assert torch.equal(capped[~below], torch.full_like(capped[~below], 10.0))
    g3, = torch.autograd.grad(k3.sum(), lp)
    gc, = torch.autograd.grad(capped.sum(), lp)
    assert torch.equal(gc[below], g3[below])            # the same gradient where k3 counts ...
    assert torch.equal(gc[~below], torch.zeros_like(gc[~below]))   # ... none from a capped token (as low_var_kl)
    # and an Algorithm's loss with the default is the k3 loss when every token is below the cap
    small = (lr + 0.3 * torch.randn(16, 32, generator=g)).detach()
    mask = torch.ones(16, 32)
    args = (small, small, small, torch.randn(16), mask, lr)
    default = make_algorithm({"name": "grpo", "kl_coef": 0.02}).policy_loss(*args)
    explicit = make_algorithm({"name": "grpo", "kl_coef": 0.02, "kl_estimator": "k3"}).policy_loss(*args)
    assert torch.equal(default[0], explicit[0]) and default[1] == explicit[1]


def test_explicit_k3_warns_once_naming_the_field_and_the_fix(config_warnings):
    load_config(TINY)                                            # the default: no warning
    assert _warnings(config_warnings, "algorithm.kl_estimator") == []
    load_config(TINY, ["algorithm.kl_coef=0", "algorithm.kl_estimator=k3"])   # no KL term: nothing to warn about
    assert _warnings(config_warnings, "algorithm.kl_estimator") == []
    cfg = load_config(TINY, ["algorithm.kl_estimator=k3"])
    assert cfg.algorithm.kl_estimator == "k3"                    # still allowed
    load_config(TINY, ["algorithm.kl_estimator=k3"])             # validated again: not repeated
    (msg,) = _warnings(config_warnings, "algorithm.kl_estimator")
    assert msg.startswith("algorithm.kl_estimator: k3 is unclamped") and "4.85e8" in msg
    assert "set algorithm.kl_estimator: k3_clamped" in msg


# ----------------------------------------------------------------------------- REINFORCE++-baseline (verl)

# groups: 0 = [1, 0] (centred +.5, -.5), 1 = [2, 2] (equal rewards: 0, 0), 2 = [3] (a group of one: verl keeps 3),
# 3 = [5] with no response token (a fully masked row). Response tokens per row: 2, 1, 1, 2, 1, 0.
# x over the 7 tokens: .5,.5 | -.5 | 0 | 0,0 | 3 -> mean 3.5 / 7 = 0.5; squared deviations 0,0,1,.25,.25,.25,6.25
# sum 8 -> unbiased var 8 / 6 = 4/3; A = (c - .5) / sqrt(4/3 + 1e-8):
#   row 0: 0;  row 1: -1/s = -0.866025;  rows 2, 3 (equal rewards): -0.5/s = -0.433013 (whitening moves them off 0,
#   as verl);  row 4 (group of one): 2.5/s = 2.165064;  row 5 (no tokens): 0.
REWARDS = torch.tensor([1.0, 0.0, 2.0, 2.0, 3.0, 5.0])
GROUPS = torch.tensor([0, 0, 1, 1, 2, 3])
LENGTHS = torch.tensor([2, 1, 1, 2, 1, 0])
S = math.sqrt(4 / 3 + 1e-8)
HAND = [0.0, -1 / S, -0.5 / S, -0.5 / S, 2.5 / S, 0.0]


def test_reinforce_pp_baseline_by_hand_with_edge_cases():
    adv = reinforce_pp_baseline_advantages(REWARDS, GROUPS, LENGTHS)
    close(adv, HAND)
    assert adv.dtype == torch.float32 and adv[5].item() == 0.0
    # each row's value is what verl's token-level function gives every one of its tokens
    T = 3
    mask = (torch.arange(T)[None] < LENGTHS[:, None]).float()
    tok = reinforce_pp_baseline_token_advantages(REWARDS, GROUPS, mask)
    close(tok, adv[:, None] * mask)
    # integer rewards come back as float32
    assert reinforce_pp_baseline_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]), torch.tensor([1, 1])).dtype \
        == torch.float32


def test_reinforce_pp_baseline_degenerate_batches():
    # one group of equal rewards: every c is 0, var 0 -> (0 - 0) * rsqrt(1e-8) = 0
    close(reinforce_pp_baseline_advantages(torch.tensor([1.0, 1.0]), torch.tensor([4, 4]), torch.tensor([3, 2])),
          [0.0, 0.0])
    # a single sample (group of one, one token): c = 2, mean 2, count 1 -> var 0 -> 0
    close(reinforce_pp_baseline_advantages(torch.tensor([2.0]), torch.tensor([0]), torch.tensor([1])), [0.0])
    # every row fully masked: no token, all 0
    close(reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([0, 0])),
          [0.0, 0.0])
    # length weighting: group [1, 0], lengths 3 and 1 -> x = .5,.5,.5,-.5: mean .25, squared deviations
    # 3 * .0625 + .5625 = .75 -> var .25; A = (.5 - .25) / .5 = 0.5 and (-.5 - .25) / .5 = -1.5
    close(reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([3, 1])),
          [0.25 / math.sqrt(0.25 + 1e-8), -0.75 / math.sqrt(0.25 + 1e-8)])
    with pytest.raises(ValueError, match="response_lengths must be"):
        reinforce_pp_baseline_advantages(REWARDS, GROUPS, LENGTHS[:3])


def test_reinforce_pp_baseline_is_registered_and_loads_from_config():
    assert "reinforce_pp_baseline" in algorithm_names()
    algo = make_algorithm({"name": "reinforce_pp_baseline"})
    assert algo.roles == ("policy",) and not algo.token_level and not algo.needs_critic
    close(algo.outcome_advantages(REWARDS, GROUPS, LENGTHS), HAND)
    with pytest.raises(ValueError, match="needs response_lengths"):
        algo.outcome_advantages(REWARDS, GROUPS)
    cfg = load_config(TINY, ["algorithm.name=reinforce_pp_baseline"])
    assert cfg.algorithm.name == "reinforce_pp_baseline"
    assert make_algorithm(cfg.algorithm.model_dump()).name == "reinforce_pp_baseline"
    # group_size 1 is allowed as in verl (each sample its own group keeps its raw reward; the whitening centres it):
    # rewards 1, 0, 1 with 1, 2, 1 tokens -> x = 1 | 0,0 | 1: mean .5, var (4 * .25) / 3 = 1/3 -> +-.5 / sqrt(1/3)
    assert load_config(TINY, ["algorithm.name=reinforce_pp_baseline", "algorithm.group_size=1"]).algorithm.group_size == 1
    s = math.sqrt(1 / 3 + 1e-8)
    close(algo.outcome_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.arange(3), torch.tensor([1, 2, 1])),
          [0.5 / s, -0.5 / s, 0.5 / s])
    # the other algorithms take (and ignore) the lengths, so one call site serves them all
    for name in ("grpo", "rloo", "reinforce_pp", "ppo", "reinforce_pp_gamma"):
        a = make_algorithm({"name": name})
        assert torch.equal(a.outcome_advantages(REWARDS, GROUPS, LENGTHS), a.outcome_advantages(REWARDS, GROUPS))


# ----------------------------------------------------------------------------- off-policy default

def test_resolve_off_policy():
    assert STALE_OFF_POLICY == "decoupled"
    assert resolve_off_policy("auto", 0) == "none"
    assert resolve_off_policy("auto", 1) == "decoupled" and resolve_off_policy("auto", 3) == "decoupled"
    for mode in ("none", "tis", "mis", "decoupled"):
        assert resolve_off_policy(mode, 0) == mode and resolve_off_policy(mode, 2) == mode


def test_off_policy_default_resolves_from_max_staleness(config_warnings):
    on = load_config(TINY)
    assert on.algorithm.off_policy == "none"                     # max_staleness 0: the synchronous loop, unchanged
    assert "off_policy" not in on.algorithm.model_fields_set     # resolved, not "given by the user"
    assert make_algorithm(on.algorithm.model_dump()).off_policy == "none"
    stale = load_config(TINY, ["rollout.max_staleness=1"])
    assert stale.algorithm.off_policy == "decoupled"            # the resolved config shows the real choice
    assert stale.algorithm.model_dump()["off_policy"] == "decoupled"
    assert '"off_policy": "decoupled"' in stale.model_dump_json(indent=2)   # as the run's config.json
    assert make_algorithm(stale.algorithm.model_dump()).off_policy == "decoupled"
    # its option applies to the resolved mode; tis_cap does not
    assert load_config(TINY, ["rollout.max_staleness=1", "algorithm.decoupled_cap=3"]).algorithm.decoupled_cap == 3
    with pytest.raises(ConfigError, match="algorithm.tis_cap: applies to off_policy tis only"):
        load_config(TINY, ["rollout.max_staleness=1", "algorithm.tis_cap=3"])
    # explicit choices stay as given, without a warning
    assert load_config(TINY, ["rollout.max_staleness=1", "algorithm.off_policy=tis"]).algorithm.off_policy == "tis"
    assert load_config(TINY, ["algorithm.off_policy=decoupled"]).algorithm.off_policy == "decoupled"
    assert load_config(TINY, ["algorithm.off_policy=none"]).algorithm.off_policy == "none"
    assert _warnings(config_warnings, "algorithm.off_policy") == []


def test_explicit_none_with_staleness_warns_naming_both_fields(config_warnings):
    cfg = load_config(TINY, ["rollout.max_staleness=2", "algorithm.off_policy=none"])
    assert cfg.algorithm.off_policy == "none"                    # allowed
    load_config(TINY, ["rollout.max_staleness=2", "algorithm.off_policy=none"])   # once
    (msg,) = _warnings(config_warnings, "algorithm.off_policy")
    assert msg.startswith("algorithm.off_policy: none with rollout.max_staleness 2")
    assert "set it to decoupled or tis" in msg and "rollout.max_staleness: 0" in msg


def test_auto_is_resolved_by_the_config_not_by_a_bare_algorithm():
    with pytest.raises(ConfigError, match="algorithm.off_policy: 'auto' is resolved from rollout.max_staleness"):
        make_algorithm({"name": "grpo", "off_policy": "auto"})
    assert make_algorithm({"name": "grpo"}).off_policy == "none"   # a bare dict without it: on-policy, as before
