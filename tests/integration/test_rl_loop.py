"""The RL loop's clear failures: a reward function that raises, which leaves metrics, a checkpoint and plots. (An
infeasible placement refused before Ray starts: test_refused_before_ray.py; the loop's steps through both transports,
ZeRO-2 and ZeRO-3, are checked on test_colocation.py's runs.)"""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]


def test_failure_leaves_metrics_checkpoint_and_plots(tmp_path, capsys):
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "experiment.steps=5", "experiment.name=fail",
                      f"experiment.output_dir={tmp_path}", "trainer.warm_start_steps=0", "ray.num_cpus=2",
                      "reward.function=tests.failing_rewards:fails_on_second_step"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "error: RewardError: reward.function tests.failing_rewards:fails_on_second_step raised KeyError" in err
    run = tmp_path / "fail"
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step1"
    # the cursor saved is the one after step 1, not after the failed step 2 drew its batch
    state = json.loads((run / "checkpoints" / "step1" / "rl_state.json").read_text())
    assert state["data"]["epoch"] == 0 and state["data"]["offset"] == 16
    assert (run / "plots" / "reward.png").exists()
