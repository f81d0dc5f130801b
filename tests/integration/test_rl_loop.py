"""The RL loop's clear failures: an infeasible placement refused before Ray starts, and a reward function that
raises, which leaves metrics, a checkpoint and plots. (The loop's steps through both transports, ZeRO-2 and ZeRO-3,
are checked on test_colocation.py's plain runs.)"""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402

pytestmark = pytest.mark.integration


# First: it checks that Ray is not running, and the shared Ray of the tests below stays up until the module ends.
def test_infeasible_placement_is_a_clear_error_and_cleans_up(tmp_path, capsys):
    import ray
    # 8 trainer bundles + 1 dedicated engine (the colocated one shares a bundle) = 9 * 0.25 CPUs; the local
    # Ray offers 1: Ray alone would wait forever.
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "experiment.name=big", f"experiment.output_dir={tmp_path}",
                      "trainer.num_ranks=8", "ray.num_cpus=1", "ray.get_timeout_s=5", "metrics.ray_metrics=false"])
    assert rc == 2      # a bad input, as every config error
    err = capsys.readouterr().err
    # caught before Ray starts (rlhf_orch/resources.py), with the field and the fixes
    assert "trainer.num_ranks: the run needs 2.25 CPUs" in err and "raise ray.num_cpus" in err, err
    assert not ray.is_initialized()



@pytest.mark.usefixtures("shared_ray")
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
