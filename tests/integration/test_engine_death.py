"""An engine that dies mid-run loses no work: the run stops with an error naming what failed, the last
completed step is checkpointed (trainer state, data cursor, metrics), and `resume=true` finishes the run."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402

pytestmark = pytest.mark.integration
COMMON = ["experiment.name=death", "trainer.warm_start_steps=0", "ray.num_cpus=2", "metrics.tensorboard=false",
          "metrics.ray_metrics=false", "experiment.steps=3"]


def test_engine_death_is_reported_checkpointed_and_resumable(tmp_path, capsys):
    cfg = str(ROOT / "configs/tiny_cpu.yaml")
    rc = launch.main(["--config", cfg, f"experiment.output_dir={tmp_path}", *COMMON,
                      "reward.function=tests.failing_rewards:kills_an_engine_on_second_step"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "an actor died" in err and "error: WeightSyncError" in err   # step 2's sync found the engine gone
    run = tmp_path / "death"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step1"
    assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    rc = launch.main(["--config", cfg, f"experiment.output_dir={tmp_path}", *COMMON, "resume=true"])
    assert rc == 0
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == 1
