"""Bad input ends with one clear `error:` line per problem and exit code 2, before Ray starts."""
import json
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402


def run(capsys, tmp_path, yaml_text, *overrides):
    import ray
    p = tmp_path / "c.yaml"
    p.write_text(yaml_text)
    rc = launch.main(["--config", str(p), f"experiment.output_dir={tmp_path}", *overrides])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert not ray.is_initialized(), "no actor may start on bad input"
    return rc, err


BASE = "engines: [{kind: hf}]\ntrainer: {num_ranks: 1}\n"


def test_malformed_yaml(capsys, tmp_path):
    rc, err = run(capsys, tmp_path, "engines: [{kind: hf}\n")
    assert rc == 2 and len(err) == 1 and "malformed YAML" in err[0]


def test_unknown_engine_kind(capsys, tmp_path):
    rc, err = run(capsys, tmp_path, "engines: [{kind: magic}]\n")
    assert rc == 2 and err == ["error: engines.0.kind: unknown engine kind 'magic'; use one of: hf, vllm, sglang"]


def test_reward_that_does_not_import(capsys, tmp_path):
    rc, err = run(capsys, tmp_path, BASE, "reward.function=my_rewards.nope:score")
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: reward.function: cannot import module 'my_rewards.nope'")


def test_dataset_row_without_prompt(capsys, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"text": "2+2="}) + "\n")
    rc, err = run(capsys, tmp_path, BASE, f"data.source={data}")
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: {data}:2: row has no 'prompt' field")
