"""Algorithms as objects: the registry, config errors before any actor (every required role usable), the
trainer-side reduction, PPO's token rewards and whitening split over ranks, and the token step's metrics under
verl's names (values/returns max and min over two gloo ranks)."""
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
    assert ("algorithm.loss_agg_mode: unknown loss aggregation mode 'seq-sum'; use one of: token-mean, seq-mean-token-sum, "
            "seq-mean-token-mean, seq-mean-token-sum-norm") in _problems(tmp_path, "algorithm.loss_agg_mode=seq-sum")
    assert "algorithm.loss_norm_len" in _problems(tmp_path, "algorithm.loss_agg_mode=seq-mean-token-sum-norm")
    assert "algorithm.name: unknown algorithm 'dpo'" in _problems(tmp_path, "algorithm.name=dpo")
    # The colocated critic offloads with the policy now; only a critic without a ZeRO optimizer cannot.
    assert "critic.zero_stage: a colocated critic leaves the GPU" in _problems(
        tmp_path, "algorithm.name=ppo", "trainer.offload=true", "critic.zero_stage=0")


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


# ---- every role the algorithm needs is usable, checked at config load -------------------------------------------
def test_required_roles_that_cannot_work_are_config_errors(tmp_path):
    from rlhf_orch.models import TinyModelSpec
    from rlhf_orch.models.reward_tiny import ensure_reward_model_dir
    rm = ensure_reward_model_dir(TinyModelSpec(), tmp_path / "models", seed=0)
    msg = _problems(tmp_path, "algorithm.name=ppo", f"critic.model_path={rm}")
    assert ("critic.model_path: the folder holds a LlamaForSequenceClassification, not a causal LM "
            "(AutoModelForCausalLM)") in msg and "remove critic.model_path to start the critic from model.path" in msg
    msg = _problems(tmp_path, "algorithm.name=ppo", f"critic.model_path={tmp_path / 'nope'}")
    assert "critic.model_path: " in msg and "is not a local folder (rlhf_orch does not download models)" in msg
    assert "critic.model_path: 'builtin:tiny-llama': built-in models are built for model.path only" in _problems(
        tmp_path, "algorithm.name=ppo", "critic.model_path=builtin:tiny-llama")
    (tmp_path / "empty").mkdir()
    assert "has no config.json, so it is not a Hugging Face model folder" in _problems(
        tmp_path, "algorithm.name=ppo", f"critic.model_path={tmp_path / 'empty'}")
    # No reward source that counts (PPO's critic would regress zeros).
    assert ("reward.function_weight: 0 and no reward.model_path, so every reward would be 0"
            in _problems(tmp_path, "algorithm.name=ppo", "reward.function_weight=0"))
    assert ("reward.model_weight: 0 and reward.function is null, so every reward would be 0"
            in _problems(tmp_path, "algorithm.name=ppo", "reward.function=null", "reward.model_path=builtin:tiny-rm",
                         "reward.model_weight=0"))
    assert "reward.model_path: no reward source" in _problems(tmp_path, "algorithm.name=ppo", "reward.function=null")
    # A KL reference whose placement settings cannot work as asked.
    assert "reference.num_workers: 3 workers but a step has only trainer.num_ranks = 2 shards" in _problems(
        tmp_path, "algorithm.name=ppo", "algorithm.kl_coef=0.1", "reference.placement=separate", "reference.num_workers=3")
    assert "reference.num_workers: applies to reference.placement: separate only" in _problems(
        tmp_path, "algorithm.kl_coef=0.1", "reference.num_workers=2")


def test_a_critic_folder_of_a_causal_lm_is_accepted_and_vocabularies_must_cover_the_policy(tmp_path, tiny_model_dir):
    import json
    import shutil
    import yaml
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"engines": [{"kind": "hf"}]}))
    cfg = load_config(str(path), ["algorithm.name=ppo", f"critic.model_path={tiny_model_dir}",
                                  "reward.function=null", "reward.model_path=builtin:tiny-rm"])   # the model alone
    assert cfg.critic.model_path == tiny_model_dir
    small = tmp_path / "small"
    shutil.copytree(tiny_model_dir, small)
    conf = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**conf, "vocab_size": 10}))
    msg = _problems(tmp_path, "algorithm.name=ppo", f"critic.model_path={small}")
    assert f"critic.model_path: its vocabulary (10 tokens) is smaller than the policy's ({conf['vocab_size']})" in msg
    for f in small.glob("*.safetensors"):
        f.unlink()
    (small / "config.json").write_text(json.dumps(conf))
    assert "critic.model_path: the folder has no weights" in _problems(tmp_path, "algorithm.name=ppo",
                                                                       f"critic.model_path={small}")


def test_group_size_one_is_refused_for_every_group_algorithm(tmp_path):
    for name in ("grpo", "rloo", "reinforce_pp"):
        msg = _problems(tmp_path, f"algorithm.name={name}", "algorithm.group_size=1")
        assert f"algorithm.group_size: {name} compares the samples of one prompt" in msg
    for name in ("ppo", "reinforce_pp_gamma"):   # no groups: a group of one is fine
        assert make_algorithm({"name": name, "group_size": 1}).problems() == []


# ---- verl's metric names from the token-level step (issue 14 item 4) --------------------------------------------
# Three rows, gamma = lam = 1: GAE's returns are the outcome reward on every response token (delta telescopes),
# so over the mask the returns are {2, 2, -1, -1, .5, .5, .5}: max 2, min -1; the values on the mask are
# {.5, 1.5, -.5, 3, 1, 0, 2.5}: max 3, min -0.5 (the 9s are off the mask). REINFORCE++ with gamma 0.9:
# row 0 [_, 1.8, 2, _], row 1 [_, _, -.9, -1], row 2 [_, .405, .45, .5]: max 2, min -1.
MASK = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.float32)
REWARDS = torch.tensor([2.0, -1.0, 0.5])
VALUES = torch.tensor([[9, 0.5, 1.5, 9], [-9, 9, -0.5, 3.0], [9, 1.0, 0.0, 2.5]])


class _Policy:
    """What token_level_step uses of a policy trainer."""
    def __init__(self, settings):
        self.device, self.algo = torch.device("cpu"), make_algorithm(settings)

    def train_step(self, batch, num_tokens_global):
        return {"train/loss": 0.0}


class _Critic:
    steps = 0

    def __init__(self, values):
        self._values = values

    def values(self, batch):
        return self._values.clone()

    def train_step(self, batch, returns, values, num_tokens_global):
        return {"critic/vf_loss": 0.0}


def _batch(rows):
    from rlhf_orch.types import TrainBatch
    mask = MASK[rows]
    return TrainBatch(torch.zeros(mask.shape, dtype=torch.long), torch.ones(mask.shape, dtype=torch.long), mask,
                      torch.zeros(len(mask)), torch.zeros(mask.shape), rewards=REWARDS[rows])


def _step_metrics(rows):
    from rlhf_orch.trainer.token_step import token_level_step
    ppo = token_level_step(_Policy({"name": "ppo"}), _Critic(VALUES[rows]), 0, _batch(rows), 7.0)
    rpp = token_level_step(_Policy({"name": "reinforce_pp_gamma", "gamma": 0.9}), None, 0, _batch(rows), 7.0)
    return ppo, rpp


def test_token_step_reports_verl_critic_and_returns_statistics():
    from rlhf_orch.algorithms.losses import explained_variance
    ppo, rpp = _step_metrics(slice(0, 3))
    assert ppo["critic/values_max"] == 3.0 and ppo["critic/values_min"] == -0.5
    assert ppo["critic/returns_max"] == pytest.approx(2.0) and ppo["critic/returns_min"] == pytest.approx(-1.0)
    ret = REWARDS[:, None] * MASK
    assert ppo["critic/vf_explained_var"] == ppo["critic/explained_var"]
    assert ppo["critic/vf_explained_var"] == pytest.approx(explained_variance(VALUES, ret, MASK), abs=1e-6)
    assert rpp["reinforce_pp/returns_max"] == pytest.approx(2.0) and rpp["reinforce_pp/returns_min"] == pytest.approx(-1.0)
    # The algorithm alone, with a plain summing function (no max): the shard's own numbers.
    algo = make_algorithm({"name": "reinforce_pp_gamma", "gamma": 0.9})
    _, _, m = algo.token_advantages(REWARDS[1:], None, MASK[1:], lambda t: t)
    assert m["reinforce_pp/returns_max"] == pytest.approx(0.5) and m["reinforce_pp/returns_min"] == pytest.approx(-1.0)


def _two_ranks(rank, port, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.save(_step_metrics([slice(0, 1), slice(1, 3)][rank]), f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_max_and_min_are_the_whole_batch_over_two_ranks(tmp_path):
    """Rank 0 holds row 0, rank 1 rows 1-2: each rank's values are another's than the batch's extremes, and after
    the MAX all-reduce both report the whole batch's; the driver's merge (min for *_min, max for *_max) keeps them."""
    import socket
    import torch.multiprocessing as mp
    from actors.trainer import _average
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_ranks, args=(port, str(tmp_path)), nprocs=2)
    (ppo0, rpp0), (ppo1, rpp1) = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    whole_ppo, whole_rpp = _step_metrics(slice(0, 3))
    keys = ("critic/values_max", "critic/values_min", "critic/returns_max", "critic/returns_min")
    for key in keys:
        assert ppo0[key] == ppo1[key] == _average([ppo0, ppo1])[key] == pytest.approx(whole_ppo[key], abs=1e-6), key
    for key in ("reinforce_pp/returns_max", "reinforce_pp/returns_min"):
        assert rpp0[key] == rpp1[key] == _average([rpp0, rpp1])[key] == pytest.approx(whole_rpp[key], abs=1e-6), key
    assert ppo0["critic/vf_explained_var"] == pytest.approx(whole_ppo["critic/vf_explained_var"], abs=1e-6)


def test_driver_merges_max_and_min_keys_across_ranks():
    from actors.trainer import _average
    out = _average([{"critic/values_max": 1.0, "critic/values_min": -2.0, "critic/values_mean": 0.0},
                    {"critic/values_max": 3.0, "critic/values_min": 0.5, "critic/values_mean": 1.0}])
    assert out == {"critic/values_max": 3.0, "critic/values_min": -2.0, "critic/values_mean": 0.5}
