"""Bring your own data end to end: configs/gsm8k_cpu.yaml (a verl-style GSM8K parquet folder, chat messages
rendered with examples/tiny_chat_template.jinja, answers at reward_model.ground_truth) runs 2 GRPO steps with real
Ray actors (2 DeepSpeed ranks, a colocated and a dedicated hf engine) and scores every sample by exact match."""
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

pytestmark = pytest.mark.integration
pytest.importorskip("datasets")
QUIET = ["ray.num_cpus=2", "metrics.tensorboard=false", "metrics.ray_metrics=false", "metrics.plots=false"]
RECORD = "RLHF_ORCH_TEST_REWARD_RECORD"


def recording_exact_match(response: str, row: dict) -> float:
    """exact_match that also appends the row it was given to $RLHF_ORCH_TEST_REWARD_RECORD (the reward worker
    inherits the driver's environment on a local Ray)."""
    from rlhf_orch.rewards.builtin import exact_match

    value = exact_match(response, row)
    with open(os.environ[RECORD], "a", encoding="utf-8") as f:
        f.write(json.dumps({"row": row, "response": response, "value": value}) + "\n")
    return value


def test_gsm8k_parquet_run(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)   # the config's data paths are relative to the repository root
    record = tmp_path / "scored.jsonl"
    monkeypatch.setenv(RECORD, str(record))
    fn = "tests.integration.test_gsm8k_run:recording_exact_match"
    assert launch.main(["--config", "configs/gsm8k_cpu.yaml", f"experiment.output_dir={tmp_path}", "experiment.name=gsm8k",
                        "experiment.steps=2", "trainer.warm_start_steps=2", f"reward.function={fn}", *QUIET]) == 0
    run = tmp_path / "gsm8k"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["verified_syncs"] == summary["syncs"] == 3
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    scored = [json.loads(l) for l in record.read_text().splitlines()]
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
