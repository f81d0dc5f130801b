"""Unit tests for the verl-semantics losses and estimators in rlhf_orch.algorithms (issue #14 item 4).

Every expected value is written out and derived by hand in the comment beside it. Where a test compares
with verl, the reference is a transcription of the verl code it names (verl/trainer/ppo/core_algos.py,
verl/utils/torch_functional.py, current main), kept in this file as `_verl_*` helpers.
"""
import math

import pytest
import torch

from rlhf_orch.algorithms import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    aggregate_loss,
    aggregate_token_loss,
    entropy_bonus,
    explained_variance,
    kl_divergence,
    masked_extrema,
    policy_loss,
    value_loss,
)
from rlhf_orch.errors import ConfigError

LN2 = math.log(2.0)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ----------------------------------------------------------------------------- verl references (transcribed)

def _verl_kl_penalty_forward(logprob, ref_logprob, kl_penalty):
    """core_algos.kl_penalty_forward."""
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError


def _verl_kl_penalty(logprob, ref_logprob, kl_penalty):
    """core_algos.kl_penalty (straight-through '+' variants)."""
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    forward_score = _verl_kl_penalty_forward(logprob, ref_logprob, base)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward_score
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()


def _old_k3(logprobs, ref_logprobs):
    """kl_divergence(..., "k3") as it was before the verl names (must stay bit-identical)."""
    diff = logprobs.float() - ref_logprobs.float()
    d = (-diff).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp(min=0.0)


def _old_policy_loss(logprobs, old_logprobs, advantages, response_mask, lo=0.2, hi=None):
    """policy_loss's per-token loss as it was before clip_ratio_c (must stay bit-identical)."""
    hi = lo if hi is None else hi
    mask = response_mask.to(torch.float32)
    adv = advantages.detach().to(torch.float32)
    if adv.dim() == 1:
        adv = adv[:, None]
    log_ratio = (logprobs.float() - old_logprobs.detach().float()).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - lo, 1.0 + hi) * adv)
    return torch.where(mask != 0, per_token, torch.zeros_like(per_token))


# ----------------------------------------------------------------------------- KL estimators

def test_kl_estimator_names():
    assert KL_ESTIMATORS == ("k1", "k2", "k3", "kl", "abs", "mse", "low_var_kl", "k3_clamped",
                             "k1+", "k2+", "k3+", "kl+", "abs+", "mse+", "low_var_kl+", "k3_clamped+")


def test_kl_estimators_on_hand_values():
    # p = 0.5, ref = 0.25: d = ln 0.5 - ln 0.25 = ln 2 = 0.693147
    lp, lr = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    for name in ("k1", "kl", "abs"):
        close(kl_divergence(lp, lr, name), [[LN2]])                     # d, |d| = ln 2
    for name in ("k2", "mse"):
        close(kl_divergence(lp, lr, name), [[0.5 * LN2 ** 2]])          # 0.5 * ln(2)^2 = 0.240227
    for name in ("k3", "low_var_kl"):
        close(kl_divergence(lp, lr, name), [[0.5 + LN2 - 1]])           # x = -ln 2: e^x - x - 1 = 0.193147
    # reversed: d = -ln 2
    close(kl_divergence(lr, lp, "k1"), [[-LN2]])
    close(kl_divergence(lr, lp, "abs"), [[LN2]])
    close(kl_divergence(lr, lp, "low_var_kl"), [[2 - LN2 - 1]])         # x = ln 2: 2 - ln 2 - 1 = 0.306853


def test_low_var_kl_clamps_as_verl_and_k3_keeps_its_old_behaviour():
    lp = torch.tensor([[0.0, 0.0, 0.0]])
    lr = torch.tensor([[5.0, -30.0, -12.0]])
    # x = lr - lp:  5   -> e^5 - 5 - 1 = 148.413159 - 6 = 142.413159: k3 keeps it, low_var_kl caps at 10
    #              -30  -> clamped to -20: e^-20 + 20 - 1 = 19.000000002: k3 19, low_var_kl 10
    #              -12  -> e^-12 + 12 - 1 = 11.000006: k3 11.000006, low_var_kl 10
    close(kl_divergence(lp, lr, "k3"), [[math.exp(5) - 6, 19.0, math.exp(-12) + 11]], atol=1e-4)
    close(kl_divergence(lp, lr, "low_var_kl"), [[10.0, 10.0, 10.0]])


def test_k1_k2_k3_bit_identical_to_before_and_aliases_exact():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=g) * 3, torch.randn(8, 16, generator=g) * 3
    d = a - b
    assert torch.equal(kl_divergence(a, b, "k1"), d)
    assert torch.equal(kl_divergence(a, b, "k2"), 0.5 * d ** 2)
    assert torch.equal(kl_divergence(a, b, "k3"), _old_k3(a, b))
    assert torch.equal(kl_divergence(a, b, "kl"), kl_divergence(a, b, "k1"))
    assert torch.equal(kl_divergence(a, b, "mse"), kl_divergence(a, b, "k2"))


def test_verl_names_match_verl_kl_penalty_exactly():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, 16, generator=g) * 4, torch.randn(8, 16, generator=g) * 4
    for name in ("kl", "k1", "abs", "mse", "k2", "low_var_kl"):
        assert torch.equal(kl_divergence(a, b, name), _verl_kl_penalty_forward(a, b, name)), name


def test_straight_through_variants_value_of_named_gradient_of_k2():
    # At d = ln 2 (p = 0.5, ref = 0.25). The gradient of k2 = 0.5 d^2 w.r.t. logp is d = ln 2.
    #   k3:  value 0.193147, own gradient d/dlogp (e^(lr-lp) - (lr-lp) - 1) = 1 - e^(lr-lp) = 1 - 0.5
    #   k3+: value 0.193147, gradient ln 2;   k1+: value ln 2, gradient ln 2 (k1's own is 1)
    #   abs+: value ln 2, gradient ln 2;      k2+ = k2: value 0.240227, gradient ln 2
    lr = torch.tensor([[math.log(0.25)]])
    cases = {"k3": (0.5 + LN2 - 1, 0.5), "k3+": (0.5 + LN2 - 1, LN2), "low_var_kl+": (0.5 + LN2 - 1, LN2),
             "k1": (LN2, 1.0), "k1+": (LN2, LN2), "kl+": (LN2, LN2), "abs+": (LN2, LN2),
             "k2+": (0.5 * LN2 ** 2, LN2), "mse+": (0.5 * LN2 ** 2, LN2)}
    for name, (value, grad) in cases.items():
        lp = torch.tensor([[math.log(0.5)]], requires_grad=True)
        out = kl_divergence(lp, lr, name)
        out.sum().backward()
        close(out.detach(), [[value]])
        close(lp.grad, [[grad]])
    # Where low_var_kl is capped (x = lr - lp = 5): value 10, gradient of k2 = lp - lr = -5.
    lp = torch.tensor([[0.0]], requires_grad=True)
    out = kl_divergence(lp, torch.tensor([[5.0]]), "low_var_kl+")
    out.sum().backward()
    close(out.detach(), [[10.0]])
    close(lp.grad, [[-5.0]])


def test_straight_through_matches_verl_values_and_gradients():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(4, 8, generator=g)
    ref = torch.randn(4, 8, generator=g)
    for name in ("k1+", "kl+", "abs+", "k2+", "mse+", "low_var_kl+"):
        ours_in = base.clone().requires_grad_(True)
        verl_in = base.clone().requires_grad_(True)
        ours, theirs = kl_divergence(ours_in, ref, name), _verl_kl_penalty(verl_in, ref, name)
        assert torch.equal(ours, theirs), name
        (ours * ref).sum().backward()
        (theirs * ref).sum().backward()
        assert torch.equal(ours_in.grad, verl_in.grad), name


def test_kl_unknown_and_full_raise_config_error_with_the_list():
    names = ", ".join(KL_ESTIMATORS)
    with pytest.raises(ConfigError) as e:
        kl_divergence(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    assert str(e.value) == f"algorithm.kl_estimator: unknown KL estimator 'k4'; use one of: {names}"
    for name in ("full", "full+"):
        with pytest.raises(ConfigError, match=r"algorithm\.kl_estimator: 'full\+?'.*full distributions.*k1, k2, k3"):
            kl_divergence(torch.zeros(1, 1), torch.zeros(1, 1), name)
    with pytest.raises(ConfigError, match="unknown KL estimator 'k3\\+\\+'"):
        kl_divergence(torch.zeros(1, 1), torch.zeros(1, 1), "k3++")


# ----------------------------------------------------------------------------- loss aggregation

# Rows are sequences. Masked row sums S_i: 1+2+3 = 6, 4, 5+6 = 11, 7+8+9+10 = 34 (55 in all);
# loss tokens n_i: 3, 1, 2, 4 (10 in all); row 4 has no loss token (and NaN where masked).
LOSS = [[1.0, 2, 3, 0], [4, 0, 0, 0], [5, 6, 0, 0], [7, 8, 9, 10], [float("nan"), 1, 1, 1]]
MASK = [[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
EXPECTED = {
    "token-mean": 5.5,                                   # 55 / 10 tokens
    "seq-mean-token-sum": 13.75,                         # 55 / 4 sequences (row 4 has no token)
    "seq-mean-token-mean": 5.0,                          # (6/3 + 4/1 + 11/2 + 34/4) / 4 = 20 / 4
    "seq-mean-token-sum-norm": 1.71875,                  # 13.75 / norm_len 8
}


def test_loss_agg_modes_names():
    assert LOSS_AGG_MODES == ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_loss_hand_values(mode):
    loss, mask = torch.tensor(LOSS), torch.tensor(MASK)
    close(aggregate_loss(loss, mask, mode, norm_len=8), EXPECTED[mode])
    # the same with the global counts given explicitly (all of them are this batch's here)
    close(aggregate_loss(loss, mask, mode, num_tokens_global=10, num_seqs_global=4, norm_len=8), EXPECTED[mode])


def test_token_mean_is_bit_identical_to_aggregate_token_loss():
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.4).float()
    assert torch.equal(aggregate_loss(loss, mask), aggregate_token_loss(loss, mask))
    assert torch.equal(aggregate_loss(loss, mask, "token-mean", num_tokens_global=123.0),
                       aggregate_token_loss(loss, mask, 123.0))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_the_full_batch_value_and_gradient(mode):
    loss = torch.tensor(LOSS, requires_grad=True)
    mask = torch.tensor(MASK)
    full = aggregate_loss(loss, mask, mode, norm_len=8)
    (g_full,) = torch.autograd.grad(full, loss)
    # Micro-batches [0], [1, 2], [3, 4], each trimmed to its own longest row as the trainer does, each
    # divided by the GLOBAL counts (10 tokens, 4 sequences) and the constant norm_len:
    #   seq-mean-token-sum:  6/4 + (4+11)/4 + 34/4 = 1.5 + 3.75 + 8.5 = 13.75
    #   seq-mean-token-mean: 2/4 + (4+5.5)/4 + 8.5/4 = 0.5 + 2.375 + 2.125 = 5.0
    parts = []
    for rows, width in (([0], 3), ([1, 2], 2), ([3, 4], 4)):
        parts.append(aggregate_loss(loss[rows, :width], mask[rows, :width], mode,
                                    num_tokens_global=10, num_seqs_global=4, norm_len=8))
    close(sum(parts), EXPECTED[mode])
    (g_parts,) = torch.autograd.grad(sum(parts), loss)
    torch.testing.assert_close(g_parts, g_full, atol=1e-7, rtol=0)
    # local counts instead (the mean of per-micro-batch means) give a different number, e.g.
    # seq-mean-token-mean: (2 + (4 + 5.5)/2 + 8.5/1) / 3 = 5.0833 instead of 5.0
    naive = sum(aggregate_loss(loss[r], mask[r], mode, norm_len=8) for r in ([0], [1, 2], [3, 4])) / 3
    assert abs(float(naive.detach()) - EXPECTED[mode]) > 0.05


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_random_split_over_ranks_and_micro_batches_sums_exactly(mode):
    g = torch.Generator().manual_seed(4)
    B, T = 13, 11
    loss = torch.randn(B, T, generator=g)
    start = torch.randint(0, 4, (B,), generator=g)
    length = torch.randint(0, 8, (B,), generator=g)
    pos = torch.arange(T)
    mask = ((pos >= start[:, None]) & (pos < (start + length)[:, None])).float()   # prompt, response, padding
    n_tok, n_seq = float(mask.sum()), float((mask.sum(1) > 0).sum())
    full = aggregate_loss(loss, mask, mode, norm_len=7)
    world = 2
    total = 0.0
    for rank in range(world):
        shard = list(range(rank, B, world))
        for i in range(0, len(shard), 2):                       # micro-batches of 2 rows
            rows = shard[i:i + 2]
            total = total + aggregate_loss(loss[rows], mask[rows], mode, n_tok, n_seq, norm_len=7)
    torch.testing.assert_close(total, full, atol=1e-6, rtol=0)


def test_aggregate_loss_errors_and_empty():
    loss, mask = torch.tensor(LOSS), torch.tensor(MASK)
    with pytest.raises(ConfigError) as e:
        aggregate_loss(loss, mask, "seq-mean")
    assert str(e.value) == ("algorithm.loss_agg_mode: unknown loss aggregation mode 'seq-mean'; use one of: "
                            "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="norm_len"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")
    for mode in LOSS_AGG_MODES:                      # no loss token anywhere -> 0, not NaN
        close(aggregate_loss(loss, torch.zeros_like(mask), mode, norm_len=8), 0.0)
        close(aggregate_loss(loss, torch.zeros_like(mask), mode, 0, 0, norm_len=8), 0.0)


# ----------------------------------------------------------------------------- dual-clip PPO

def _one_token_rows(ratios, advs):
    lp = torch.tensor(ratios).log()[:, None]
    return lp, torch.zeros_like(lp), torch.tensor(advs), torch.ones_like(lp)


def test_dual_clip_on_negative_advantages():
    # eps = 0.2 (clip range [0.8, 1.2]), clip_ratio_c = 3. Per token, with L1 = max(-rA, -clip(r)A):
    #   r=5,  A=-1: L1 = max(5, 1.2) = 5;     A<0: min(5, -A*c = 3) = 3       (dual clip decides)
    #   r=2,  A=-1: L1 = max(2, 1.2) = 2;     min(2, 3) = 2
    #   r=5,  A=+1: L1 = max(-5, -1.2) = -1.2 (clipped; A >= 0: no dual clip)
    #   r=.5, A=-1: L1 = max(.5, .8) = .8     (clipped); min(.8, 3) = .8
    #   r=5,  A=-2: L1 = max(10, 2.4) = 10;   min(10, 6) = 6                  (dual clip decides)
    lp, old, adv, mask = _one_token_rows([5.0, 2.0, 5.0, 0.5, 5.0], [-1.0, -1.0, 1.0, -1.0, -2.0])
    loss, m = policy_loss(lp, old, adv, mask, 0.2, clip_ratio_c=3.0)
    close(loss[:, 0], [3.0, 2.0, -1.2, 0.8, 6.0], atol=1e-5)
    # clipped (pg_clipfrac = clip_frac): rows 2 and 3 -> 2/5; dual-clipped (pg_clipfrac_lower): rows 0, 4 -> 2/5
    assert m["clip_frac"] == pytest.approx(0.4) and m["pg_clipfrac"] == m["clip_frac"]
    assert m["pg_clipfrac_lower"] == pytest.approx(0.4)
    # Without the dual clip rows 0 and 4 keep 5 and 10, and pg_clipfrac_lower is 0.
    loss_none, m_none = policy_loss(lp, old, adv, mask, 0.2)
    close(loss_none[:, 0], [5.0, 2.0, -1.2, 0.8, 10.0], atol=1e-5)
    assert m_none["pg_clipfrac_lower"] == 0.0 and m_none["pg_clipfrac"] == pytest.approx(0.4)


def test_dual_clipped_tokens_get_no_gradient():
    # r = 5, A = -1: loss = 3 (constant) -> gradient 0. r = 2, A = -1: loss = -A * exp(lp) -> d/dlp = 2.
    lp = torch.tensor([[math.log(5.0)], [math.log(2.0)]], requires_grad=True)
    loss, _ = policy_loss(lp, torch.zeros(2, 1), torch.tensor([-1.0, -1.0]), torch.ones(2, 1), clip_ratio_c=3.0)
    loss.sum().backward()
    close(lp.grad, [[0.0], [2.0]], atol=1e-5)


def test_dual_clip_matches_verl_compute_policy_loss():
    g = torch.Generator().manual_seed(5)
    lp, old = torch.randn(6, 10, generator=g) * 0.8, torch.randn(6, 10, generator=g) * 0.8
    adv = torch.randn(6, 10, generator=g)
    mask = (torch.rand(6, 10, generator=g) > 0.3).float()
    ours, m = policy_loss(lp, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)
    # verl's compute_policy_loss body, per token
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - 0.2, 1 + 0.28)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -adv * 3.0
    verl = torch.where(adv < 0, torch.min(pg3, clip1), clip1)
    assert torch.equal(ours, verl * mask)
    lower = (torch.gt(clip1, pg3) * (adv < 0).float() * mask).sum() / mask.sum()
    assert m["pg_clipfrac_lower"] == pytest.approx(float(lower), abs=1e-7)
    assert m["pg_clipfrac"] == pytest.approx(float((torch.gt(pg2, pg1).float() * mask).sum() / mask.sum()), abs=1e-7)


def test_no_dual_clip_is_bit_identical_to_before():
    g = torch.Generator().manual_seed(6)
    lp, old = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    adv = torch.randn(5, generator=g)
    mask = (torch.rand(5, 7, generator=g) > 0.3).float()
    loss, m = policy_loss(lp, old, adv, mask, 0.2, 0.28)
    assert torch.equal(loss, _old_policy_loss(lp, old, adv, mask, 0.2, 0.28))
    assert torch.equal(loss, policy_loss(lp, old, adv, mask, 0.2, 0.28, clip_ratio_c=None)[0])
    assert {"clip_frac", "ratio_mean", "ratio_max", "approx_kl", "ppo_kl", "pg_clipfrac", "pg_clipfrac_lower"} == set(m)


def test_clip_ratio_c_must_exceed_one():
    lp, old, adv, mask = _one_token_rows([1.0], [1.0])
    for c in (1.0, 0.5, -3.0):
        with pytest.raises(ConfigError, match=r"algorithm\.clip_ratio_c: .*> 1"):
            policy_loss(lp, old, adv, mask, clip_ratio_c=c)


# ----------------------------------------------------------------------------- entropy bonus

def test_entropy_bonus():
    ent = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    close(entropy_bonus(ent, mask, 0.01), 0.02)                                  # 0.01 * (1+2+3)/3
    close(entropy_bonus(ent, mask, 0.01, "seq-mean-token-mean"), 0.0225)         # 0.01 * (1.5 + 3)/2
    close(entropy_bonus(ent, mask, 0.01, "seq-mean-token-sum-norm", norm_len=2), 0.015)    # 0.01 * (3+3)/2/2
    close(entropy_bonus(ent, mask, 0.01, num_tokens_global=6), 0.01)            # 0.01 * 6 / 6 global tokens
    assert torch.equal(entropy_bonus(torch.full((2, 3), float("nan")), mask, 0.0), torch.tensor(0.0))
    # subtracting the bonus equals subtracting coef * entropy per token before aggregating (linear)
    per_tok = torch.tensor([[0.5, -1.0, 0.0], [2.0, 0.0, 0.0]])
    for mode in LOSS_AGG_MODES:
        a = aggregate_loss(per_tok, mask, mode, norm_len=3) - entropy_bonus(ent, mask, 0.1, mode, norm_len=3)
        b = aggregate_loss(per_tok - 0.1 * torch.nan_to_num(ent), mask, mode, norm_len=3)
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)


# ----------------------------------------------------------------------------- value loss

def test_value_loss_clipping_by_hand():
    # cliprange 0.2; vclip = clamp(vpred, old - 0.2, old + 0.2); L1 = (vpred - R)^2, L2 = (vclip - R)^2
    #   vpred 1.0, old .5, R 1: vclip .7,  L1 0,    L2 .09 -> max .09  (clipped: L2 > L1)
    #   vpred .6,  old .5, R 1: vclip .6,  L1 .16,  L2 .16 -> .16
    #   vpred 0,   old .5, R 1: vclip .3,  L1 1,    L2 .49 -> 1
    #   vpred .2,  old .5, R 0: vclip .3,  L1 .04,  L2 .09 -> .09  (clipped)
    # token-mean: 0.5 * (.09 + .16 + 1 + .09) / 4 = 0.5 * 0.335 = 0.1675; vf_clipfrac 2/4
    vpred = torch.tensor([[1.0, 0.6, 0.0, 0.2]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    ret = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    mask = torch.ones(1, 4)
    loss, m = value_loss(vpred, old, ret, mask, 0.2)
    close(loss, 0.1675)
    assert m["vf_loss"] == pytest.approx(0.1675) and m["vf_clipfrac"] == pytest.approx(0.5)
    assert m["vpred_mean"] == pytest.approx(0.45)                           # (1 + .6 + 0 + .2) / 4
    loss.backward()
    # clipped tokens: constant -> 0; others d/dv 0.5 * (v - R)^2 / 4 = (v - R) / 4: -.4/4 = -.1, -1/4 = -.25
    close(vpred.grad, [[0.0, -0.1, -0.25, 0.0]])
    # no clip: 0.5 * (0 + .16 + 1 + .04) / 4 = 0.15
    close(value_loss(vpred, old, ret, mask, None)[0], 0.15)


def test_value_loss_matches_verl_and_sums_over_micro_batches():
    g = torch.Generator().manual_seed(7)
    vpred, old, ret = (torch.randn(6, 8, generator=g) for _ in range(3))
    mask = (torch.rand(6, 8, generator=g) > 0.3).float()
    for mode in LOSS_AGG_MODES:
        loss, m = value_loss(vpred, old, ret, mask, 0.5, mode, norm_len=8)
        clipped = torch.max(torch.min(vpred, old + 0.5), old - 0.5)            # verl_F.clip_by_value
        l1, l2 = (vpred - ret) ** 2, (clipped - ret) ** 2
        ref = 0.5 * aggregate_loss(torch.max(l1, l2), mask, mode, norm_len=8)
        assert torch.equal(loss, ref)
        assert m["vf_clipfrac"] == pytest.approx(float(((l2 > l1).float() * mask).sum() / mask.sum()))
        n_tok, n_seq = float(mask.sum()), float((mask.sum(1) > 0).sum())
        parts = sum(value_loss(vpred[r], old[r], ret[r], mask[r], 0.5, mode, n_tok, n_seq, 8)[0]
                    for r in (slice(0, 1), slice(1, 4), slice(4, 6)))
        torch.testing.assert_close(parts, loss, atol=1e-6, rtol=0)
    with pytest.raises(ConfigError, match=r"critic\.cliprange_value: must be >= 0"):
        value_loss(vpred, old, ret, mask, -0.1)


def test_explained_variance():
    # values [1,2,3], returns [1,2,4] on the mask (the 4th token is masked out):
    # Var(R - V) = Var([0,0,1]) = (1/9+1/9+4/9)/2 = 1/3; Var(R) = Var([1,2,4]) = (16/9+1/9+25/9)/2 = 7/3
    # EV = 1 - (1/3) / (7/3 + 1e-5) = 0.857143
    v = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    r = torch.tensor([[1.0, 2.0, 4.0, -100.0]])
    assert explained_variance(v, r, torch.tensor([[1.0, 1, 1, 0]])) == pytest.approx(1 - (1 / 3) / (7 / 3 + 1e-5))
    assert explained_variance(r, r, torch.ones(1, 4)) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- metrics under verl's names

def test_ppo_kl_is_verls_k1_mean_of_old_minus_new():
    # log-ratios logp - logp_old on the mask: 0.5, -0.25, 30 (clamped to 20, as verl clamps negative_approx_kl);
    # the 4th token (log-ratio 7) is masked out. ppo_kl = mean(old - new) = -(0.5 - 0.25 + 20) / 3 = -6.75.
    old = torch.zeros(1, 4)
    lp = torch.tensor([[0.5, -0.25, 30.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    _, m = policy_loss(lp, old, torch.tensor([1.0]), mask)
    assert m["ppo_kl"] == pytest.approx(-6.75)
    # The new policy lowered both tokens' logprobs by 0.1: ppo_kl = +0.1 (approx_kl, k3, is 0.0048374 there:
    # exp(-0.1) - 1 + 0.1); ratio 1 (no change) gives exactly 0.
    lp = torch.tensor([[-1.1, -2.1]])
    _, m = policy_loss(lp, torch.tensor([[-1.0, -2.0]]), torch.tensor([1.0]), torch.ones(1, 2))
    assert m["ppo_kl"] == pytest.approx(0.1, abs=1e-6) and m["approx_kl"] == pytest.approx(0.0048374, abs=1e-6)
    assert policy_loss(lp, lp.clone(), torch.tensor([1.0]), torch.ones(1, 2))[1]["ppo_kl"] == 0.0
    # Against the transcription of verl's compute_policy_loss_vanilla on random inputs:
    #   negative_approx_kl = clamp(log_prob - old_log_prob, -20, 20); ppo_kl = masked_mean(-negative_approx_kl, mask)
    g = torch.Generator().manual_seed(11)
    lp, old = torch.randn(5, 7, generator=g) * 3, torch.randn(5, 7, generator=g) * 3
    mask = (torch.rand(5, 7, generator=g) > 0.3).float()
    want = float((-(lp - old).clamp(-20, 20) * mask).sum() / mask.sum())
    assert policy_loss(lp, old, torch.randn(5, generator=g), mask)[1]["ppo_kl"] == pytest.approx(want, abs=1e-6)


def test_masked_extrema():
    # Off-mask entries (100, -100 and the masked 0) do not count: max 5, min -7.
    x = torch.tensor([[5.0, -1.0, 2.0, 100.0], [0.0, 3.0, -7.0, -100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    assert masked_extrema(x, mask) == (5.0, -7.0)
    assert masked_extrema(x, torch.zeros_like(mask)) == (0.0, 0.0)       # no token: 0, as masked_mean
    # Split over two "ranks": the MAX all-reduce of (max, -min) gives the whole batch's on each.
    def shard(rows):
        on = mask[rows] != 0
        v = x[rows][on].double()
        return torch.stack([v.max(), -v.min()]) if v.numel() else torch.full((2,), float("-inf"), dtype=torch.float64)
    a, b = slice(0, 1), slice(1, 2)
    assert masked_extrema(x[a], mask[a], lambda t: torch.maximum(t, shard(b))) == (5.0, -7.0)
    assert masked_extrema(x[b], mask[b], lambda t: torch.maximum(t, shard(a))) == (5.0, -7.0)
    # A rank with no response token contributes -inf, which the other rank's values beat.
    empty = torch.zeros(1, 4)
    assert masked_extrema(x[a], empty, lambda t: torch.maximum(t, shard(b))) == (3.0, -7.0)
