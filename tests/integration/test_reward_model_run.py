"""A learned reward model end to end: configs/tiny_cpu_rm.yaml (exact_match weighted 1.0 + builtin:tiny-rm weighted
0.5, built in code into the run's models folder and run on CPU in a real Ray reward worker) trains 3 steps, and every
step's rewards in metrics.jsonl are the weighted sum of the rule and the reward model on the samples it scored.
PPO (configs/tiny_cpu_ppo.yaml: a critic beside each policy rank) trains on the same weighted sum with the tiny
reward model too."""
import json
import math
import os
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402
from rlhf_orch.rewards.builtin import exact_match  # noqa: E402
from rlhf_orch.rewards.check import DUMMY_RESPONSES  # noqa: E402
from rlhf_orch.rewards.model import RewardModel  # noqa: E402
from tests.baselines import baseline  # noqa: E402  (as tests.*: reward workers import this module by that name)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
QUIET = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "metrics.plots=false"]
RECORD = "RLHF_ORCH_TEST_REWARD_RECORD"


def recording_exact_match(response: str, row: dict) -> float:
    """exact_match that also appends what it scored to the file named by $RLHF_ORCH_TEST_REWARD_RECORD (the reward
    worker inherits the driver's environment on a local Ray), so the test can recompute every reward."""

    value = exact_match(response, row)
    with open(os.environ[RECORD], "a", encoding="utf-8") as f:
        f.write(json.dumps({"prompt": row["prompt"], "response": response, "value": value, "pid": os.getpid()}) + "\n")
    return value


def test_rewards_are_the_weighted_sum_of_rule_and_reward_model(tmp_path, reward_record):
    record = reward_record
    fn = "tests.integration.test_reward_model_run:recording_exact_match"
    assert launch.main(["--config", str(ROOT / "configs/tiny_cpu_rm.yaml"), f"experiment.output_dir={tmp_path}",
                        "experiment.name=rm", "experiment.steps=3", f"reward.function={fn}", *QUIET]) == 0
    metrics = [json.loads(l) for l in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert json.loads((tmp_path / "rm" / "summary.json").read_text())["status"] == "finished"

    # The reward model the workers used: built once by the driver, under <output_dir>/models/.
    (rm_dir,) = (tmp_path / "models").glob("tiny-rm-*")
    rm = RewardModel(str(rm_dir), batch_size=7)     # another batch size than the worker's: scores do not depend on it

    everything = [json.loads(l) for l in record.read_text().splitlines()]
    # launch.prepare's pre-launch check called the function here, in the driver, with its two placeholder responses.
    assert [r["response"] for r in everything if r["pid"] == os.getpid()] == list(DUMMY_RESPONSES)
    scored = [r for r in everything if r["pid"] != os.getpid()]   # the reward worker's calls
    per_step = 16 * 8                               # max_staleness 0: step s scores exactly its 128 samples, in order
    assert len(scored) == 3 * per_step
    for step, m in enumerate(metrics):
        rows = scored[step * per_step:(step + 1) * per_step]
        model = rm.score([r["prompt"] for r in rows], [r["response"] for r in rows])
        rewards = [1.0 * r["value"] + 0.5 * s for r, s in zip(rows, model)]
        assert abs(m["rollout/reward_mean"] - statistics.fmean(rewards)) < 1e-5, (m["step"], m["rollout/reward_mean"])
        assert abs(m["rollout/reward_max"] - max(rewards)) < 1e-5
        assert statistics.pstdev(model) > 1e-3       # the model really contributes (and varies by sample)
        # Each source's unweighted mean is a metric of its own.
        assert abs(m["reward/model_mean"] - statistics.fmean(model)) < 1e-5
        assert abs(m["reward/function_mean"] - statistics.fmean(r["value"] for r in rows)) < 1e-7

    # Step 1's samples come from the same initial policy as the rule-only run of tiny_cpu.yaml (same seed): the reward
    # model changes nothing upstream of scoring, and the rule's part of step 1 is the rule-only run's reward.
    base = baseline("tiny_cpu_20steps")["steps"]
    assert statistics.fmean(r["value"] for r in scored[:per_step]) == pytest.approx(base[0]["rollout/reward_mean"], abs=1e-7)


def test_ppo_with_a_critic_and_the_tiny_reward_model(tmp_path):
    # A short run (CI, CPU): 2 steps of PPO, rule (char_accuracy, weight 1.0) + builtin:tiny-rm (weight 0.5). One
    # policy + critic rank and one colocated engine, half the prompts per step and no SFT warm start keep it under a
    # minute: nearly all of it is starting the actors (the two steps take ~0.3 s each).
    assert launch.main(["--config", str(ROOT / "configs/tiny_cpu_ppo.yaml"), f"experiment.output_dir={tmp_path}",
                        "experiment.name=ppo_rm", "experiment.steps=2", "data.prompts_per_step=8",
                        "trainer.num_ranks=1", "trainer.warm_start_steps=0",
                        "engines=[{kind: hf, placement: colocated, sampling: {temperature: 1.0, max_new_tokens: 4}}]",
                        "reward.model_path=builtin:tiny-rm", "reward.function_weight=1.0", "reward.model_weight=0.5",
                        *QUIET]) == 0
    assert json.loads((tmp_path / "ppo_rm" / "summary.json").read_text())["status"] == "finished"
    metrics = [json.loads(l) for l in (tmp_path / "ppo_rm" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2]
    assert list((tmp_path / "models").glob("tiny-rm-*"))                 # the reward model was built and used
    critic = ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/explained_var",
              "critic/vf_explained_var", "critic/values_mean", "critic/values_max", "critic/values_min",
              "critic/returns_mean", "critic/returns_max", "critic/returns_min")
    for m in metrics:
        assert math.isfinite(m["reward/model_mean"]) and m["reward/model_mean"] != 0.0, m
        assert math.isfinite(m["reward/function_mean"]), m
        # The weighted sum: rollout/reward_mean = 1.0 x function mean + 0.5 x model mean (the same samples).
        assert m["rollout/reward_mean"] == pytest.approx(m["reward/function_mean"] + 0.5 * m["reward/model_mean"],
                                                         abs=1e-5), m
        assert all(math.isfinite(m[k]) for k in critic), {k: m.get(k) for k in critic}
        assert m["critic/vf_explained_var"] == m["critic/explained_var"]
        assert m["critic/values_min"] <= m["critic/values_mean"] <= m["critic/values_max"]
        assert m["critic/returns_min"] <= m["critic/returns_mean"] <= m["critic/returns_max"]
        assert math.isfinite(m["train/ppo_kl"]) and math.isfinite(m["train/loss"])
