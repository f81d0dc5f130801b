"""Unit tests for rlhf_orch.algorithms.off_policy: expected values computed by hand in comments."""
import math

import pytest
import torch

from rlhf_orch.algorithms.off_policy import (
    OFF_POLICY_MODES,
    off_policy_weights,
    staleness_histogram,
)
from rlhf_orch.errors import ConfigError

L3, LQ, L10 = math.log(3.0), math.log(0.25), math.log(10.0)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype),
                               atol=atol, rtol=0)


def batch(gaps, mask):
    """old - behaviour = gaps; behaviour logprobs are an arbitrary -1.3 so only the gap matters."""
    gap = torch.tensor(gaps, dtype=torch.float32)
    behaviour = torch.full_like(gap, -1.3)
    return behaviour + gap, behaviour, torch.tensor(mask, dtype=torch.float32)


# Row 0: gaps log3, log0.25, 0, log10 -> w = 3, 0.25, 1, 10 (all on the mask).
# Row 1: gaps 0, log3, 99, 99 with the last two off the mask -> w = 1, 3 on the mask.
GAPS = [[L3, LQ, 0.0, L10], [0.0, L3, 99.0, 99.0]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0]]
# Common metrics over the 6 tokens: w = 3, .25, 1, 10, 1, 3 -> mean 18.25/6, max 10;
# |gap| = log3 + log4 + 0 + log10 + 0 + log3 = 2*log3 + log4 + log10 over 6 tokens.
W_MEAN = 18.25 / 6
GAP_MEAN = (2 * L3 + math.log(4.0) + L10) / 6


def check_common(m):
    assert m["is_weight_mean"] == pytest.approx(W_MEAN, abs=1e-5)
    assert m["is_weight_max"] == pytest.approx(10.0, abs=1e-4)
    assert m["logprob_gap_mean"] == pytest.approx(GAP_MEAN, abs=1e-5)


def test_none_is_ones_on_mask():
    w, m = off_policy_weights(*batch(GAPS, MASK), "none")
    close(w, MASK)
    assert w.dtype == torch.float32
    check_common(m)
    assert m["is_truncated_frac"] == 0.0 and m["is_masked_frac"] == 0.0


def test_tis_truncates_at_cap():
    # cap 2: 3 -> 2, .25, 1, 10 -> 2 | 1, 3 -> 2; truncated: 3, 10, 3 = 3 of 6 tokens.
    w, m = off_policy_weights(*batch(GAPS, MASK), "tis", tis_cap=2.0)
    close(w, [[2.0, 0.25, 1.0, 2.0], [1.0, 2.0, 0.0, 0.0]])
    check_common(m)
    assert m["is_truncated_frac"] == pytest.approx(0.5)
    assert m["is_masked_frac"] == 0.0
    # cap 5: only 10 is truncated -> 1/6.
    w, m = off_policy_weights(*batch(GAPS, MASK), "tis", tis_cap=5.0)
    close(w, [[3.0, 0.25, 1.0, 5.0], [1.0, 3.0, 0.0, 0.0]])
    assert m["is_truncated_frac"] == pytest.approx(1 / 6)


def test_mis_masks_outside_band():
    # band [0.5, 2]: 3 out, .25 out, 1 in, 10 out | 1 in, 3 out -> 4 of 6 masked.
    w, m = off_policy_weights(*batch(GAPS, MASK), "mis", mis_low=0.5, mis_high=2.0)
    close(w, [[0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    check_common(m)
    assert m["is_masked_frac"] == pytest.approx(4 / 6)
    assert m["is_truncated_frac"] == 0.0
    # band [0.25, 3] keeps its bounds (inclusive, up to float rounding of exp(log x)): only 10 out.
    w, m = off_policy_weights(*batch(GAPS, MASK), "mis", mis_low=0.2499, mis_high=3.0001)
    close(w, [[3.0, 0.25, 1.0, 0.0], [1.0, 3.0, 0.0, 0.0]])
    assert m["is_masked_frac"] == pytest.approx(1 / 6)


def test_mis_bounds_inclusive_exactly():
    # w equal to mis_low is kept: set mis_low to the float32 value exp(log 0.5) actually gives.
    g = math.log(0.5)
    w, m = off_policy_weights(*batch([[g, 0.0]], [[1, 1]]), "mis", mis_low=float(
        torch.exp(torch.tensor(g, dtype=torch.float32))), mis_high=2.0)
    close(w, [[0.5, 1.0]])
    assert m["is_masked_frac"] == 0.0


def test_decoupled_masks_above_cap():
    # cap 5: only 10 masked -> 1/6; the small weight .25 is kept (no lower bound).
    w, m = off_policy_weights(*batch(GAPS, MASK), "decoupled", decoupled_cap=5.0)
    close(w, [[3.0, 0.25, 1.0, 0.0], [1.0, 3.0, 0.0, 0.0]])
    check_common(m)
    assert m["is_masked_frac"] == pytest.approx(1 / 6)
    assert m["is_truncated_frac"] == 0.0
    # cap 2: 3, 10, 3 masked -> 1/2.
    w, m = off_policy_weights(*batch(GAPS, MASK), "decoupled", decoupled_cap=2.0)
    close(w, [[0.0, 0.25, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert m["is_masked_frac"] == pytest.approx(0.5)


def test_huge_gap_is_clamped_not_inf():
    # gap 50 is clamped to 20: w = exp(20), finite; tis caps it, decoupled masks it.
    w, m = off_policy_weights(*batch([[50.0]], [[1]]), "tis")
    close(w, [[2.0]])
    assert m["is_weight_max"] == pytest.approx(math.exp(20.0), rel=1e-5)
    w, _ = off_policy_weights(*batch([[50.0]], [[1]]), "decoupled")
    close(w, [[0.0]])


@pytest.mark.parametrize("mode", OFF_POLICY_MODES)
def test_fully_masked_rows_and_garbage_off_mask(mode):
    old = torch.tensor([[0.0, float("nan")], [float("inf"), -float("inf")]])
    beh = torch.tensor([[float("-inf"), 1.0], [float("inf"), 0.0]])
    w, m = off_policy_weights(old, beh, torch.zeros(2, 2), mode)
    close(w, torch.zeros(2, 2))
    assert set(m) == {"is_weight_mean", "is_weight_max", "is_truncated_frac", "is_masked_frac",
                      "logprob_gap_mean"}
    assert all(v == 0.0 for v in m.values())
    # One fully masked row beside a live one: that row is 0, metrics from the live row only.
    old2, beh2, mask2 = batch([[L3, L3], [99.0, -99.0]], [[1, 1], [0, 0]])
    w, m = off_policy_weights(old2, beh2, mask2, mode)
    assert torch.isfinite(w).all() and (w[1] == 0).all()
    assert m["is_weight_mean"] == pytest.approx(3.0, abs=1e-5)
    assert m["logprob_gap_mean"] == pytest.approx(L3, abs=1e-6)


@pytest.mark.parametrize("mode", OFF_POLICY_MODES)
def test_weights_are_detached(mode):
    old, beh, mask = batch(GAPS, MASK)
    old.requires_grad_(True)
    beh.requires_grad_(True)
    w, _ = off_policy_weights(old, beh, mask, mode)
    assert not w.requires_grad and w.grad_fn is None


def test_bf16_inputs_give_float32_weights():
    old, beh, mask = batch(GAPS, MASK)
    w, _ = off_policy_weights(old.bfloat16(), beh.bfloat16(), mask, "tis")
    assert w.dtype == torch.float32


@pytest.mark.parametrize("kwargs, field", [
    (dict(mode="is"), "algorithm.off_policy"),
    (dict(mode="tis", tis_cap=0.9), "algorithm.tis_cap"),
    (dict(mode="tis", tis_cap=float("nan")), "algorithm.tis_cap"),
    (dict(mode="mis", mis_low=1.0, mis_high=2.0), "algorithm.mis_low/mis_high"),
    (dict(mode="mis", mis_low=0.5, mis_high=1.0), "algorithm.mis_low/mis_high"),
    (dict(mode="mis", mis_low=-0.1, mis_high=2.0), "algorithm.mis_low/mis_high"),
    (dict(mode="decoupled", decoupled_cap=1.0), "algorithm.decoupled_cap"),
    (dict(mode="decoupled", decoupled_cap=0.5), "algorithm.decoupled_cap"),
])
def test_bad_settings_raise_config_error(kwargs, field):
    mode = kwargs.pop("mode")
    with pytest.raises(ConfigError, match=field):
        off_policy_weights(*batch(GAPS, MASK), mode, **kwargs)


def test_tis_cap_one_is_allowed():
    w, _ = off_policy_weights(*batch(GAPS, MASK), "tis", tis_cap=1.0)
    close(w, [[1.0, 0.25, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])


# ----------------------------------------------------------------------------- staleness

def test_staleness_histogram_counts():
    # trained version 7; on-mask versions 7, 6, 6, 5 | 7 (off-mask 0 and 100 are ignored)
    # -> lags 0, 1, 1, 2, 0: counts {0: 2, 1: 2, 2: 1, 3: 0}, max 2, mean 4/5.
    versions = torch.tensor([[7, 6, 6, 5], [7, 0, 100, 0]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]])
    h = staleness_histogram(versions, mask, trained_version=7, max_lag=3)
    assert h == {"staleness/lag_0": 2.0, "staleness/lag_1": 2.0, "staleness/lag_2": 1.0,
                 "staleness/lag_3": 0.0, "staleness/max_lag": 2.0,
                 "staleness/mean_lag": pytest.approx(0.8)}
    assert all(isinstance(v, float) for v in h.values())


def test_staleness_histogram_empty_mask():
    h = staleness_histogram(torch.tensor([[3, 9]]), torch.zeros(1, 2), trained_version=5,
                            max_lag=1)
    assert h == {"staleness/lag_0": 0.0, "staleness/lag_1": 0.0, "staleness/max_lag": 0.0,
                 "staleness/mean_lag": 0.0}


def test_staleness_lag_above_max_raises():
    # version 2 with trained 7 -> lag 5 > max_lag 3.
    with pytest.raises(ValueError, match=r"5.*3"):
        staleness_histogram(torch.tensor([[7, 2]]), torch.ones(1, 2), trained_version=7,
                            max_lag=3)


def test_staleness_negative_lag_raises():
    # version 9 with trained 7 -> lag -2 < 0.
    with pytest.raises(ValueError, match=r"-2 < 0"):
        staleness_histogram(torch.tensor([[7, 9]]), torch.ones(1, 2), trained_version=7,
                            max_lag=3)
