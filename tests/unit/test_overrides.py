"""Command-line overrides as Hydra writes them (issue 31): `~key` removes a key, a bare item is a list of one,
every unknown key (nested ones too, in overrides and in YAML) gets a "did you mean"; blank prompts are refused."""
import json
from pathlib import Path

import pytest

from rlhf_orch.config import apply_override, load_config
from rlhf_orch.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/tiny_cpu.yaml"


def problems(path, overrides=None) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return e.value.problems


def rows_file(tmp_path, rows, name="d.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


GOOD_ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)]


# ---- ~key: removing a key -----------------------------------------------------------------------------------------

def test_removing_a_key_lets_a_shipped_config_take_your_own_file(tmp_path):
    data = rows_file(tmp_path, GOOD_ROWS)
    base = [f"experiment.output_dir={tmp_path}", f"data.source={data}", "data.prompts_per_step=2"]
    (msg,) = problems(TINY, base)   # what the issue met: the shipped config's builtin-only option is in the way
    assert msg.startswith("data.max_operand: applies to builtin:arithmetic only")
    cfg = load_config(TINY, [*base, "~data.max_operand"])
    assert cfg.data.source == str(data) and "max_operand" not in cfg.data.model_fields_set


def test_removed_key_takes_its_default_and_order_matters(tmp_path):
    out = f"experiment.output_dir={tmp_path}"
    assert load_config(TINY, [out, "~trainer.lr"]).trainer.lr == 1e-3            # the schema's default
    assert load_config(TINY, [out, "~trainer.lr", "trainer.lr=0.5"]).trainer.lr == 0.5   # later overrides win
    raw = {"trainer": {"lr": 0.1}}
    apply_override(raw, "trainer.foo=1")
    apply_override(raw, "~trainer.foo")   # set then removed: gone again
    assert raw == {"trainer": {"lr": 0.1}}


def test_removing_a_list_entry_and_a_nested_key(tmp_path):
    cfg = load_config(TINY, [f"experiment.output_dir={tmp_path}", "~engines.1", "~engines.0.sampling.temperature"])
    assert len(cfg.engines) == 1 and cfg.engines[0].name == "colocated"
    assert cfg.engines[0].sampling.temperature == 1.0 and "temperature" not in cfg.engines[0].sampling.model_fields_set


def test_removing_a_key_only_when_it_holds_a_value(tmp_path):
    out = f"experiment.output_dir={tmp_path}"
    assert "max_operand" not in load_config(TINY, [out, "~data.max_operand=4"]).data.model_fields_set
    (msg,) = problems(TINY, [out, "~data.max_operand=3"])
    assert msg == ("override '~data.max_operand=3': data.max_operand is 4, not 3; write ~data.max_operand to remove "
                   "it whatever it holds")


def test_removing_a_key_that_is_not_there_is_one_error_naming_it(tmp_path):
    out = f"experiment.output_dir={tmp_path}"
    assert problems(TINY, [out, "~data.max_operandd"]) == [
        "override '~data.max_operandd': data.max_operandd is not in the config, so there is nothing to remove; "
        "did you mean 'data.max_operand'?"]
    assert problems(TINY, [out, "~data.split"]) == [   # a real field the file does not set: already its default
        "override '~data.split': data.split is not set in the config, so it already has its default; there is "
        "nothing to remove"]
    assert problems(TINY, [out, "~engines.5"]) == ["override '~engines.5': engines has 2 entries; index 5 does not exist"]
    (msg,) = problems(TINY, [out, "~traner.lr"])
    assert msg.startswith("override '~traner.lr': traner is not in the config") and "did you mean 'trainer'?" in msg


def test_malformed_overrides_name_both_forms(tmp_path):
    for bad in ("trainer.lr", "~", "=3"):
        (msg,) = problems(TINY, [f"experiment.output_dir={tmp_path}", bad])
        assert msg.startswith(f"override {bad!r}: expected section.key=value") and "~section.key" in msg


def test_setting_below_a_value_is_a_clear_error_not_a_crash(tmp_path):
    (msg,) = problems(TINY, [f"experiment.output_dir={tmp_path}", "data.source.path=x"])
    assert msg == ("override 'data.source.path=x': data.source is a value ('builtin:arithmetic'), not a section with "
                   "keys; set it with data.source=...")


def test_hydra_plus_prefixes_set_as_usual(tmp_path):
    cfg = load_config(TINY, [f"experiment.output_dir={tmp_path}", "+trainer.lr=0.25", "++experiment.steps=7"])
    assert cfg.trainer.lr == 0.25 and cfg.experiment.steps == 7


# ---- bare items for list fields -----------------------------------------------------------------------------------

def test_a_bare_item_for_a_list_field_is_a_list_of_one(tmp_path):
    out = f"experiment.output_dir={tmp_path}"
    assert load_config(TINY, [out, "metrics.trackers=jsonl"]).metrics.trackers == ["jsonl"]
    assert load_config(TINY, [out, "metrics.trackers=[jsonl,tensorboard]"]).metrics.trackers == ["jsonl", "tensorboard"]
    raw = {}
    apply_override(raw, "metrics.trackers=wandb")
    apply_override(raw, "experiment.name=wandb")   # not a list field: stays a string
    assert raw == {"metrics": {"trackers": ["wandb"]}, "experiment": {"name": "wandb"}}


def test_a_bare_item_in_yaml_gets_the_list_spelled_out(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(f"experiment: {{output_dir: {tmp_path}}}\nengines: [{{kind: hf}}]\nmetrics: {{trackers: jsonl}}\n")
    (msg,) = problems(p)
    assert msg.startswith("metrics.trackers: must be a list (got 'jsonl'); write it as [jsonl] in YAML")


# ---- did you mean -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, start, meant", [
    ("trainer.lrr=1", "trainer.lrr: unknown key", "lr"),
    ("engines.0.samplng.temperature=1", "engines.0.samplng: unknown key", "sampling"),
    ("engines.1.sampling.temprature=1", "engines.1.sampling.temprature: unknown key", "temperature"),
    ("model.tiny.hiden_size=8", "model.tiny.hiden_size: unknown key", "hidden_size"),
    ("algorithm.kl_ctrl.kl_cof=0.1", "algorithm.kl_ctrl.kl_cof: unknown key", "kl_coef"),
    ("trainr.lr=1", "trainr: unknown key", "trainer"),
])
def test_unknown_nested_override_says_did_you_mean(tmp_path, override, start, meant):
    (msg,) = problems(TINY, [f"experiment.output_dir={tmp_path}", override])
    assert msg.startswith(start) and f"did you mean {meant!r}?" in msg and "valid keys here:" in msg


def test_did_you_mean_knows_each_engine_kinds_own_keys(tmp_path):
    (msg,) = problems(TINY, [f"experiment.output_dir={tmp_path}", "engines.0.kind=vllm", "trainer.device=cuda",
                             "engines.0.gpu_mem=0.4"])
    assert msg.startswith("engines.0.gpu_mem: unknown key; did you mean 'gpu_memory_utilization'?")
    assert "enable_sleep_mode" in msg and "max_batch_size" not in msg   # vllm's keys, not the hf engine's


def test_unknown_nested_yaml_keys_say_did_you_mean(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(f"experiment: {{output_dir: {tmp_path}}}\n"
                 "model: {tiny: {num_hiden_layers: 1}}\n"
                 "engines:\n  - kind: hf\n    samplng: {temperature: 1.0}\n"
                 "  - kind: hf\n    sampling: {max_new_token: 3}\n")
    got = problems(p)
    assert len(got) == 3
    assert got[0].startswith("model.tiny.num_hiden_layers: unknown key; did you mean 'num_hidden_layers'?")
    assert got[1].startswith("engines.0.samplng: unknown key; did you mean 'sampling'?")
    assert got[2].startswith("engines.1.sampling.max_new_token: unknown key; did you mean 'max_new_tokens'?")


# ---- blank prompts --------------------------------------------------------------------------------------------------

def test_blank_prompts_are_refused_with_the_row_and_the_fix(tmp_path):
    rows = [*GOOD_ROWS, {"prompt": [{"role": "user", "content": "5+1="}], "answer": "6"},
            {"prompt": "   ", "answer": "1"}, {"prompt": "\t\n", "answer": "2"},
            {"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "  "}], "answer": "3"}]
    data = rows_file(tmp_path, rows)
    got = problems(TINY, [f"experiment.output_dir={tmp_path}", f"data.source={data}", "~data.max_operand",
                          "data.prompts_per_step=2", f"data.chat_template_path={ROOT / 'examples/tiny_chat_template.jinja'}"])
    assert got == [
        f"{data}:6: 'prompt' is only whitespace ('   '); give the row a prompt with text, or remove the row",
        f"{data}:7: 'prompt' is only whitespace ('\\t\\n'); give the row a prompt with text, or remove the row",
        f"{data}:8: 'prompt' is chat messages whose content is all empty or whitespace; give a message text, or "
        "remove the row"]


def test_an_empty_prompt_keeps_its_message(tmp_path):
    data = rows_file(tmp_path, [*GOOD_ROWS, {"prompt": "", "answer": "1"}])
    (msg,) = problems(TINY, [f"experiment.output_dir={tmp_path}", f"data.source={data}", "~data.max_operand",
                             "data.prompts_per_step=2"])
    assert msg == f"{data}:5: 'prompt' must be a non-empty string or a list of chat messages"


def test_prompts_with_surrounding_spaces_are_kept_as_they_are(tmp_path):
    data = rows_file(tmp_path, [*GOOD_ROWS, {"prompt": " 3+3= ", "answer": "6"}])
    load_config(TINY, [f"experiment.output_dir={tmp_path}", f"data.source={data}", "~data.max_operand",
                       "data.prompts_per_step=2"])
