"""Algorithms as objects: the registry, config errors before any actor, the trainer-side reduction, and PPO's
token rewards and whitening split over ranks."""
import pytest
import torch

from rlhf_orch.algorithms import aggregate_token_loss
from rlhf_orch.algorithms.advantages import grpo_advantages, masked_whiten
from rlhf_orch.algorithms.base import algorithm_names, make_algorithm
from rlhf_orch.algorithms.ppo import token_rewards
from rlhf_orch.config.loader import load_config
from rlhf_orch.errors import ConfigError


def test_registry_and_roles():
    assert {"grpo", "rloo", "reinforce_pp", "ppo"} <= set(algorithm_names())
    assert make_algorithm({"name": "grpo"}).roles == ("policy",)
    assert make_algorithm({"name": "grpo", "kl_coef": 0.1}).roles == ("policy", "reference")
    assert make_algorithm({"name": "ppo"}).roles == ("policy", "critic")
    with pytest.raises(ConfigError, match="algorithm.name: unknown algorithm 'dpo'; use one of: grpo, ppo"):
        make_algorithm({"name": "dpo"})


def test_grpo_object_gives_todays_advantages():
    r = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 0.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    assert torch.equal(make_algorithm({"name": "grpo"}).outcome_advantages(r, g), grpo_advantages(r, g))
    dr = make_algorithm({"name": "grpo", "norm_adv_by_std": False}).outcome_advantages(r, g)
    assert torch.equal(dr, grpo_advantages(r, g, norm_by_std=False))
    assert torch.equal(make_algorithm({"name": "ppo"}).outcome_advantages(r, g), torch.zeros(6))


def test_token_mean_reduction_is_the_original_op():
    per_tok, mask = torch.randn(3, 7), (torch.rand(3, 7) > 0.3).float()
    algo = make_algorithm({"name": "grpo"})
    assert torch.equal(algo.aggregate(per_tok, mask, None, 11.0, None), aggregate_token_loss(per_tok, mask, 11.0))


def test_entropy_bonus_lowers_the_loss_by_coef_times_mean_entropy():
    per_tok, mask, ent = torch.zeros(2, 4), torch.ones(2, 4), torch.full((2, 4), 0.5)
    algo = make_algorithm({"name": "grpo", "entropy_coeff": 0.01})
    assert float(algo.aggregate(per_tok, mask, ent, 8.0, None)) == pytest.approx(-0.005)


def test_token_rewards_sit_on_the_last_response_token():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.float32)
    out = token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert torch.equal(out, torch.tensor([[0, 0, 2.0, 0], [0, 0, 0, -1.0], [0, 0, 0, 0]]))


def test_ppo_whitening_over_two_ranks_equals_the_whole_batch():
    torch.manual_seed(0)
    rewards, values = torch.randn(6), torch.randn(6, 9)
    mask = torch.zeros(6, 9)
    for b, (s, e) in enumerate([(2, 9), (3, 5), (1, 8), (4, 9), (2, 3), (5, 7)]):
        mask[b, s:e] = 1
    algo = make_algorithm({"name": "ppo", "gamma": 0.9, "lam": 0.8})
    whole, ret, _ = algo.token_advantages(rewards, values, mask, lambda t: t)
    # Two ranks: each all-reduce adds the other rank's sums (computed from its own shard first).
    from rlhf_orch.algorithms.advantages import gae_advantages, whiten_stats
    def stats(rows):
        adv, _ = gae_advantages(token_rewards(rewards[rows], mask[rows]), values[rows], mask[rows], 0.9, 0.8)
        return torch.stack(whiten_stats(adv, mask[rows]))
    a, b = slice(0, 2), slice(2, 6)
    part_a, _, _ = algo.token_advantages(rewards[a], values[a], mask[a], lambda t: t + stats(b))
    part_b, _, _ = algo.token_advantages(rewards[b], values[b], mask[b], lambda t: t + stats(a))
    assert torch.allclose(torch.cat([part_a, part_b]), whole, atol=1e-6)
    on = mask.bool()
    assert abs(float(whole[on].mean())) < 1e-6 and float(whole[on].std()) == pytest.approx(1.0, abs=1e-4)
    assert torch.equal(masked_whiten(whole, mask, 0.0, 1.0 - 1e-8) * mask, whole)   # zero off the mask already


def _problems(tmp_path, *overrides):
    import yaml
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"engines": [{"kind": "hf"}]}))
    with pytest.raises(ConfigError) as e:
        load_config(str(path), list(overrides))
    return str(e.value)


def test_config_errors_name_the_field(tmp_path):
    assert "algorithm.group_size: grpo compares the samples of one prompt" in _problems(tmp_path, "algorithm.group_size=1")
    assert "use one of: k1, k2, k3" in _problems(tmp_path, "algorithm.kl_estimator=k4")
    assert "algorithm.loss_agg_mode: unknown loss aggregation mode 'seq-sum'" in _problems(tmp_path, "algorithm.loss_agg_mode=seq-sum")
    assert "algorithm.loss_norm_len" in _problems(tmp_path, "algorithm.loss_agg_mode=seq-mean-token-sum-norm")
    assert "algorithm.name: unknown algorithm 'dpo'" in _problems(tmp_path, "algorithm.name=dpo")
    assert "critic does not offload" in _problems(tmp_path, "algorithm.name=ppo", "trainer.offload=true")


def test_reinforce_pp_with_gamma_is_one_module():
    from rlhf_orch.algorithms.advantages import reinforce_pp_returns
    algo = make_algorithm({"name": "reinforce_pp_gamma", "gamma": 0.9})
    assert algo.token_level and not algo.needs_critic and algo.roles == ("policy",)
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0]], dtype=torch.float32)
    rewards = torch.tensor([1.0, -1.0])
    adv, ret, _ = algo.token_advantages(rewards, None, mask, lambda t: t)
    want_adv, want_ret = reinforce_pp_returns(token_rewards(rewards, mask), mask, 0.9)
    # returns by hand: row 0 gets 0.81, 0.9, 1.0 on its three tokens; row 1 gets -1.0
    assert torch.allclose(ret, torch.tensor([[0, 0.81, 0.9, 1.0], [0, 0, -1.0, 0]]))
    assert torch.allclose(adv, want_adv) and torch.allclose(ret, want_ret)


def test_adaptive_kl_controller_follows_verl():
    from rlhf_orch.algorithms.base import KLController
    c = KLController("adaptive", kl_coef=0.1, target_kl=0.05, horizon=1000)
    c.update(0.2, 100)            # kl / target - 1 = 3, clipped to 0.2: value * (1 + 0.2 * 100 / 1000) = 0.1 * 1.02
    assert c.value == pytest.approx(0.102)
    c.update(0.025, 100)          # -0.5 clipped to -0.2: 0.102 * (1 - 0.02)
    assert c.value == pytest.approx(0.102 * 0.98)
    f = KLController("fixed", kl_coef=0.1)
    f.update(5.0, 100)
    assert f.value == 0.1
    algo = make_algorithm({"name": "ppo", "use_kl_in_reward": True, "kl_ctrl": {"type": "adaptive"}})
    assert algo.roles == ("policy", "reference", "critic") and algo.kl_ctrl.type == "adaptive"


def test_kl_in_reward_needs_a_token_level_algorithm(tmp_path):
    assert "algorithm.use_kl_in_reward: grpo" in _problems(tmp_path, "algorithm.use_kl_in_reward=true")


def test_explained_variance_over_two_ranks_equals_the_whole_batch():
    from rlhf_orch.algorithms.advantages import whiten_stats
    from rlhf_orch.algorithms.losses import explained_variance
    torch.manual_seed(1)
    values, returns = torch.randn(6, 9), torch.randn(6, 9)
    mask = (torch.rand(6, 9) > 0.3).float()
    whole = explained_variance(values, returns, mask)
    a, b = slice(0, 2), slice(2, 6)
    other = torch.stack([*whiten_stats(returns[b], mask[b]), *whiten_stats(returns[b] - values[b], mask[b])])
    assert explained_variance(values[a], returns[a], mask[a], lambda t: t + other) == pytest.approx(whole, abs=1e-12)
