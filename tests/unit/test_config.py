"""Config loading: every shipped config validates; bad input gives one clear line per problem."""
from pathlib import Path

import pytest

from rlhf_orch.config import ExperimentConfig, load_config
from rlhf_orch.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert CONFIGS, "configs/ must hold at least one experiment"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, ExperimentConfig)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# Run:"), f"{path.name} must start with the command that runs it"


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def problems(path, overrides=None):
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return e.value.problems


def test_malformed_yaml_names_line(tmp_path):
    p = write(tmp_path, "trainer:\n  lr: 1e-3\n engines: [\n")
    (msg,) = problems(p)
    assert "malformed YAML at line" in msg and "c.yaml" in msg


def test_unknown_key_suggests_the_right_one(tmp_path):
    p = write(tmp_path, "trainer:\n  num_rank: 2\nengines: [{kind: hf}]\n")
    (msg,) = problems(p)
    assert msg.startswith("trainer.num_rank: unknown key") and "did you mean 'num_ranks'" in msg


def test_unknown_engine_kind(tmp_path):
    p = write(tmp_path, "engines: [{kind: tgi}]\n")
    (msg,) = problems(p)
    assert msg == "engines.0.kind: unknown engine kind 'tgi'; use one of: hf, vllm, sglang"


def test_reward_path_that_does_not_import(tmp_path):
    p = write(tmp_path, "engines: [{kind: hf}]\nreward: {function: 'no_such_pkg.mod:fn'}\n")
    (msg,) = problems(p)
    assert msg.startswith("reward.function: cannot import module 'no_such_pkg.mod'")


def test_reward_with_wrong_signature(tmp_path):
    p = write(tmp_path, "engines: [{kind: hf}]\nreward: {function: 'os.path:join'}\n")
    # os.path.join(response, row) binds fine; a zero-arg function must not
    load_config(p)
    p2 = write(tmp_path, "engines: [{kind: hf}]\nreward: {function: 'os:getcwd'}\n")
    (msg,) = problems(p2)
    assert "must accept (response: str, row: dict)" in msg


def test_all_problems_reported_at_once(tmp_path):
    p = write(tmp_path, "trainer: {num_ranks: 1, lr: -1}\nengines:\n  - {kind: hf, placement: colocated, count: 2}\n")
    msgs = problems(p, ["algorithm.group_size=0"])
    joined = "\n".join(msgs)
    assert "trainer.lr" in joined and "algorithm.group_size" in joined
    assert len(msgs) >= 2


def test_colocated_engines_need_trainer_devices(tmp_path):
    p = write(tmp_path, "trainer: {num_ranks: 1}\nengines:\n  - {kind: hf, placement: colocated, count: 2}\n")
    (msg,) = problems(p)
    assert msg.startswith("engines: 2 colocated engines but trainer.num_ranks is 1")


def test_vllm_on_cpu_is_rejected(tmp_path):
    p = write(tmp_path, "engines: [{kind: vllm}]\n")
    (msg,) = problems(p)
    assert msg.startswith("engines.0.kind: vllm needs GPUs")


def test_overrides_apply_and_index_lists(tmp_path):
    p = write(tmp_path, "engines: [{kind: hf}, {kind: hf, name: b}]\n")
    cfg = load_config(p, ["trainer.lr=5e-4", "engines.1.count=3", "experiment.name=x"])
    assert cfg.trainer.lr == 5e-4 and cfg.engines[1].count == 3 and cfg.experiment.name == "x"


def test_bad_override_syntax(tmp_path):
    p = write(tmp_path, "engines: [{kind: hf}]\n")
    (msg,) = problems(p, ["trainer.lr"])
    assert "expected section.key=value" in msg


def test_missing_config_file():
    (msg,) = problems("/nonexistent.yaml")
    assert msg.startswith("--config: file '/nonexistent.yaml' not found")


def test_engines_must_share_one_temperature(tmp_path):
    p = write(tmp_path, "engines:\n  - {kind: hf, name: a, sampling: {temperature: 1.0}}\n  - {kind: hf, name: b, sampling: {temperature: 0.7}}\n")
    (msg,) = problems(p)
    assert msg.startswith("engines.*.sampling.temperature: engines use different temperatures [0.7, 1.0]")


def test_rollout_settings_are_checked_before_anything_starts():
    cfg = str(ROOT / "configs/tiny_cpu.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(cfg, ["rollout.max_staleness=-1"])
    assert str(e.value).startswith("rollout.max_staleness: Input should be greater than or equal to 0")
    with pytest.raises(ConfigError, match=r"rollout.partial_rollouts: with max_staleness 0 no request runs"):
        load_config(cfg, ["rollout.partial_rollouts=true"])
    with pytest.raises(ConfigError, match=r"algorithm.off_policy: Input should be 'auto', 'none', 'tis', 'mis' or 'decoupled'"):
        load_config(cfg, ["algorithm.off_policy=ppo"])
    with pytest.raises(ConfigError, match=r"rollout.filter_groups: a group of one sample"):
        load_config(cfg, ["rollout.filter_groups=true", "algorithm.group_size=1"])
    ok = load_config(cfg, ["rollout.max_staleness=2", "rollout.partial_rollouts=true", "algorithm.off_policy=decoupled"])
    assert ok.rollout.max_staleness == 2 and ok.algorithm.off_policy == "decoupled"
    with pytest.raises(ConfigError, match=r"rollout.final_outputs: a request kept through a sync \(partial_rollouts\) "
                                          r"needs each token's weight version"):
        load_config(cfg, ["rollout.max_staleness=1", "rollout.partial_rollouts=true", "rollout.final_outputs=true"])
    assert load_config(cfg, ["rollout.max_staleness=1", "rollout.final_outputs=true"]).rollout.final_outputs


def test_multi_turn_section_and_its_limits():
    cfg = ROOT / "configs/tiny_cpu.yaml"
    assert load_config(cfg).rollout.multi_turn is None   # absent: single-turn, as before
    mt = load_config(cfg, ["rollout.multi_turn.max_turns=2", "rollout.multi_turn.max_observation_tokens=4"]).rollout.multi_turn
    assert (mt.tool, mt.max_turns, mt.max_total_tokens, mt.max_observation_tokens) == ("calculator", 2, None, 4)
    assert mt.total_tokens(5) == 2 * (5 + 4)
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.max_turns: Input should be greater than or equal to 1"):
        load_config(cfg, ["rollout.multi_turn.max_turns=0"])
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.tool: Input should be 'calculator'"):
        load_config(cfg, ["rollout.multi_turn.tool=search"])
    # partial rollouts across turns: allowed since the twelfth session (test_agent, test_multiturn_run)
    assert load_config(cfg, ["rollout.multi_turn.max_turns=2", "rollout.multi_turn.max_observation_tokens=4",
                             "rollout.max_staleness=1", "rollout.partial_rollouts=true"]).rollout.partial_rollouts
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.max_total_tokens: prompt \(\d+\) \+ trajectory \(5000\) "
                                          r"exceed model.tiny.max_position_embeddings"):
        load_config(cfg, ["rollout.multi_turn.max_total_tokens=5000"])
    with pytest.raises(ConfigError, match=r"trajectory \(\d+, its default: max_turns x"):
        load_config(cfg, ["rollout.multi_turn.max_turns=8"])


def test_partial_rollouts_need_engines_that_can_pause(tmp_path):
    p = write(tmp_path, "trainer: {device: cuda, num_ranks: 1}\nrollout: {max_staleness: 1, partial_rollouts: true}\n"
                        "engines:\n  - {kind: vllm}\n  - {kind: sglang}\n  - {kind: vllm, streaming: true}\n"
                        "  - {kind: sglang, streaming: true}\n")
    msgs = problems(p)
    assert "rollout.partial_rollouts: engines.0 (kind vllm) cannot pause between decode steps; set engines.0.streaming: true, or set partial_rollouts: false" in msgs
    assert "rollout.partial_rollouts: engines.1 (kind sglang) cannot pause between decode steps; set engines.1.streaming: true, or set partial_rollouts: false" in msgs
    assert not any("engines.2" in m or "engines.3" in m for m in msgs)


def test_partial_extra_lag_only_with_partial_rollouts(tmp_path):
    p = write(tmp_path, "rollout: {max_staleness: 1, partial_extra_lag: 2}\nengines:\n  - {kind: hf}\n")
    assert problems(p) == ["rollout.partial_extra_lag: only partial rollouts train a group after its deadline; set "
                           "partial_rollouts: true or remove it"]
    r = load_config(p, ["rollout.partial_rollouts=true"]).rollout
    assert r.token_lag_bound() == 3
    assert load_config(write(tmp_path, "rollout: {max_staleness: 2}\nengines:\n  - {kind: hf}\n")).rollout.token_lag_bound() == 2


def test_sleeping_colocated_engine_cannot_run_ahead(tmp_path):
    p = write(tmp_path, "trainer: {num_ranks: 1, offload: true}\nrollout: {max_staleness: 1}\n"
                        "engines:\n  - {kind: hf, placement: colocated, sleep_level: 2}\n")
    (msg,) = problems(p)
    assert msg.startswith("engines.0.sleep_level: a sleeping colocated engine cannot generate while the trainer trains")


def test_offload_auto_needs_zero_and_takes_only_bools_or_auto(tmp_path):
    p = write(tmp_path, "trainer: {num_ranks: 1, zero_stage: 0, offload: auto}\n"
                        "engines:\n  - {kind: hf, placement: colocated, sleep_level: 2}\n")
    (msg,) = problems(p)
    assert msg == ("trainer.offload: auto may offload, and offloading moves ZeRO's optimizer partitions; set "
                   "trainer.zero_stage to 1, 2 or 3")
    assert load_config(p, ["trainer.zero_stage=2"]).trainer.offload == "auto"
    assert load_config(p, ["trainer.zero_stage=2", "trainer.offload=true"]).trainer.offload is True
    (msg,) = problems(p, ["trainer.zero_stage=2", "trainer.offload=sometimes"])
    assert msg == "trainer.offload: Input should be False, True or 'auto' (got 'sometimes')"


def test_token_budget_below_the_longest_sequence(tmp_path):
    p = write(tmp_path, "data: {max_prompt_tokens: 20}\nengines: [{kind: hf, sampling: {max_new_tokens: 8}}, "
                        "{kind: hf, sampling: {max_new_tokens: 30}}]\n")
    (msg,) = problems(p, ["trainer.max_tokens_per_micro_batch=40"])
    assert msg.startswith("trainer.max_tokens_per_micro_batch: 40 is below the longest allowed sequence")
    assert "at least 50" in msg
    load_config(p, ["trainer.max_tokens_per_micro_batch=50", "trainer.packing=true"])


def test_packing_needs_a_token_budget(tmp_path):
    p = write(tmp_path, "engines: [{kind: hf}]\n")
    (msg,) = problems(p, ["trainer.packing=true"])
    assert msg.startswith("trainer.packing:") and "trainer.max_tokens_per_micro_batch" in msg


def test_flash_attention_requested_but_unavailable(tmp_path):
    from rlhf_orch.trainer.packing import flash_attn_available
    p = write(tmp_path, "engines: [{kind: hf}]\n")
    (msg,) = problems(p, ["trainer.attn=flash_attention_2"])   # cpu trainer
    assert msg.startswith("trainer.attn: flash_attention_2 runs on cuda only")
    if not flash_attn_available():
        (msg,) = problems(p, ["trainer.attn=flash_attention_2", "trainer.device=cuda"])
        assert msg.startswith("trainer.attn: flash_attention_2 needs the flash_attn package") and "pip install" in msg
    assert load_config(p, ["trainer.attn=auto"]).trainer.attn == "auto"
