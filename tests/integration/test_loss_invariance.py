"""Token-level loss aggregation does not depend on how a batch is split: the same first step on 1 rank,
on 2 ranks, and on 2 ranks in micro-batches of 8 (gradient accumulation) gives the same loss and the same
reduced gradient norm. Real DeepSpeed ranks over gloo; no warm start, so step 1 sees identical samples."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]   # three runs, one Ray


def _step1(tmp_path, name, *extra):
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                      f"experiment.name={name}", "experiment.steps=1", "trainer.warm_start_steps=0", "ray.num_cpus=2",
                      "metrics.trackers=[jsonl]", "metrics.plots=false", "metrics.ray_metrics=false",
                      "engines.0.placement=dedicated", *extra])
    assert rc == 0
    return json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])


def test_split_over_ranks_and_micro_batches_gives_the_same_step(tmp_path):
    one = _step1(tmp_path, "one", "trainer.num_ranks=1")
    two = _step1(tmp_path, "two", "trainer.num_ranks=2")
    micro = _step1(tmp_path, "micro", "trainer.num_ranks=2", "trainer.micro_batch_size=8")
    assert one["rollout/reward_mean"] == two["rollout/reward_mean"] == micro["rollout/reward_mean"]
    assert one["train/loss"] != 0.0 and one["train/grad_norm"] > 0.0
    for other in (two, micro):
        assert other["train/loss"] == pytest.approx(one["train/loss"], rel=1e-5, abs=1e-7)
        assert other["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-5)
