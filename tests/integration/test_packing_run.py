"""Padding-free training end to end: tiny_cpu with a token budget, token-balanced ranks and packed micro-batches
trains the same 3 steps as the padded synchronous loop (float32; its recorded baseline), with no padding. The
run also takes its logprobs 16 positions at a time (trainer.logprob_chunk_tokens) through varlen attention."""
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402
from baselines import baseline  # noqa: E402

pytestmark = pytest.mark.integration
QUIET = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "metrics.plots=false"]


def test_packed_token_budget_run_matches_the_padded_baseline(tmp_path, shared_ray):
    """One run (CI time): its first 3 steps against the padded synchronous loop's recorded baseline."""
    base = baseline("tiny_cpu_20steps")["steps"]
    # 64 tokens: above the longest allowed sequence (32 prompt + 4 new), well below a rank's ~800 tokens.
    assert launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                        "experiment.name=packed", "experiment.steps=3", "trainer.max_tokens_per_micro_batch=64",
                        "trainer.packing=true", "trainer.logprob_chunk_tokens=16", *QUIET]) == 0
    packed = [json.loads(l) for l in (tmp_path / "packed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in packed] == [1, 2, 3]
    for want, got in zip(base, packed):
        assert got["rollout/reward_mean"] == want["rollout/reward_mean"]
        for key in ("train/loss", "train/kl", "train/grad_norm"):
            assert math.isfinite(got[key]) and abs(got[key] - want[key]) <= 1e-4, (got["step"], key, got[key], want[key])
        assert got["train/padding_frac"] == 0.0 and got["train/micro_batches"] > 1
        assert 0.0 <= got["train/rank_imbalance"] < 0.05 and got["train/tokens_per_s"] > 0
        assert 0.0 < got["train/entropy"] and "train/mfu" not in got   # no MFU without a known device peak
