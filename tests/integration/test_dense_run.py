"""Dense rewards end to end on CPU (real Ray actors, two DeepSpeed ranks each with a policy and a critic, two hf
engines): per-token values travel from the reward workers through the rollout manager into the trainer's returns.

- A dense function that puts the whole reward on the last token must train exactly as the scalar function (every
  step's rewards, losses, critic figures and sync digests to 1e-6): the dense path adds nothing of its own.
- One that puts half on the first token and half on the last has the same sum (so the same step-1 rewards and the
  same samples) but different returns: the critic's targets change, so the values did reach the trainer.
"""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
QUIET = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "metrics.plots=false"]
KEYS = ("rollout/reward_mean", "train/loss", "critic/vf_loss", "critic/returns_mean", "critic/explained_var",
        "ppo/adv_raw_mean", "train/kl")


def _run(tmp_path, name, fn, steps=3):
    assert launch.main(["--config", str(ROOT / "configs/tiny_cpu_ppo.yaml"), f"experiment.output_dir={tmp_path}",
                        f"experiment.name={name}", f"experiment.steps={steps}", f"reward.function=tests.ppo_rewards:{fn}",
                        *QUIET]) == 0
    return [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_dense_rewards_reach_the_critic_and_the_last_token_case_is_the_outcome_run(tmp_path):
    scalar = _run(tmp_path, "scalar", "starts_with_odd_digit")
    last = _run(tmp_path, "last", "starts_with_odd_digit_on_last_token")
    split = _run(tmp_path, "split", "starts_with_odd_digit_split", steps=1)
    assert 0 < scalar[0]["rollout/reward_mean"] < 1, "every sample scored the same: this test would prove nothing"
    for want, got in zip(scalar, last):
        for key in KEYS:
            assert abs(got[key] - want[key]) <= 1e-6, (got["step"], key, got[key], want[key])
        assert got["sync/digest"] == want["sync/digest"]
    # the same sum per sample: the same rewards; half of each reward comes before the last token: lower returns
    assert split[0]["rollout/reward_mean"] == scalar[0]["rollout/reward_mean"]
    assert split[0]["critic/returns_mean"] < scalar[0]["critic/returns_mean"] - 1e-3, (split[0], scalar[0])
