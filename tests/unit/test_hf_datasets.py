"""Bring your own data: JSONL, JSON, parquet, Arrow files and folders, dotted keys, chat rendering, and one clear
line per bad input when the config loads (before any actor)."""
import json
import sys
from pathlib import Path

import pytest

from rlhf_orch.config import load_config
from rlhf_orch.data.prepare import rows_for
from rlhf_orch.data import DataSpec, load_rows, prepare_rows
from rlhf_orch.data.tasks import arithmetic_rows
from rlhf_orch.errors import ConfigError, DataError
from rlhf_orch.models import build_tokenizer
from rlhf_orch.rewards.builtin import exact_match

datasets = pytest.importorskip("datasets")
ROOT = Path(__file__).resolve().parents[2]
BASE = "engines: [{kind: hf}]\ntrainer: {num_ranks: 1}\n"
TEMPLATE = ROOT / "examples/tiny_chat_template.jinja"


def verl_rows(n=4):
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"what is {i}+{i}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i, "question": f"what is {i}+{i}?"}} for i in range(n)]


def plain_rows(n=4):
    return [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(n)]


def config(tmp_path, data: dict, *overrides):
    p = tmp_path / "c.yaml"
    p.write_text(BASE + "data: " + json.dumps(data) + "\n")
    return load_config(p, list(overrides))


def problems(tmp_path, data: dict, *overrides) -> list[str]:
    with pytest.raises(ConfigError) as e:
        config(tmp_path, data, *overrides)
    return e.value.problems


# --- formats ---------------------------------------------------------------------------------------------------

def test_jsonl_rows_are_exactly_as_parsed(tmp_path):
    """Today's JSONL path: same rows, same order, same types (an int answer stays an int), through the config too."""
    rows = [{"prompt": "1+1=", "answer": 2, "extra": {"k": [1, 2]}}, {"prompt": "2+2=", "answer": "4", "max_new_tokens": 3},
            {"prompt": "3+3="}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_rows(str(path)) == rows
    cfg = config(tmp_path, {"source": str(path), "prompts_per_step": 3}, "reward.function=tests.unit.test_hf_datasets:any_reward")
    loaded = load_rows(cfg.data.source, cfg.data.max_operand, 0)
    assert loaded == rows and [type(r.get("answer")) for r in loaded] == [int, str, type(None)]


def any_reward(response, row):
    return 0.0


def test_builtin_rows_are_unchanged():
    assert load_rows("builtin:arithmetic", 4, 0) == arithmetic_rows(4, seed=0)


@pytest.mark.parametrize("fmt", ["parquet", "json", "json_lines", "arrow_stream", "arrow_file"])
def test_each_file_format(tmp_path, fmt):
    import pyarrow as pa
    rows = verl_rows()
    if fmt == "parquet":
        path = tmp_path / "d.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(rows))
    elif fmt == "json_lines":   # JSON lines under a .json name: the json builder reads both
        path = tmp_path / "d.json"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path = tmp_path / "d.arrow"
        table = pa.Table.from_pylist(rows)
        with pa.OSFile(str(path), "wb") as f:
            w = (pa.ipc.new_stream if fmt == "arrow_stream" else pa.ipc.new_file)(f, table.schema)
            w.write_table(table)
            w.close()
    spec = DataSpec(str(path), answer_key="reward_model.ground_truth", chat_template_path=str(TEMPLATE))
    got = prepare_rows(spec, build_tokenizer())
    assert [r["prompt"] for r in got] == [f"user: what is {i}+{i}? assistant:" for i in range(4)]
    assert [r["answer"] for r in got] == ["0", "2", "4", "6"]
    assert got[1]["extra_info"] == {"split": "train", "index": 1, "question": "what is 1+1?"}   # columns kept
    assert got[1]["data_source"] == "openai/gsm8k" and got[1]["reward_model"]["style"] == "rule"


def test_folder_splits_and_saved_datasets(tmp_path):
    folder = tmp_path / "gsm"
    folder.mkdir()
    datasets.Dataset.from_list(plain_rows(4)).to_parquet(str(folder / "train.parquet"))
    datasets.Dataset.from_list(plain_rows(2)).to_parquet(str(folder / "test.parquet"))
    assert len(prepare_rows(DataSpec(str(folder)))) == 4
    assert [r["prompt"] for r in prepare_rows(DataSpec(str(folder), split="test"))] == ["0+1=", "1+1="]
    with pytest.raises(DataError, match=r"data.split: .* has no split 'valid'; its splits: (train, test|test, train)"):
        prepare_rows(DataSpec(str(folder), split="valid"))
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(plain_rows(3)).save_to_disk(str(saved))
    assert prepare_rows(DataSpec(str(saved))) == plain_rows(3)
    saved_dict = tmp_path / "saved_dict"
    datasets.DatasetDict(train=datasets.Dataset.from_list(plain_rows(3)),
                         test=datasets.Dataset.from_list(plain_rows(1))).save_to_disk(str(saved_dict))
    assert prepare_rows(DataSpec(str(saved_dict), split="test")) == plain_rows(1)


def test_folder_of_jsonl_files(tmp_path):
    folder = tmp_path / "rows"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plain_rows(3)))
    assert prepare_rows(DataSpec(str(folder))) == plain_rows(3)


# --- keys and rendering ----------------------------------------------------------------------------------------

def test_dotted_keys_fill_prompt_and_answer_as_strings(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"q": {"text": f"{i}*2="}, "meta": {"solution": 2 * i}}) + "\n" for i in range(3)))
    rows = prepare_rows(DataSpec(str(path), prompt_key="q.text", answer_key="meta.solution"))
    assert rows[2] == {"q": {"text": "2*2="}, "meta": {"solution": 4}, "prompt": "2*2=", "answer": "4"}
    assert exact_match(" 4 ", rows[2]) == 1.0
    # a list index in the path: the first message's content as a plain prompt
    p2 = tmp_path / "m.jsonl"
    p2.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": 1}) + "\n")
    assert prepare_rows(DataSpec(str(p2), prompt_key="prompt.0.content"))[0]["prompt"] == "hi"


def test_chat_rendering_with_template_file_and_system_prompt(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}) + "\n"
                    + json.dumps({"prompt": [{"role": "system", "content": "own."}, {"role": "user", "content": "3+3?"}],
                                  "answer": "6"}) + "\n")
    rows = prepare_rows(DataSpec(str(path), system_prompt="be brief.", chat_template_path=str(TEMPLATE)), build_tokenizer())
    assert rows[0]["prompt"] == "system: be brief. user: 2+2? assistant:"
    assert rows[1]["prompt"] == "system: own. user: 3+3? assistant:"   # a row's own system message is kept


def test_string_prompt_wrapped_with_the_tokenizers_own_template(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    assert prepare_rows(DataSpec(str(path), chat_template=True), tok)[0]["prompt"] == "[user]2+2?>"
    assert prepare_rows(DataSpec(str(path)), tok)[0]["prompt"] == "2+2?"   # without chat_template: as given


def test_gsm8k_example_config_loads_rendered_rows():
    cfg = load_config(ROOT / "configs/gsm8k_cpu.yaml")
    rows = rows_for(cfg)   # what launch.py trains on: the rows config loading rendered and checked
    assert rows is rows_for(cfg)
    assert len(rows) == 64 and all(r["prompt"].startswith("user: ") and r["prompt"].endswith(" assistant:") for r in rows)
    assert all(r["answer"] == r["reward_model"]["ground_truth"] for r in rows)
    assert exact_match(rows[0]["answer"], rows[0]) == 1.0


# --- errors: one clear line each --------------------------------------------------------------------------------

def test_no_chat_template_names_prompt_key_and_template_path(tmp_path):
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(verl_rows()).to_parquet(str(path))
    (msg,) = problems(tmp_path, {"source": str(path), "answer_key": "reward_model.ground_truth", "prompts_per_step": 4})
    assert msg.startswith("data.prompt_key: 'prompt' holds chat messages") and "has no chat template" in msg
    assert "data.chat_template_path" in msg


def test_not_utf8(tmp_path):
    for name in ("d.jsonl", "d.json"):
        path = tmp_path / name
        path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "x"}\n')
        (msg,) = problems(tmp_path, {"source": str(path), "prompts_per_step": 1})
        assert msg.startswith(f"data.source: {path} is not UTF-8 text (byte 0xe9 on line 2)") and "iconv" in msg


def test_missing_keys_say_which_exist(tmp_path):
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(verl_rows()).to_parquet(str(path))
    (msg,) = problems(tmp_path, {"source": str(path), "prompt_key": "question", "prompts_per_step": 4})
    assert msg.startswith("data.prompt_key: 'question' is in no row of") and \
        "the row has keys: ability, data_source, extra_info, prompt, reward_model" in msg
    (msg,) = problems(tmp_path, {"source": str(path), "prompt_key": "extra_info.question",
                                 "answer_key": "reward_model.answer", "prompts_per_step": 4})
    assert msg.startswith("data.answer_key: 'reward_model.answer' is in no row") and "reward_model has keys: ground_truth, style" in msg


def test_answer_missing_in_some_rows_is_named_by_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"prompt": "2+2="}) + "\n")
    (msg,) = problems(tmp_path, {"source": str(path), "prompts_per_step": 1})
    assert msg.startswith(f"{path}:2: row has no 'answer'") and "exact_match reads row['answer']" in msg


def test_prompts_per_step_larger_than_the_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in plain_rows(3)))
    (msg,) = problems(tmp_path, {"source": str(path)})   # default 16
    assert msg == (f"data.prompts_per_step: 16 prompts per step but {path} has 3 rows, so a step would repeat prompts; "
                   "set data.prompts_per_step to at most 3 or add rows")


def test_max_operand_with_a_file_source_and_file_fields_with_builtin(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in plain_rows(3)))
    (msg,) = problems(tmp_path, {"source": str(path), "prompts_per_step": 3, "max_operand": 4})
    assert msg.startswith("data.max_operand: applies to builtin:arithmetic only")
    config(tmp_path, {"source": str(path), "prompts_per_step": 3})   # the default max_operand is fine
    (msg,) = problems(tmp_path, {"prompt_key": "question"})
    assert msg == "data.prompt_key: applies to file sources only and data.source is builtin:arithmetic; remove it"


def test_characters_the_builtin_tokenizer_cannot_encode(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "2+2=", "answer": "4"},
            {"prompt": "Sum:\n3+3", "answer": "6!"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = problems(tmp_path, {"source": str(path), "prompts_per_step": 3})
    assert len(got) == 2
    assert got[0].startswith(f"data.prompt_key: 2 prompts of {path} hold characters the tokenizer cannot encode "
                             "('\\n', 'S', 'W'; first: row 0), which would silently become <unk>")
    assert "the built-in tokenizer knows only lowercase" in got[0]
    assert got[1].startswith("data.answer_key: 1 answers of") and "('!'; first: row 2)" in got[1]


def test_prompt_longer_than_max_prompt_tokens(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": "1+1=" * n, "answer": "2"}) + "\n" for n in (1, 9, 20)))
    (msg,) = problems(tmp_path, {"source": str(path), "prompts_per_step": 3})
    assert msg.startswith(f"data.max_prompt_tokens: 2 of 3 prompts of {path} are longer than 32 tokens (longest 80, first: row 1)")


def test_missing_template_file_and_unused_system_prompt(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in plain_rows(3)))
    (msg,) = problems(tmp_path, {"source": str(path), "prompts_per_step": 3, "chat_template_path": "no/such.jinja"})
    assert msg.startswith("data.chat_template_path: file 'no/such.jinja' not found")
    (msg,) = problems(tmp_path, {"source": str(path), "prompts_per_step": 3, "system_prompt": "be brief."})
    assert msg.startswith("data.system_prompt: 3 prompts at data.prompt_key 'prompt' are plain strings")
    rows = config(tmp_path, {"source": str(path), "prompts_per_step": 3, "system_prompt": "be brief.", "chat_template": True,
                             "chat_template_path": str(TEMPLATE), "max_prompt_tokens": 48})
    assert rows_for(rows)[0]["prompt"] == "system: be brief. user: 0+1= assistant:"


def test_datasets_not_installed_says_how_to_install(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(plain_rows(3)).to_parquet(str(path))
    monkeypatch.setitem(sys.modules, "datasets", None)   # import datasets -> ImportError
    (msg,) = problems(tmp_path, {"source": str(path), "prompts_per_step": 3})
    assert "needs the Hugging Face datasets library" in msg and 'pip install -e ".[data]"' in msg
    jsonl = tmp_path / "d.jsonl"   # JSONL needs no extra package
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in plain_rows(3)))
    config(tmp_path, {"source": str(jsonl), "prompts_per_step": 3})


def test_unknown_extension_and_bad_messages(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,answer\n1+1=,2\n")
    (msg,) = problems(tmp_path, {"source": str(path), "prompts_per_step": 1})
    assert msg.startswith(f"data.source: '{path}' is not a .jsonl, .json, .parquet or .arrow file")
    bad = tmp_path / "m.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "user"}], "answer": "1"}) + "\n" + json.dumps({"prompt": 3, "answer": "1"}) + "\n")
    got = problems(tmp_path, {"source": str(bad), "prompts_per_step": 1, "chat_template_path": str(TEMPLATE)})
    assert got[0].startswith(f"{bad}:1: 'prompt' message 0 is not a {{\"role\": str, \"content\": str}} mapping")
    assert got[1].startswith(f"{bad}:2: 'prompt' must be a non-empty string or a list of chat messages") and len(got) == 2


def test_launch_stops_before_ray_with_one_line(capsys, tmp_path):
    sys.path.insert(0, str(ROOT))
    import launch
    import ray
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(verl_rows()).to_parquet(str(path))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE)
    rc = launch.main(["--config", str(cfg), f"experiment.output_dir={tmp_path}", f"data.source={path}",
                      "data.answer_key=reward_model.nope", "data.prompts_per_step=4",
                      f"data.chat_template_path={TEMPLATE}"])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert rc == 2 and not ray.is_initialized()
    assert len(err) == 1 and err[0].startswith("error: data.answer_key: 'reward_model.nope' is in no row")
