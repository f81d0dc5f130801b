"""The critic role in both placements, end to end on CPU (real Ray actors, real DeepSpeed over gloo), against PPO
numbers recorded before either existed (tests/data/tiny_cpu_ppo_6steps_baseline.json: main 6ea03d5, the critic inside
every policy rank, one critic warm-up step), to 1e-6, sync digests included:

- colocated, with trainer.offload: the critic's states now leave the "GPU" with the policy's at every hand-over to
  the engines (on CPU a CPU-to-CPU move: the bookkeeping is exercised, the numbers must not move);
- separate: a critic group of two ranks of its own (its own process group and DeepSpeed engine) computes the values
  of each policy shard and trains while the policy ranks train; critic rank 1's process is killed (SIGKILL) after
  step 3 and the run restarts itself (the resume path) from its step-2 checkpoint, so the group's checkpoint (inside
  the policy's) is written and loaded too; the records before the checkpoint are kept as they were, and all 6 steps
  are the recorded numbers.
"""
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
KILLS_PROCESSES = True   # the shared Ray is shut down after this module (tests/integration/conftest.py)
QUIET = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "metrics.plots=false"]
COMMON = ["reward.function=tests.ppo_rewards:starts_with_odd_digit", "critic.warmup_steps=1", *QUIET]
BASE = baseline("tiny_cpu_ppo_6steps")


def _run(tmp_path, name, steps, *extra):
    assert launch.main(["--config", str(ROOT / "configs/tiny_cpu_ppo.yaml"), f"experiment.output_dir={tmp_path}",
                        f"experiment.name={name}", f"experiment.steps={steps}", *COMMON, *extra]) == 0
    return [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _same_as_recorded(records):
    assert [r["step"] for r in records] == [s["step"] for s in BASE["steps"]]
    for want, got in zip(BASE["steps"], records):
        assert set(want) - {"step"} <= set(got), sorted(set(want) - set(got))
        for key in set(want) - {"step"}:
            assert abs(want[key] - got[key]) <= 1e-6, (want["step"], key, want[key], got[key])
    assert records[0]["train/policy_frozen"] == 1.0 and "train/policy_frozen" not in records[1]   # the warm-up step


def test_colocated_critic_offloads_with_the_policy_and_trains_as_before(tmp_path):
    records = _run(tmp_path, "coloc", 6, "trainer.offload=true")
    _same_as_recorded(records)
    assert all(r["colocate/offload_s"] > 0 and r["colocate/reload_s"] > 0 for r in records[1:])
    assert not any("perf/critic_train_s" in r for r in records)   # no critic group: the critic is in the ranks


def test_separate_critic_group_restarts_after_a_kill_and_resumes_exactly(tmp_path):
    """A critic group of two ranks of its own, 6 steps: critic rank 1's process is killed (SIGKILL) after step 3 and
    the run restarts itself from its step-2 checkpoint (resume=true, as a user's resume: the group's own DeepSpeed
    checkpoint inside the policy's is loaded) and goes on to step 6, on the recorded numbers. (Before: the same run
    stopped after step 4 and resumed to 6 by hand, a third start-up through the same resume path.)"""
    apart = ["critic.placement=separate", "critic.num_ranks=2", "trainer.checkpoint_every=2"]
    info = {}
    killer = _fault_at(tmp_path / "apart", 3, signal.SIGKILL, "-critic-1", info)
    records = _run(tmp_path, "apart", 6, *apart)
    killer.join(timeout=5)
    assert info.get("pid") and "error" not in info, info
    summary = json.loads((tmp_path / "apart" / "summary.json").read_text())
    [restart] = summary["run_restarts"]
    assert "critic" in restart["error"] and summary["resumed_from"] >= 2 and summary["status"] == "finished", summary
    resumed_from = summary["resumed_from"]
    # the records up to the checkpoint the restart went on from are kept as written before the kill
    assert records[:resumed_from] == [json.loads(l) for l in info["lines"][:resumed_from]]
    ckpt = tmp_path / "apart" / "checkpoints"
    for tag in sorted({f"step{resumed_from}", "step4", "step6"}):   # the one loaded; those written after the restart
        assert (ckpt / tag / "critic").is_dir() and any((ckpt / tag / "critic").iterdir()), tag   # the group's own
    _same_as_recorded(records)
    # The group's own timings: its value pass and its step (beside the policy's), every step.
    assert all(r["perf/critic_values_s"] > 0 and r["perf/critic_train_s"] > 0 for r in records)
