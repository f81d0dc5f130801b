"""An engine that dies mid-run, with fault_tolerance.max_engine_restarts spent (0 here), costs no work: its
groups go to the other engine, the weight-sync plan is made again without it, and the run finishes on the
engine left; summary.json records the fault without a replacement. (test_engine_faults.py covers replacement.)"""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
KILLS_PROCESSES = True   # an engine dies in the run: the shared Ray stops after this module
COMMON = ["experiment.name=death", "trainer.warm_start_steps=0", "ray.num_cpus=2", "metrics.trackers=[jsonl]",
          "metrics.ray_metrics=false", "experiment.steps=3", "fault_tolerance.max_engine_restarts=0"]


def test_engine_death_without_restarts_goes_on_with_the_engines_left(tmp_path):
    cfg = str(ROOT / "configs/tiny_cpu.yaml")
    rc = launch.main(["--config", cfg, f"experiment.output_dir={tmp_path}", *COMMON,
                      "reward.function=tests.failing_rewards:kills_an_engine_on_second_step"])
    assert rc == 0
    run = tmp_path / "death"
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["fault/engines_live"] == 1 and records[-1]["fault/engine_restarts"] == 0
    assert records[-1]["sync/broadcast_engines"] == 0           # only the colocated (ipc) engine is left
    summary = json.loads((run / "summary.json").read_text())
    [fault] = summary["faults"]
    assert fault["engine"] == "dedicated" and fault["replacement"] is None and "died" in fault["cause"]
    assert summary["ledger"]["balanced"] == 1 and summary["ledger"]["trained"] == 3 * 16
