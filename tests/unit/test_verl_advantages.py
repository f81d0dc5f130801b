"""Unit tests for the verl-semantics advantage helpers in rlhf_orch.algorithms (issue #14 item 4): whitening,
GAE, REINFORCE++ (with gamma, and the token-whitened baseline). Split from test_verl_losses.py, which tests
the losses; the same conventions: every expected value derived by hand beside it, verl references transcribed
as `_verl_*` helpers.
"""
import math

import pytest
import torch

from rlhf_orch.algorithms import (
    discounted_returns,
    gae_advantages,
    group_centred_rewards,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_token_advantages,
    reinforce_pp_returns,
    whiten_mean_var,
    whiten_stats,
)
from tests.unit.test_verl_losses import close


def _verl_masked_whiten(values, mask):
    """torch_functional.masked_whiten (two-pass, unbiased), in float64."""
    values, mask = values.double(), mask.double()
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum()
    var = var * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)



# ----------------------------------------------------------------------------- whitening

def test_whiten_stats_split_over_ranks_equals_whole_batch_and_verl():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 9, generator=g) * 2 + 1
    mask = (torch.rand(6, 9, generator=g) > 0.4).float()
    # stats: sum, sum of squares, count over the mask
    s, ss, n = whiten_stats(x, mask)
    close(s, float((x.double() * mask).sum()))
    close(ss, float((x.double() ** 2 * mask).sum()))
    assert float(n) == float(mask.sum())
    local = masked_whiten(x, mask)
    torch.testing.assert_close(local, (_verl_masked_whiten(x, mask) * mask).float(), atol=1e-6, rtol=0)
    # two "ranks" all-reduce (sum) their stats, then whiten their own rows with the global mean/var
    halves = (slice(0, 2), slice(2, 6))
    summed = [sum(t) for t in zip(*(whiten_stats(x[h], mask[h]) for h in halves))]
    mean, var = whiten_mean_var(*summed)
    split = torch.cat([masked_whiten(x[h], mask[h], mean, var) for h in halves])
    torch.testing.assert_close(split, local, atol=1e-6, rtol=0)
    assert torch.equal(local * (1 - mask), torch.zeros_like(local))           # zero outside the mask
    # shift_mean=False adds the mean back
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False), (local + float(mean)) * mask,
                               atol=1e-6, rtol=0)


def test_whiten_mean_var_hand_values():
    # x = [1, 2, 4]: sum 7, sumsq 21, n 3 -> mean 7/3; ss = 21 - 49/3 = 14/3; unbiased var 7/3, biased 14/9
    mean, var = whiten_mean_var(7.0, 21.0, 3.0)
    assert float(mean) == pytest.approx(7 / 3) and float(var) == pytest.approx(7 / 3)
    assert float(whiten_mean_var(7.0, 21.0, 3.0, unbiased=False)[1]) == pytest.approx(14 / 9)
    assert [float(t) for t in whiten_mean_var(0.0, 0.0, 0.0)] == [0.0, 0.0]           # empty
    assert [float(t) for t in whiten_mean_var(5.0, 25.0, 1.0)] == [5.0, 0.0]          # one token


# ----------------------------------------------------------------------------- GAE

def test_gae_one_sequence_by_hand():
    # gamma 0.9, lam 0.8 (gamma*lam = 0.72); r = [0, 0, 1], V = [0.5, 0.4, 0.6], all tokens are actions.
    #   t=2: delta = 1 + 0.9*0 - 0.6 = 0.4;              A2 = 0.4
    #   t=1: delta = 0 + 0.9*0.6 - 0.4 = 0.14;           A1 = 0.14 + 0.72*0.4 = 0.428
    #   t=0: delta = 0 + 0.9*0.4 - 0.5 = -0.14;          A0 = -0.14 + 0.72*0.428 = 0.16816
    # returns = A + V = [0.66816, 0.828, 1.0]
    adv, ret = gae_advantages(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.4, 0.6]]),
                              torch.ones(1, 3), 0.9, 0.8)
    close(adv, [[0.16816, 0.428, 0.4]])
    close(ret, [[0.66816, 0.828, 1.0]])


def test_gae_two_sequences_with_prompt_padding_and_an_observation_token():
    # Row 0: prompt at t=0, response t=1..3, padding t=4 (values 9 there must be ignored): the same numbers
    #        as the one-sequence case, shifted by one -> A = [0, 0.16816, 0.428, 0.4, 0].
    # Row 1: prompt t=0, response t=1,2, an observation token t=3 (mask 0: skipped, not a stop), response t=4.
    #   r = [0,0,0,0,2], V = [7, 1.0, 0.5, 9, 1.5]
    #   t=4: delta = 2 - 1.5 = 0.5;                            A4 = 0.5   (nextvalue <- 1.5, lastgae <- 0.5)
    #   t=3: masked: nextvalue 1.5 and lastgae 0.5 carried over V=9
    #   t=2: delta = 0 + 0.9*1.5 - 0.5 = 0.85;                 A2 = 0.85 + 0.72*0.5 = 1.21
    #   t=1: delta = 0 + 0.9*0.5 - 1.0 = -0.55;                A1 = -0.55 + 0.72*1.21 = 0.3212
    #   returns = A + V = [-, 1.3212, 1.71, -, 2.0]; masked positions are 0.
    rewards = torch.tensor([[0.0, 0, 0, 1, 0], [0, 0, 0, 0, 2]])
    values = torch.tensor([[9.0, 0.5, 0.4, 0.6, 9], [7, 1.0, 0.5, 9, 1.5]])
    mask = torch.tensor([[0.0, 1, 1, 1, 0], [0, 1, 1, 0, 1]])
    adv, ret = gae_advantages(rewards, values, mask, 0.9, 0.8)
    close(adv, [[0, 0.16816, 0.428, 0.4, 0], [0, 0.3212, 1.21, 0, 0.5]])
    close(ret, [[0, 0.66816, 0.828, 1.0, 0], [0, 1.3212, 1.71, 0, 2.0]])
    # verl whitens the advantages over the mask tokens: masked_whiten gives that (and is not applied here)
    torch.testing.assert_close(masked_whiten(adv, mask), (_verl_masked_whiten(adv, mask) * mask).float(),
                               atol=1e-6, rtol=0)


def test_gae_matches_verl_loop_on_response_only_layout():
    # verl's loop (masked variant) on response-only tensors equals ours on the same rows behind a prompt.
    g = torch.Generator().manual_seed(9)
    B, R, P = 4, 7, 3
    r, v = torch.randn(B, R, generator=g), torch.randn(B, R, generator=g)
    lengths = torch.tensor([7, 3, 1, 5])
    resp_mask = (torch.arange(R)[None] < lengths[:, None]).float()
    nextvalues, lastgaelam, rev = 0, 0, []
    for t in reversed(range(R)):
        delta = r[:, t] + 0.95 * nextvalues - v[:, t]
        lastgaelam_ = delta + 0.95 * 0.9 * lastgaelam
        nextvalues = v[:, t] * resp_mask[:, t] + (1 - resp_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * resp_mask[:, t] + (1 - resp_mask[:, t]) * lastgaelam
        rev.append(lastgaelam)
    verl_adv = torch.stack(rev[::-1], dim=1)
    pad = torch.zeros(B, P)
    adv, ret = gae_advantages(torch.cat([pad, r], 1), torch.cat([pad + 5, v], 1), torch.cat([pad, resp_mask], 1),
                              0.95, 0.9)
    assert torch.equal(adv[:, P:], verl_adv * resp_mask)
    assert torch.equal(ret[:, P:], (verl_adv + v) * resp_mask)


# ----------------------------------------------------------------------------- REINFORCE++

def test_discounted_returns_carry_through_holes_in_the_mask():
    # gamma 0.9. Row 0: response t=1..3, reward 1 on t=3 -> G = [0, 0.81, 0.9, 1, 0]
    # Row 1: response t=2..4, reward 2 on t=4 -> [0, 0, 1.62, 1.8, 2]
    # Row 2: mask [1,1,0,1,0] (a one-token observation at t=2), reward 1 on t=3: t=3 G = 1; t=2 (masked) G = 1,
    #        passed on undiscounted; t=1 G = 0.9; t=0 G = 0.81 -> [0.81, 0.9, 0, 1, 0]. (verl's loop resets G at t=2
    #        and gives [0, 0, 0, 1, 0]: the turn before the observation would get no credit.)
    # Row 3: two turns around a three-token observation, a KL-like reward -0.1 on t=0 and the outcome 2 on t=6:
    #        mask [1,1,0,0,0,1,1]: t=6 G = 2; t=5 G = 1.8; t=4..2 G = 1.8; t=1 G = 1.62; t=0 G = -0.1 + 1.458 = 1.358
    rewards = torch.tensor([[0.0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 2, 0, 0], [0, 0, 0, 1, 0, 0, 0],
                            [-0.1, 0, 0, 0, 0, 0, 2]])
    mask = torch.tensor([[0.0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0], [1, 1, 0, 1, 0, 0, 0], [1, 1, 0, 0, 0, 1, 1]])
    close(discounted_returns(rewards, mask, 0.9), [[0, 0.81, 0.9, 1, 0, 0, 0], [0, 0, 1.62, 1.8, 2, 0, 0],
                                                   [0.81, 0.9, 0, 1, 0, 0, 0], [1.358, 1.62, 0, 0, 0, 1.8, 2]])
    # Without holes the carry changes nothing, bit for bit: verl's resetting loop on rows 0 and 1
    want = torch.zeros(2, 7)
    running = torch.zeros(2)
    for t in reversed(range(7)):
        running = rewards[:2, t] + 0.9 * running
        want[:, t] = running
        running = running * mask[:2, t]
    want = torch.where(mask[:2] != 0, want, torch.zeros_like(want))
    assert torch.equal(discounted_returns(rewards[:2], mask[:2], 0.9), want)


def test_reinforce_pp_returns_whitened_over_tokens():
    # Returns on the 6 mask tokens: [0.81, 0.9, 1, 1.62, 1.8, 2]: mean 8.13/6 = 1.355;
    # squared deviations .297025 + .207025 + .126025 + .070225 + .198025 + .416025 = 1.31435, var = 1.31435/5
    rewards = torch.tensor([[0.0, 0, 0, 1, 0], [0, 0, 0, 0, 2]])
    mask = torch.tensor([[0.0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    adv, ret = reinforce_pp_returns(rewards, mask, 0.9)
    std = math.sqrt(1.31435 / 5 + 1e-8)
    vals = [0.81, 0.9, 1.0, 1.62, 1.8, 2.0]
    close(adv[mask != 0], [(v - 1.355) / std for v in vals], atol=1e-5)
    assert torch.equal(adv[mask == 0], torch.zeros(4))
    close(ret[mask != 0], vals)
    # passing the statistics in (e.g. all-reduced over ranks) gives the same
    mean, var = whiten_mean_var(*whiten_stats(ret, mask))
    torch.testing.assert_close(reinforce_pp_returns(rewards, mask, 0.9, mean, var)[0], adv, atol=0, rtol=0)


def test_reinforce_pp_baseline_token_whitening_by_hand():
    # groups: 0 = [1, 0] (centred +.5, -.5), 1 = [2, 2] (all equal: 0, 0), 2 = [3] (singleton: verl keeps 3)
    # response tokens per row: 2, 1, 1, 2, 1 -> x over the 7 tokens: .5,.5 | -.5 | 0 | 0,0 | 3
    # mean = 3.5/7 = 0.5; squared deviations 0,0,1,.25,.25,.25,6.25 = 8 -> unbiased var 8/6 = 4/3
    # A = (x - .5) / sqrt(4/3): row0 0, row1 -1/sqrt(4/3) = -0.866025, rows 2, 3 -0.433013, row4 2.165064
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0, 3.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    mask = torch.tensor([[0.0, 1, 1], [0, 1, 0], [1, 0, 0], [1, 1, 0], [0, 0, 1]])
    a = reinforce_pp_baseline_token_advantages(rewards, groups, mask)
    s = math.sqrt(4 / 3 + 1e-8)
    close(a, [[0, 0, 0], [0, -1 / s, 0], [-0.5 / s, 0, 0], [-0.5 / s, -0.5 / s, 0], [0, 0, 2.5 / s]], atol=1e-6)
    assert a.dtype == torch.float32
    # keep_singletons=False: x = .5,.5 | -.5 | 0 | 0,0 | 0: mean 1/14; squared deviations
    # 2*(3/7)^2 + (4/7)^2 + 4*(1/14)^2 = 18/49 + 16/49 + 1/49 = 5/7 -> var 5/42
    a0 = reinforce_pp_baseline_token_advantages(rewards, groups, mask, keep_singletons=False)
    s0 = math.sqrt(5 / 42 + 1e-8)
    close(a0, [[0, 3 / 7 / s0, 3 / 7 / s0], [0, -4 / 7 / s0, 0], [-1 / 14 / s0, 0, 0],
               [-1 / 14 / s0, -1 / 14 / s0, 0], [0, 0, -1 / 14 / s0]], atol=1e-6)
    close(group_centred_rewards(rewards, groups), [0.5, -0.5, 0.0, 0.0, 3.0])
    close(group_centred_rewards(rewards, groups, keep_singletons=False), [0.5, -0.5, 0.0, 0.0, 0.0])


def test_reinforce_pp_baseline_token_matches_verl_and_sample_version_is_unchanged():
    g = torch.Generator().manual_seed(10)
    N, T = 12, 6
    rewards = torch.randint(0, 3, (N,), generator=g).float()
    groups = torch.arange(N) // 4                       # 3 groups of 4
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    # verl's body: centre by group mean, tile, whiten over the mask tokens, * mask
    mean_g = torch.stack([rewards[groups == k].mean() for k in range(3)])
    scores = (rewards - mean_g[groups])[:, None].tile(1, T) * mask
    verl = _verl_masked_whiten(scores, mask) * mask
    torch.testing.assert_close(reinforce_pp_baseline_token_advantages(rewards, groups, mask), verl.float(),
                               atol=1e-5, rtol=0)
    # the per-sample estimator keeps its numbers (whitened over samples, not tokens): hand value of
    # tests/unit/test_algorithms.py::test_reinforce_pp_values
    s = math.sqrt(0.6)
    close(reinforce_pp_advantages(torch.tensor([1.0, 0, 0, 1, 2, 4]), torch.tensor([0, 0, 0, 0, 7, 7])),
          [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, -1 / s, 1 / s], atol=1e-5)
