"""Reward model scoring (rlhf_orch/rewards/model.py), the weighted sum (scorer.py), the built-in tiny-rm and the
reward section's validation. A tiny Llama sequence classifier built in code; CPU, no Ray."""
from pathlib import Path

import pytest
import torch

from rlhf_orch.config import load_config
from rlhf_orch.errors import ConfigError, RewardError
from rlhf_orch.models import TinyModelSpec, build_tokenizer
from rlhf_orch.models.reward_tiny import build_reward_model, ensure_reward_model_dir
from rlhf_orch.rewards import NO_FUNCTION
from rlhf_orch.rewards.builtin import exact_match
from rlhf_orch.rewards.model import RewardModel, last_token_index
from rlhf_orch.rewards.scorer import RewardScorer

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["3+4=", "1+2=", "4+4=", "0+0=", "2+1="]
RESPONSES = ["7", "3<eos>", "12 ab", "", "9"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return str(ensure_reward_model_dir(TinyModelSpec(), tmp_path_factory.mktemp("models"), seed=0))


def test_scores_are_deterministic(rm_dir):
    a = RewardModel(rm_dir).score(PROMPTS, RESPONSES)
    b = RewardModel(rm_dir).score(PROMPTS, RESPONSES)
    assert a == b and len(a) == len(PROMPTS) and all(isinstance(v, float) for v in a)
    assert len(set(a)) == len(a)    # different texts, different scores (the model is random but not constant)


@pytest.mark.parametrize("batch_size", [1, 2, 16])
@pytest.mark.parametrize("side", ["right", "left"])
def test_batch_size_and_padding_side_do_not_change_a_score(rm_dir, batch_size, side):
    alone = [RewardModel(rm_dir).score([p], [r])[0] for p, r in zip(PROMPTS, RESPONSES)]
    got = RewardModel(rm_dir, batch_size=batch_size, padding_side=side).score(PROMPTS, RESPONSES)
    assert got == pytest.approx(alone, abs=1e-6)


def test_score_is_the_logit_of_the_last_token(rm_dir):
    rm = RewardModel(rm_dir)
    ids = rm.encode("3+4=", "7 ab")
    with torch.no_grad():
        hidden = rm.model.model(input_ids=torch.tensor([ids])).last_hidden_state
        per_token = rm.model.score(hidden)[0, :, 0]                       # the head's logit at every position
        hf_pooled = rm.model(input_ids=torch.tensor([ids])).logits[0, 0]   # HF's own pooling (no padding here)
    assert rm.score(["3+4="], ["7 ab"])[0] == pytest.approx(float(per_token[-1]), abs=1e-6)
    assert float(hf_pooled) == pytest.approx(float(per_token[-1]), abs=1e-6)
    # Causal model: the score of each prefix is the logit at that prefix's last token.
    text = "3+4=7 ab"
    prefixes = RewardModel(rm_dir, batch_size=4).score([text[:k] for k in range(1, len(text) + 1)], [""] * len(text))
    assert prefixes == pytest.approx(per_token.tolist(), abs=1e-6)


def test_last_token_index_for_both_padding_sides():
    right = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]])
    assert last_token_index(right).tolist() == [2, 0, 3]
    assert last_token_index(left).tolist() == [3, 3, 3]


def test_builtin_tiny_rm_is_a_one_label_classifier_built_once_without_touching_the_rng(tmp_path):
    state = torch.random.get_rng_state()
    path = ensure_reward_model_dir(TinyModelSpec(), tmp_path, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_reward_model_dir(TinyModelSpec(), tmp_path, seed=3) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp     # reused, not rebuilt
    rm = RewardModel(str(path))
    assert type(rm.model).__name__ == "LlamaForSequenceClassification" and rm.model.config.num_labels == 1
    assert not rm.model.training and not any(p.requires_grad for p in rm.model.parameters())
    assert rm.tokenizer.get_vocab() == build_tokenizer().get_vocab()    # the policy's built-in tokenizer


ITEMS = [(r, {"prompt": p, "answer": a}) for p, r, a in zip(PROMPTS, RESPONSES, ["7", "3", "8", "0", "3"])]


def test_weighted_sum_of_function_and_model(rm_dir):
    rm = RewardModel(rm_dir)
    model = rm.score(PROMPTS, RESPONSES)
    rule = [exact_match(r, row) for r, row in ITEMS]
    parts = RewardScorer("rlhf_orch.rewards.builtin:exact_match", rm, 2.0, -0.5).score_parts(ITEMS)
    assert parts["function"] == rule and parts["model"] == model
    assert parts["rewards"] == [2.0 * f - 0.5 * m for f, m in zip(rule, model)]
    only_model = RewardScorer(NO_FUNCTION, rm, 1.0, 3.0).score_parts(ITEMS)
    assert "function" not in only_model and only_model["rewards"] == [3.0 * m for m in model]


def test_without_a_model_or_with_model_weight_zero_rewards_are_the_rules_bit_for_bit(rm_dir):
    rule = [exact_match(r, row) for r, row in ITEMS]
    assert RewardScorer("rlhf_orch.rewards.builtin:exact_match").score(ITEMS) == rule
    with_zero = RewardScorer("rlhf_orch.rewards.builtin:exact_match", RewardModel(rm_dir), 1.0, 0.0).score(ITEMS)
    assert [v.hex() for v in with_zero] == [float(v).hex() for v in rule]


def test_no_source_at_all_is_refused():
    with pytest.raises(RewardError, match="no reward source"):
        RewardScorer(None)


# ---- validation, before any actor starts ---------------------------------------------------------------------
def problems(overrides):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/tiny_cpu.yaml", overrides)
    return e.value.problems


def test_config_with_a_reward_model_loads(rm_dir):
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [f"reward.model_path={rm_dir}", "reward.model_weight=0.5"])
    assert cfg.reward.model_path == rm_dir and cfg.reward.model_weight == 0.5 and cfg.reward.device == "cpu"
    default = load_config(ROOT / "configs/tiny_cpu.yaml").reward
    assert default.model_path is None and default.function_weight == 1.0   # no model configured: as before
    model_only = load_config(ROOT / "configs/tiny_cpu_rm.yaml", ["reward.function=null"]).reward
    assert model_only.function == NO_FUNCTION and model_only.model_path == "builtin:tiny-rm"
    assert load_config(ROOT / "configs/tiny_cpu_rm.yaml", ["reward.function="]).reward.function == NO_FUNCTION


def test_missing_model_folder(tmp_path):
    (msg,) = problems([f"reward.model_path={tmp_path / 'nope'}"])
    assert msg.startswith("reward.model_path: folder not found;")


def test_causal_lm_folder_is_not_a_reward_model(tiny_model_dir):
    (msg,) = problems([f"reward.model_path={tiny_model_dir}"])
    assert msg.startswith("reward.model_path: the folder holds a LlamaForCausalLM, not a sequence classifier "
                          "(AutoModelForSequenceClassification with num_labels=1);"), msg


def test_classifier_with_two_labels_is_refused(tmp_path):
    model = build_reward_model(TinyModelSpec(), len(build_tokenizer()), seed=0)
    model.config.num_labels = 2
    model.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    (msg,) = problems([f"reward.model_path={tmp_path}"])
    assert msg.startswith("reward.model_path: the classifier has num_labels=2;"), msg
    with pytest.raises(RewardError, match="num_labels=2"):
        RewardModel(str(tmp_path))


def test_folder_without_tokenizer(tmp_path):
    build_reward_model(TinyModelSpec(), len(build_tokenizer()), seed=0).save_pretrained(tmp_path)
    (msg,) = problems([f"reward.model_path={tmp_path}"])
    assert msg.startswith("reward.model_path: the folder has no tokenizer"), msg


def test_unknown_builtin_reward_model():
    (msg,) = problems(["reward.model_path=builtin:big-rm"])
    assert msg.startswith("reward.model_path: unknown built-in reward model; the only one is builtin:tiny-rm")


def test_no_reward_source_and_both_weights_zero():
    (msg,) = problems(["reward.function=null"])
    assert msg.startswith("reward.model_path: no reward source: reward.function is null and reward.model_path is not set;")
    (msg,) = problems(["reward.model_path=builtin:tiny-rm", "reward.function_weight=0", "reward.model_weight=0"])
    assert msg.startswith("reward.model_weight: reward.function_weight and reward.model_weight are both 0")
    # Any other weights are allowed, negative ones included (a penalty).
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", ["reward.model_path=builtin:tiny-rm", "reward.function_weight=0",
                                                       "reward.model_weight=-2"])
    assert cfg.reward.model_weight == -2.0
