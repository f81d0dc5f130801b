"""A dead trainer rank, reward worker, separate reference worker or rollout manager restarts the run from its latest
checkpoint, by itself, and the run ends exactly where an uninterrupted one does: SIGKILL trainer rank 1 (or the reward
worker, reference worker 1 of a `reference.placement: separate` run, or the rollout manager) at step ~12 of 20
(checkpoints every 5 steps); the run restarts from step 10 and its 20 steps match the synchronous-loop baseline
recorded before the rollout manager existed (tests/data/tiny_cpu_20steps_baseline.json) to 1e-6; summary.json lists
the restart. A dead weight-sync coordinator is replaced in place instead (no restart, same numbers)."""
import json
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
import launch  # noqa: E402
from baselines import baseline  # noqa: E402
from test_engine_faults import _fault_at  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
QUIET = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "metrics.plots=false"]


@pytest.mark.parametrize("victim, extra", [("-trainer-1", []), ("-reward-0", []),
                                           ("-reference-1", ["reference.placement=separate", "reference.num_workers=2"]),
                                           ("-rollouts", [])])
def test_killed_trainer_rank_or_reward_worker_restarts_the_run_from_its_checkpoint_exactly(tmp_path, victim, extra):
    base = baseline("tiny_cpu_20steps")
    info = {}
    killer = _fault_at(tmp_path / "restart", 12, signal.SIGKILL, victim, info)
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                      "experiment.name=restart", "experiment.steps=20", "trainer.checkpoint_every=5", *QUIET, *extra])
    killer.join(timeout=5)
    assert rc == 0 and info
    run = tmp_path / "restart"
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    for want, got in zip(base["steps"], records):
        for key in base["keys"]:
            assert abs(want[key] - got[key]) <= 1e-6, (want["step"], key, want[key], got[key])
    summary = json.loads((run / "summary.json").read_text())
    [restart] = summary["run_restarts"]
    assert "died" in restart["error"] and summary["resumed_from"] >= 10   # the latest good checkpoint
    assert summary["status"] == "finished" and summary["ledger"]["balanced"] == 1
    trained = [tuple(s) for l in (run / "rollouts.jsonl").read_text().splitlines() for s in json.loads(l)["sources"]]
    assert len(trained) == 20 * 16 and len(set(trained)) == len(trained)


def test_killed_weight_sync_coordinator_is_replaced_in_place(tmp_path):
    """Issue #34, the coordinator: SIGKILLed at step ~12 of 20, it is replaced in place at the next sync (plan and
    groups made again with the live members, the failed sync re-run and verified): no run restart, no step redone,
    and the 20 steps still match the synchronous-loop baseline to 1e-6."""
    base = baseline("tiny_cpu_20steps")
    info = {}
    killer = _fault_at(tmp_path / "coord", 12, signal.SIGKILL, "-weight-sync", info)
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                      "experiment.name=coord", "experiment.steps=20", "trainer.checkpoint_every=5", *QUIET])
    killer.join(timeout=5)
    assert rc == 0 and info.get("pid")
    run = tmp_path / "coord"
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21)) and all(r["sync/checksum_ok"] == 1.0 for r in records)
    for want, got in zip(base["steps"], records):
        for key in base["keys"]:
            assert abs(want[key] - got[key]) <= 1e-6, (want["step"], key, want[key], got[key])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["run_restarts"] == [] and summary["status"] == "finished" and summary["ledger"]["balanced"] == 1
    [fault] = summary["faults"]
    assert fault["victim"] == "weight-sync coordinator" and fault["recovery"] == "in place"
    assert fault["replacement"] == "coord-weight-sync.r1" and fault["steps_redone"] == 0 and fault["replaced_s"] < 60
