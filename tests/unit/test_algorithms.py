"""Unit tests for rlhf_orch.algorithms: every expected value is computed by hand in the comments."""
import math

import pytest
import torch

from rlhf_orch.algorithms import (
    aggregate_token_loss,
    compute_advantages,
    entropy_from_logits,
    get_advantage_fn,
    kl_divergence,
    masked_mean,
    masked_sum,
    policy_loss,
)
from rlhf_orch.errors import ConfigError

S3, S2 = math.sqrt(3.0), math.sqrt(2.0)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype),
                               atol=atol, rtol=0)


def adv(name, rewards, groups, **kw):
    return compute_advantages(name, torch.tensor(rewards, dtype=torch.float32),
                              torch.tensor(groups, dtype=torch.long), **kw)


# ----------------------------------------------------------------------------- advantages

def test_grpo_two_groups_of_different_sizes():
    # group 0: [1,0,0,1] mean 0.5, deviations +-0.5, unbiased var = 4*0.25/3 = 1/3, std = 1/sqrt3
    #          -> +-0.5*sqrt3 = +-0.866025
    # group 7: [2,4] mean 3, deviations -1,+1, var = 2/1 = 2, std = sqrt2 -> -+1/sqrt2 = -+0.707107
    a = adv("grpo", [1, 0, 0, 1, 2, 4], [0, 0, 0, 0, 7, 7])
    close(a, [S3 / 2, -S3 / 2, -S3 / 2, S3 / 2, -1 / S2, 1 / S2])
    assert a.dtype == torch.float32 and a.shape == (6,)


def test_grpo_without_std_normalisation_only_centres():
    # Dr.GRPO: r - group mean -> [.5,-.5,-.5,.5] and [2-3, 4-3]
    a = adv("grpo", [1, 0, 0, 1, 2, 4], [0, 0, 0, 0, 7, 7], norm_by_std=False)
    close(a, [0.5, -0.5, -0.5, 0.5, -1.0, 1.0])


def test_grpo_group_of_one_is_zero():
    # group 0 = [3] alone -> 0; group 1 = [1,2]: mean 1.5, var = 2*0.25/1 = 0.5, std = 1/sqrt2,
    # -> -0.5*sqrt2, +0.5*sqrt2 = -+0.707107
    close(adv("grpo", [3, 1, 2], [0, 1, 1]), [0.0, -1 / S2, 1 / S2])
    close(adv("grpo", [5.0], [0]), [0.0])


def test_grpo_all_equal_group_is_zero_even_with_eps_zero():
    # 0.1*3/3 need not round back to 0.1; the group must still be exactly 0, not 1e-17/1e-17.
    a = adv("grpo", [0.1, 0.1, 0.1, 1, 0], [0, 0, 0, 1, 1], eps=0.0)
    close(a, [0.0, 0.0, 0.0, 1 / S2, -1 / S2])
    assert torch.equal(a[:3], torch.zeros(3))


def test_grpo_unsorted_non_contiguous_group_ids():
    # Same numbers as the two-group test, interleaved: group 7 at positions 0,2 = [2,4];
    # group -3 at positions 1,3,4,5 = [1,0,0,1].
    a = adv("grpo", [2, 1, 4, 0, 0, 1], [7, -3, 7, -3, -3, -3])
    close(a, [-1 / S2, S3 / 2, 1 / S2, -S3 / 2, -S3 / 2, S3 / 2])


def test_rloo_values():
    # group 0: r=1, others [0,0,1] mean 1/3 -> 2/3; r=0, others [1,0,1] mean 2/3 -> -2/3
    # group 7: 2 - 4 = -2, 4 - 2 = 2; singleton group 9 -> 0
    a = adv("rloo", [1, 0, 0, 1, 2, 4, 8], [0, 0, 0, 0, 7, 7, 9])
    close(a, [2 / 3, -2 / 3, -2 / 3, 2 / 3, -2.0, 2.0, 0.0])


def test_reinforce_pp_values():
    # centred: [.5,-.5,-.5,.5,-1,1], batch mean 0, unbiased var = (4*.25 + 2*1)/5 = 0.6
    # std = sqrt(0.6) = 0.774597 -> .5/.774597 = 0.645497, 1/.774597 = 1.290994
    a = adv("reinforce_pp", [1, 0, 0, 1, 2, 4], [0, 0, 0, 0, 7, 7])
    s = math.sqrt(0.6)
    close(a, [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, -1 / s, 1 / s])


def test_reinforce_pp_zero_batch_std_is_zero():
    # every group is all-equal -> all centred values 0 -> batch std 0 -> all 0 (no NaN)
    close(adv("reinforce_pp", [1, 1, 0, 0], [0, 0, 1, 1]), [0.0] * 4)
    close(adv("reinforce_pp", [3.0], [0]), [0.0])


def test_empty_batch_and_shape_mismatch():
    assert adv("grpo", [], []).shape == (0,)
    with pytest.raises(ValueError):
        compute_advantages("grpo", torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_unknown_estimator_names_field_and_choices():
    with pytest.raises(ConfigError) as e:
        get_advantage_fn("foo")
    assert str(e.value) == ("algorithm.name: unknown advantage estimator 'foo'; "
                            "use one of: grpo, reinforce_pp, rloo")


# ----------------------------------------------------------------------------- masked reductions

def test_masked_mean_and_sum():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    close(masked_sum(x, m), 3.0)                      # 1 + 2, NaN/inf off-mask ignored
    close(masked_mean(x, m), 1.5)                     # 3 / 2 tokens
    close(masked_mean(x, m, dim=1), [1.5, 0.0])       # row 1 fully masked -> 0
    close(masked_mean(x, torch.zeros_like(m)), 0.0)   # fully masked -> 0, not NaN


# ----------------------------------------------------------------------------- policy loss

def test_policy_loss_ratio_one_is_minus_advantage_on_mask():
    lp = torch.randn(2, 4)
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]], dtype=torch.float32)
    loss, m = policy_loss(lp, lp.clone(), torch.tensor([2.0, -1.0]), mask)
    # ratio 1 -> both branches = A -> loss = -A on response tokens, 0 elsewhere
    close(loss, [[0, -2, -2, 0], [0, 1, 0, 0]])
    assert m["clip_frac"] == 0.0
    assert m["ratio_mean"] == pytest.approx(1.0) and m["ratio_max"] == pytest.approx(1.0)
    assert m["approx_kl"] == pytest.approx(0.0, abs=1e-7)


def test_policy_loss_clipping_and_metrics():
    # one response token per row (column 1), eps = 0.2 -> clip range [0.8, 1.2]
    ratios = torch.tensor([1.5, 0.5, 1.5, 0.5])
    advs = torch.tensor([1.0, -1.0, -1.0, 1.0])
    old = torch.zeros(4, 2)
    lp = torch.stack([torch.zeros(4), ratios.log()], dim=1)
    mask = torch.tensor([[0.0, 1.0]] * 4)
    loss, m = policy_loss(lp, old, advs, mask, clip_eps_low=0.2)
    # r=1.5, A=+1: min(1.5, 1.2)   = 1.2  -> loss -1.2, clipped
    # r=0.5, A=-1: min(-0.5, -0.8) = -0.8 -> loss  0.8, clipped
    # r=1.5, A=-1: min(-1.5, -1.2) = -1.5 -> loss  1.5, not clipped
    # r=0.5, A=+1: min(0.5, 0.8)   = 0.5  -> loss -0.5, not clipped
    close(loss[:, 1], [-1.2, 0.8, 1.5, -0.5])
    close(loss[:, 0], [0.0] * 4)
    assert m["clip_frac"] == pytest.approx(0.5)                 # 2 of 4 tokens
    assert m["ratio_mean"] == pytest.approx(1.0)                # (1.5+.5+1.5+.5)/4
    assert m["ratio_max"] == pytest.approx(1.5)
    # k3 per token, r - 1 - ln r: 1.5 -> 0.5 - 0.405465 = 0.094535
    #                            0.5 -> -0.5 + 0.693147 = 0.193147
    assert m["approx_kl"] == pytest.approx((0.094535 + 0.193147) / 2, abs=1e-5)


def test_policy_loss_clipped_tokens_get_no_gradient():
    lp = torch.tensor([[math.log(1.5), 0.0]], requires_grad=True)
    loss, _ = policy_loss(lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
    loss.sum().backward()
    # token 0 clipped -> d/dlp of constant -1.2 = 0; token 1: d(-exp(lp)*A)/dlp = -1 at lp = 0
    close(lp.grad, [[0.0, -1.0]])


def test_policy_loss_asymmetric_clip_and_per_token_advantages():
    lp = torch.tensor([[math.log(1.25)]])
    # clip-higher 0.28: 1.25 < 1.28 -> unclipped, loss -1.25; symmetric 0.2 -> clipped at -1.2
    close(policy_loss(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                      clip_eps_low=0.2, clip_eps_high=0.28)[0], [[-1.25]])
    close(policy_loss(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))[0], [[-1.2]])


def test_policy_loss_fully_masked_rows_are_finite_zero():
    lp = torch.tensor([[0.0, 500.0], [0.0, 0.0]])     # huge log-ratio on a masked position
    mask = torch.tensor([[0.0, 0.0], [0.0, 1.0]])
    loss, m = policy_loss(lp, torch.zeros(2, 2), torch.tensor([3.0, 2.0]), mask)
    close(loss, [[0.0, 0.0], [0.0, -2.0]])
    close(aggregate_token_loss(loss[:1], mask[:1]), 0.0)
    loss0, m0 = policy_loss(lp, torch.zeros(2, 2), torch.tensor([3.0, 2.0]), torch.zeros(2, 2))
    assert torch.equal(loss0, torch.zeros(2, 2))
    assert all(v == 0.0 for v in m0.values())
    assert all(math.isfinite(v) for v in m.values())


# ----------------------------------------------------------------------------- KL

def test_kl_estimators_on_hand_values():
    lp, lr = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    close(kl_divergence(lp, lr, "k1"), [[0.693147]])           # ln 0.5 - ln 0.25 = ln 2
    close(kl_divergence(lp, lr, "k2"), [[0.240227]])           # 0.5 * ln(2)^2
    close(kl_divergence(lp, lr, "k3"), [[0.193147]])           # 0.5 - (-ln 2) - 1
    close(kl_divergence(lr, lp, "k3"), [[0.306853]])           # 2 - ln 2 - 1
    close(kl_divergence(lp, lr), [[0.193147]])                 # the default (k3_clamped) is k3 below its cap


def test_kl_k3_nonnegative_and_zero_when_equal():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=g) * 3, torch.randn(8, 16, generator=g) * 3
    assert (kl_divergence(a, b, "k3") >= 0).all()
    assert torch.equal(kl_divergence(a, a.clone(), "k3"), torch.zeros(8, 16))


def test_kl_unknown_estimator():
    with pytest.raises(ConfigError, match=r"algorithm\.kl_estimator.*'k4'.*k1, k2, k3"):
        kl_divergence(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ----------------------------------------------------------------------------- aggregation

def test_aggregate_sharded_equals_full_batch_token_mean():
    loss = torch.tensor([[1.0, 2, 3, 0], [4, 0, 0, 0], [5, 6, 0, 0], [7, 8, 9, 10]],
                        requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    # masked sums per row: 6, 4, 11, 34 -> total 55 over 10 tokens -> 5.5
    full = aggregate_token_loss(loss, mask)
    close(full, 5.5)
    (g_full,) = torch.autograd.grad(full, loss)
    # shards rows 0-1 (sum 10) and rows 2-3 (sum 45), each / 10 global tokens: 1.0 + 4.5 = 5.5
    halves = [aggregate_token_loss(loss[i:i + 2], mask[i:i + 2], num_tokens_global=10)
              for i in (0, 2)]
    close(halves[0], 1.0)
    close(halves[1], 4.5)
    close(halves[0] + halves[1], 5.5)
    (g_shard,) = torch.autograd.grad(halves[0] + halves[1], loss)
    torch.testing.assert_close(g_shard, g_full)
    # the naive local means 10/4 = 2.5 and 45/6 = 7.5 average to 5.0, which is wrong
    naive = (aggregate_token_loss(loss[:2], mask[:2])
             + aggregate_token_loss(loss[2:], mask[2:])) / 2
    close(naive, 5.0)


def test_aggregate_no_tokens_is_zero():
    loss = torch.full((2, 3), float("nan"))
    close(aggregate_token_loss(loss, torch.zeros(2, 3)), 0.0)
    close(aggregate_token_loss(loss, torch.zeros(2, 3), num_tokens_global=0), 0.0)


# ----------------------------------------------------------------------------- entropy

def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1000.0, 1000.0, -float("inf"), -float("inf")],
                            [5.0, -float("inf"), -float("inf"), -float("inf")]]])
    # uniform over 4 -> ln 4 = 1.386294; uniform over 2 (huge logits) -> ln 2; one-hot -> 0
    close(entropy_from_logits(logits), [[1.386294, 0.693147, 0.0]])
