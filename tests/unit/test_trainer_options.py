"""rlhf_orch/trainer/options.py: the policy, critic and reference arguments trainer-side actors build from the run's
typed config (issue #28), checked against the config's own fields, without Ray or DeepSpeed."""
from __future__ import annotations

from pathlib import Path

from rlhf_orch.config.loader import load_config
from rlhf_orch.trainer.options import FORWARD_KEYS, critic_options, policy_options, reference_options

ROOT = Path(__file__).resolve().parents[2]


def test_policy_options_come_from_the_trainer_algorithm_and_first_engine_sections():
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", ["trainer.lr=0.002", "trainer.packing=true",
                                                     "trainer.max_tokens_per_micro_batch=512",
                                                     "engines.0.sampling.temperature=0.7",
                                                     "engines.1.sampling.temperature=0.7"])
    p = policy_options(cfg)
    assert p["lr"] == 0.002 and p["packing"] is True and p["temperature"] == 0.7   # the trainer scores as sampled
    assert p["algorithm"] == cfg.algorithm.model_dump() and p["seed"] == cfg.experiment.seed
    assert "critic" not in p


def test_reference_shares_the_policys_forward_settings_and_reads_the_snapshot():
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", ["trainer.logprob_chunk_tokens=64"])
    r = reference_options(cfg, "/snap")
    assert r == {"state_path": "/snap", **{k: policy_options(cfg)[k] for k in FORWARD_KEYS}}
    assert r["logprob_chunk_tokens"] == 64


def test_critic_options_go_where_the_critic_lives():
    colocated = load_config(ROOT / "configs/tiny_cpu_ppo.yaml")
    assert colocated.critic.placement == "colocated"
    inside = critic_options(colocated, colocated=True)
    assert inside["warmup_steps"] == colocated.critic.warmup_steps and "model_path" in inside
    assert critic_options(colocated, colocated=False) is None   # no critic group of its own
    separate = load_config(ROOT / "configs/tiny_cpu_ppo.yaml", ["critic.placement=separate", "critic.zero_stage=3"])
    group = critic_options(separate, colocated=False)
    assert group["zero_stage"] == 3 and "warmup_steps" not in group and "model_path" not in group
    assert critic_options(separate, colocated=True) is None
