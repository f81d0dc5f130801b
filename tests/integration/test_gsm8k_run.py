"""Bring your own data end to end: configs/gsm8k_cpu.yaml (a verl-style GSM8K parquet folder, chat messages
rendered with examples/tiny_chat_template.jinja, answers at reward_model.ground_truth) runs 2 GRPO steps with real
Ray actors (2 DeepSpeed ranks, a colocated and a dedicated hf engine) and scores every sample with the config's
GSM8K answer reward (rlhf_orch.rewards.math:gsm8k, math-verify in a Ray reward worker). The same run evaluates after
its last step, greedily, on 8 prompts of the folder's test split, scored by the run's reward function (it was a run
of its own in test_eval_run.py)."""
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
from rlhf_orch.config import load_config  # noqa: E402
from rlhf_orch.rewards.check import DUMMY_RESPONSES  # noqa: E402
from rlhf_orch.rewards.math import gsm8k  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
pytest.importorskip("datasets")
QUIET = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "metrics.plots=false"]
RECORD = "RLHF_ORCH_TEST_REWARD_RECORD"


def recording_gsm8k(response: str, row: dict) -> float:
    """The config's gsm8k reward, also appending the row it was given and the caller's pid to
    $RLHF_ORCH_TEST_REWARD_RECORD (the reward worker inherits the driver's environment on a local Ray)."""

    value = gsm8k(response, row)
    with open(os.environ[RECORD], "a", encoding="utf-8") as f:
        f.write(json.dumps({"row": row, "response": response, "value": value, "pid": os.getpid()}) + "\n")
    return value


def test_gsm8k_parquet_run(tmp_path, monkeypatch, reward_record):
    monkeypatch.chdir(ROOT)   # the config's data paths are relative to the repository root
    record = reward_record
    fn = "tests.integration.test_gsm8k_run:recording_gsm8k"
    assert load_config("configs/gsm8k_cpu.yaml").reward.function == "rlhf_orch.rewards.math:gsm8k"   # what we record
    assert launch.main(["--config", "configs/gsm8k_cpu.yaml", f"experiment.output_dir={tmp_path}", "experiment.name=gsm8k",
                        "experiment.steps=2", "trainer.warm_start_steps=2", f"reward.function={fn}", "eval.every=2",
                        "eval.max_prompts=8", *QUIET]) == 0
    run = tmp_path / "gsm8k"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["verified_syncs"] == summary["syncs"] == 3
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    everything = [json.loads(l) for l in record.read_text().splitlines()]
    # The pre-launch check called the reward here, in the driver, with its two placeholder responses; the rest are
    # the reward worker's.
    assert [s["response"] for s in everything if s["pid"] == os.getpid()] == list(DUMMY_RESPONSES)
    scored = [s for s in everything if s["pid"] != os.getpid()]
    assert all(gsm8k(s["response"], s["row"]) == s["value"] for s in scored)   # the worker scored as the driver does
    scored, evaluated = scored[:-8], scored[-8:]   # the evaluation after step 2 scores last
    _check_eval(records, evaluated)
    assert all(s["row"]["extra_info"]["split"] == "train" for s in scored)
    assert len(scored) == 2 * 16 * 8   # max_staleness 0: each step scores exactly its 16 groups of 8, in order
    for step, r in enumerate(records):
        values = [s["value"] for s in scored[step * 128:(step + 1) * 128]]
        assert abs(r["rollout/reward_mean"] - statistics.fmean(values)) < 1e-6 and math.isfinite(r["train/loss"])
    for s in scored:   # the reward saw the whole parquet row, with the rendered prompt and the answer filled in
        row = s["row"]
        assert row["answer"] == row["reward_model"]["ground_truth"] and row["data_source"] == "openai/gsm8k"
        assert row["prompt"] == f"user: {row['extra_info']['question']} assistant:"
    drawn = [src for l in (run / "rollouts.jsonl").read_text().splitlines() for src in json.loads(l)["sources"]]
    assert len(drawn) == 32 and all(0 <= int(i) < 64 for _, i in drawn)   # rows of the 64-row train split
    _check_export(run, scored[0]["row"])


def _check_eval(records: list[dict], evaluated: list[dict]) -> None:
    """Greedy evaluation on the held-out split: 8 test rows, one sample each, after the last step; its metrics are
    the mean of the values the run's reward function gave them."""
    assert all(s["row"]["extra_info"]["split"] == "test" for s in evaluated)
    assert len({s["row"]["extra_info"]["index"] for s in evaluated}) == 8                # 8 prompts, greedy: one each
    assert not any(k.startswith("eval/") for k in records[0])
    e = records[1]
    assert e["eval/prompts"] == 8 and e["eval/k"] == 1 and e["eval/pass@1"] == e["eval/pass@k"]
    assert abs(e["eval/reward_mean"] - statistics.fmean(s["value"] for s in evaluated)) < 1e-9


def _check_export(run: Path, row: dict) -> None:
    """The final checkpoint's hf/ folder serves as it is: it loads, renders a training row's messages exactly as the
    run did (with the run's template file), holds the run's sampling defaults, is covered by the manifest, generates."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    hf = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip() / "hf"
    manifest = json.loads((hf.parent / "manifest.json").read_text())["files"]
    assert {"hf/model.safetensors", "hf/tokenizer.json", "hf/tokenizer_config.json", "hf/generation_config.json"} <= set(manifest)
    tok = AutoTokenizer.from_pretrained(hf)
    assert tok.chat_template == (ROOT / "examples/tiny_chat_template.jinja").read_text(encoding="utf-8")
    text = tok.apply_chat_template([{"role": "user", "content": row["extra_info"]["question"]}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == row["prompt"]
    sampling = load_config(ROOT / "configs/gsm8k_cpu.yaml").engines[0].sampling
    gen = GenerationConfig.from_pretrained(hf)
    assert (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id)
    assert (gen.temperature, gen.top_p, gen.max_new_tokens) == (sampling.temperature, sampling.top_p, sampling.max_new_tokens)
    model, info = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = tok(text, add_special_tokens=False, return_tensors="pt")
    out = model.generate(**ids, do_sample=False)
    assert 1 <= out.shape[1] - ids.input_ids.shape[1] <= sampling.max_new_tokens
