"""A dead trainer rank or separate reference worker restarts the run from its latest checkpoint, by itself, and the
run ends exactly where an uninterrupted one does; a dead weight-sync coordinator, reward worker or rollout manager is
replaced in place instead (issue #34: no restart, no step redone; the reward worker's samples are scored again by its
replacement; the manager's replacement continues from the state handed over with the last batch). One run of 20
steps (checkpoints every 3, the reference in a group of its own) SIGKILLs each victim in turn: trainer rank 1 at step
~4, the reward worker at ~8, the coordinator at ~10, reference worker 1 at ~13, the rollout manager at ~17. The run
keeps step snapshots (fault_tolerance.step_snapshots): each restart resumes from the last completed step, not from the
periodic checkpoint, so at most the step the kill interrupted is trained again; the snapshots' RAM is freed at the end.
The 20 steps match the synchronous-loop baseline recorded before the rollout manager existed
(tests/data/tiny_cpu_20steps_baseline.json) to 1e-6; summary.json lists every restart and each in-place repair.
(Each victim used to get a run of its own: five runs, ~160 s on the CI machine.)

The same run is the separate reference group's end-to-end check (it was test_reference_group.py, two runs of its
own): two policy ranks hold no reference, two reference workers load the snapshot the policy wrote and compute the
KL reference's logprobs of each shard, and the run trains exactly as the default (reference inside every policy rank)
does, which is what the recorded baseline is (GRPO with kl_coef 0.02). Each restart is a resume (launch.py's
_supervise sets resume=true): the new group reloads the saved snapshot, which the steps after each restart matching the
baseline to 1e-6 prove; the last segment's timeline (one file per (re)start) shows that group's one load. (A reference
section without a KL term is refused before Ray starts: test_refused_before_ray.py.)"""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402
from baselines import baseline  # noqa: E402
from bench.recovery import kill_in_turn  # noqa: E402   (the benchmark's, one copy)
from rlhf_orch.checkpoint import snapshot_dir  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
KILLS_PROCESSES = True   # the shared Ray is shut down after this module (tests/integration/conftest.py)
QUIET = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "metrics.plots=false"]
VICTIMS = [("-trainer-1", 4), ("-reward-0", 8), ("-weight-sync", 10), ("-reference-1", 13), ("-rollouts", 17)]


def test_each_killed_member_restarts_the_run_or_is_replaced_and_the_run_ends_exactly(tmp_path):
    base = baseline("tiny_cpu_20steps")
    info: list = []
    run = tmp_path / "restart"
    killer = kill_in_turn(run, VICTIMS, info)
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                      "experiment.name=restart", "experiment.steps=20", "trainer.checkpoint_every=3",
                      "fault_tolerance.max_run_restarts=2", "reference.placement=separate", "reference.num_workers=2",
                      "fault_tolerance.step_snapshots=true", *QUIET])
    killer.join(timeout=5)
    assert rc == 0 and [k.get("victim") for k in info] == [v for v, _ in VICTIMS], info
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21)) and all(r["sync/checksum_ok"] == 1.0 for r in records)
    for want, got in zip(base["steps"], records):
        for key in base["keys"]:
            assert abs(want[key] - got[key]) <= 1e-6, (want["step"], key, want[key], got[key])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["ledger"]["balanced"] == 1
    assert summary["ledger"]["trained"] == 20 * 16   # one ledger for all five segments (issue #31)
    restarts = summary["run_restarts"]   # trainer rank 1, reference worker 1
    assert len(restarts) == 2 and all("died" in r["error"] for r in restarts), restarts
    # From the step snapshot of the last completed step (or, if the kill hit that snapshot's write, the one before):
    # never back to the periodic checkpoint (every 3 steps) once it is older than that.
    for r, (victim, step) in zip(restarts, [VICTIMS[0], VICTIMS[3]]):
        assert r["last_step"] >= step and r["steps_redone"] <= 1 and r["resumed_from"] == r["last_step"] - r["steps_redone"], r
    snapped = [r for r in records if "checkpoint/snapshot_s" in r]
    assert len(snapped) >= 10 and all(r["checkpoint/snapshot_gb"] > 0 for r in snapped)
    assert not snapshot_dir(run).exists()   # freed once the run finished
    [fault] = [f for f in summary["faults"] if f.get("victim") == "rollout manager"]
    assert fault["recovery"] == "in place" and fault["replacement"] == "restart-rollouts.r1", fault
    assert fault["steps_redone"] == 0 and fault["replaced_s"] < 60, fault
    [fault] = [f for f in summary["faults"] if f.get("victim") == "weight-sync coordinator"]
    assert fault["recovery"] == "in place" and fault["replacement"].startswith("restart-weight-sync.r")
    assert fault["steps_redone"] == 0 and fault["replaced_s"] < 60
    [fault] = [f for f in summary["faults"] if f.get("victim") == "reward worker 0"]
    assert fault["recovery"] == "in place" and fault["replacement"] == "restart-reward-0.r1", fault
    assert fault["steps_redone"] == 0 and "died" in fault["cause"], fault
    # seconds from each fault to the next completed step (issue #34): in place, a step's time; a restart, far more
    for f in [*summary["faults"], *restarts]:
        assert 0 < f["next_step_s"] < 120, f
    trained = [tuple(s) for l in (run / "rollouts.jsonl").read_text().splitlines() for s in json.loads(l)["sources"]]
    assert len(trained) == 20 * 16 and len(set(trained)) == len(trained)
    # The separate reference group (test_reference_group.py's checks): a KL term really computed against it, and the
    # group of the last segment (after reference worker 1's restart) loaded the saved snapshot once.
    assert records[-1]["train/kl"] > 0
    events = [json.loads(l) for l in (run / "timeline.jsonl").read_text().splitlines()]
    assert sum(e.get("actor") == "reference" and e.get("phase") == "load" for e in events) == 1, events[:5]
