"""Dense rewards (one value per response token): the function's contract and its errors, how the scorer weighs a
dense function with a reward model, where the values land in the train batch, what outcome and token-level
algorithms make of them, and the checks before launch. No Ray (the PPO runs are in tests/integration/test_ppo_run.py)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlhf_orch.algorithms.base import make_algorithm
from rlhf_orch.config import load_config
from rlhf_orch.errors import ConfigError, RewardError
from rlhf_orch.rewards import batched, dense, is_dense, with_response_ids
from rlhf_orch.rewards.builtin import exact_match_token_cost
from rlhf_orch.rewards.calls import RewardFunction
from rlhf_orch.rewards.check import check_reward_function
from rlhf_orch.rewards.scorer import RewardScorer
from rlhf_orch.rollout.batching import assemble, token_reward_tensor
from rlhf_orch.rollout.scheduler import Group
from rlhf_orch.types import Prompt, Sample

HERE = __name__
ROW = {"prompt": "3+4=", "answer": "7"}


@dense
def per_token_index(response: str, row: dict) -> list[float]:
    """0.5, 1.5, 2.5, ...: each token's position, so a misplaced value shows."""
    return [i + 0.5 for i in range(len(row["response_ids"]))]


@dense
def one_short(response: str, row: dict) -> list[float]:
    return [1.0] * (len(row["response_ids"]) - 1)


@dense
def scalar_instead(response: str, row: dict) -> float:
    return 1.0


@dense
def has_nan(response: str, row: dict):
    return np.array([0.0, float("nan")])


@dense
@batched
def batch_dense(responses: list[str], rows: list[dict]) -> list[list[float]]:
    return [[float(t) for t in row["response_ids"]] for row in rows]


# ---- the function's contract ----------------------------------------------------------------------------------------
def test_dense_functions_return_one_float_per_token():
    items = [("7", with_response_ids(ROW, [11, 12, 13])), ("", with_response_ids(ROW, []))]
    call = RewardFunction(per_token_index, "m:per_token_index")
    assert call.dense and call.form == "dense per-sample sync"
    assert call(items) == [[0.5, 1.5, 2.5], []]
    assert RewardFunction(batch_dense, "m:batch_dense")(items) == [[11.0, 12.0, 13.0], []]
    # the numbers of the built-in example: -0.01 per token, exact_match on the last
    assert exact_match_token_cost("7", with_response_ids(ROW, [5, 6])) == [-0.01, 1.0 - 0.01]
    assert exact_match_token_cost("8", with_response_ids(ROW, [5])) == [-0.01]
    assert "response_ids" not in ROW          # the dataset's row is never edited


@pytest.mark.parametrize("fn, msg", [
    (one_short, "returned 2 values for prompt '3+4='; a dense function returns one finite float per response token: "
                "a list of len(row['response_ids']) = 3 values"),
    (scalar_instead, "returned 1.0 for prompt '3+4='; a dense function returns one finite float per response token: "
                     "a list of len(row['response_ids']) = 3 values (a plain per-response reward: drop reward.dense / "
                     "the dense decorator)"),
])
def test_wrong_shapes_name_the_function_and_the_fix(fn, msg):
    with pytest.raises(RewardError) as e:
        RewardFunction(fn, f"m:{fn.__name__}")([("7", with_response_ids(ROW, [1, 2, 3]))])
    assert str(e.value) == f"reward.function m:{fn.__name__} {msg}"


def test_a_non_finite_token_value_is_named_with_its_position():
    with pytest.raises(RewardError, match=r"returned nan for response token 1 of prompt '3\+4='"):
        RewardFunction(has_nan, "m:has_nan")([("7", with_response_ids(ROW, [1, 2]))])


def test_plain_functions_are_unchanged_by_the_dense_option_being_off():
    from rlhf_orch.rewards.builtin import exact_match
    assert not is_dense(exact_match) and is_dense(exact_match_token_cost)
    assert RewardFunction(exact_match, "m:exact_match")([("7", ROW), ("8", ROW)]) == [1.0, 0.0]


# ---- the scorer -----------------------------------------------------------------------------------------------------
class _Scores:
    """A stand-in reward model (the real one: tests/unit/test_reward_model.py, test_reward_model_run.py)."""

    def score(self, prompts, responses):
        return [10.0 * len(r) for r in responses]


def test_scorer_weighs_tokens_and_puts_the_model_score_on_the_last_token():
    items = [("ab", with_response_ids(ROW, [1, 2])), ("", with_response_ids(ROW, []))]
    s = RewardScorer(f"{HERE}:per_token_index", _Scores(), function_weight=2.0, model_weight=0.5)
    parts = s.score_parts(items)
    assert parts["function"] == [0.5 + 1.5, 0.0]                      # the sum of the function's token values
    assert parts["model"] == [20.0, 0.0]
    assert parts["rewards"] == [2.0 * 2.0 + 0.5 * 20.0, 0.0]          # fw * sum + mw * rm, as for a scalar function
    assert parts["token_rewards"] == [[2.0 * 0.5, 2.0 * 1.5 + 0.5 * 20.0], []]
    plain = RewardScorer("rlhf_orch.rewards.builtin:exact_match").score_parts([("7", ROW)])
    assert plain == {"rewards": [1.0], "function": [1.0]}             # no token_rewards without a dense function


# ---- the train batch ------------------------------------------------------------------------------------------------
def _group(gid, rewards, token_rewards, responses):
    prompt = Prompt(index=gid, text=f"p{gid}", token_ids=[7] * (gid + 1), row={}, source=(0, gid))
    samples = [Sample(gid, [7] * (gid + 1), list(r), [-0.1] * len(r), "stop", 0) for r in responses]
    return Group(gid=gid, prompt=prompt, admitted_version=0, deadline=1, samples=samples, rewards=rewards,
                 token_rewards=token_rewards)


def test_batch_rewards_sit_at_their_tokens_and_outcome_advantages_use_the_sums():
    g0 = _group(0, [3.0, 0.5], [[1.0, 2.0], [0.5]], [[4, 5], [6]])
    g1 = _group(1, [0.0, 1.0], [[0.0, 0.0, 0.0], [1.0]], [[4, 5, 6], [6]])
    grpo = make_algorithm({"name": "grpo", "group_size": 2})
    sb = assemble([g0, g1], 0, 0, grpo, 0, num_ranks=2, gen_seconds=1.0)
    r = torch.cat([s.rewards for s in sb.shards])
    # prompt lengths 1 and 2: sample 0's tokens at positions 1-2, sample 2's at 2-4
    want = torch.tensor([[0, 1.0, 2.0, 0, 0], [0, 0.5, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1.0, 0, 0]])
    assert torch.equal(r, want)
    assert torch.equal((r != 0).float() * torch.cat([s.response_mask for s in sb.shards]), (r != 0).float())
    plain = assemble([_group(0, [3.0, 0.5], None, [[4, 5], [6]]), _group(1, [0.0, 1.0], None, [[4, 5, 6], [6]])],
                     0, 0, grpo, 0, num_ranks=2, gen_seconds=1.0)
    assert torch.equal(torch.cat([s.advantages for s in sb.shards]), torch.cat([s.advantages for s in plain.shards]))
    assert torch.equal(torch.cat([s.rewards for s in plain.shards]), torch.tensor([3.0, 0.5, 0.0, 1.0]))
    assert sb.metrics["rollout/reward_mean"] == plain.metrics["rollout/reward_mean"] == 4.5 / 4


def test_a_dense_list_that_does_not_match_its_response_is_refused():
    s = [Sample(0, [1], [2, 3], [0.0, 0.0], "stop", 0)]
    with pytest.raises(ValueError, match="1 dense rewards for 2 response tokens"):
        token_reward_tensor(s, [[1.0]], torch.ones(1, 3))


# ---- token-level algorithms -----------------------------------------------------------------------------------------
def _token_adv(name, rewards, values, mask, **kw):
    algo = make_algorithm({"name": name, "group_size": 1, **kw})
    return algo.token_advantages(rewards, values, mask, lambda t: t)


def test_ppo_on_dense_rewards_by_hand():
    # One sample, prompt of 1 token, response of 3: rewards 0.5, -0.25, 1.0; values 0; gamma 0.5, lam 1:
    # returns_3 = 1.0; returns_2 = -0.25 + 0.5 * 1.0 = 0.25; returns_1 = 0.5 + 0.5 * 0.25 = 0.625 (= the GAE
    # advantages before whitening, the values being 0).
    mask = torch.tensor([[0.0, 1, 1, 1]])
    rewards = torch.tensor([[0.0, 0.5, -0.25, 1.0]])
    adv, returns, m = _token_adv("ppo", rewards, torch.zeros(1, 4), mask, gamma=0.5, lam=1.0)
    assert torch.allclose(returns, torch.tensor([[0.0, 0.625, 0.25, 1.0]]))
    mean = (0.625 + 0.25 + 1.0) / 3
    assert m["ppo/adv_raw_mean"] == pytest.approx(mean)
    # reinforce_pp_gamma: the same discounted returns, whitened
    adv2, returns2, _ = _token_adv("reinforce_pp_gamma", rewards, None, mask, gamma=0.5)
    assert torch.allclose(returns2, returns)


def test_dense_on_the_last_token_is_the_outcome_reward():
    mask = torch.tensor([[0.0, 1, 1, 0], [0, 1, 1, 1]])
    values = torch.tensor([[0.0, 0.3, -0.2, 0.0], [0.0, 0.1, 0.4, 0.2]])
    outcome = torch.tensor([1.0, -2.0])
    dense_last = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, -2.0]])
    for name in ("ppo", "reinforce_pp_gamma"):
        a, r, _ = _token_adv(name, outcome, values, mask, gamma=0.9, lam=0.8)
        b, s, _ = _token_adv(name, dense_last, values, mask, gamma=0.9, lam=0.8)
        assert torch.equal(a, b) and torch.equal(r, s), name


# ---- before launch --------------------------------------------------------------------------------------------------
def test_config_reads_the_decorator_and_refuses_dense_without_a_function(tmp_path):
    base = ["engines=[{kind: hf}]", "trainer.num_ranks=1", f"experiment.output_dir={tmp_path}"]
    cfg = load_config(None, [*base, "reward.function=rlhf_orch.rewards.builtin:exact_match_token_cost"])
    assert cfg.reward.dense
    assert not load_config(None, base).reward.dense
    with pytest.raises(ConfigError, match="reward.dense: true needs a reward.function"):
        load_config(None, [*base, "reward.function=null", "reward.model_path=builtin:tiny-rm", "reward.dense=true"])


def test_the_prelaunch_check_gives_a_dense_function_token_ids():
    rows = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "1+2=", "answer": "3"}]
    reward = SimpleNamespace(function=f"{HERE}:per_token_index", batch=False, timeout_s=None, dense=True)
    check_reward_function(reward, rows, tokenize=lambda text: [ord(c) for c in text])
    check_reward_function(reward, rows)     # no tokenizer: one id per word
    bad = SimpleNamespace(function=f"{HERE}:one_short", batch=False, timeout_s=None, dense=True)
    with pytest.raises(RewardError, match=r"one_short returned 16 values for prompt '1\+2='; a dense function .*"
                                          r"\(found before launch: the dense per-sample sync function"):
        check_reward_function(bad, rows, tokenize=lambda text: [ord(c) for c in text])
