"""Issue #27 item 4 in CI: one seeded max_staleness 1 run of configs/tiny_cpu.yaml must reach the on-policy band.

The band comes from bench/learning_parity.py (bench/RESULTS.md, "Learning parity at max_staleness 1"): on-policy
seeds 0, 1, 2 of configs/tiny_cpu.yaml averaged 0.476, 0.528 and 0.400 reward over steps 161-200 (the last 20% of a
200-step run; an on-policy run's first 200 steps do not depend on its length). So a 200-step staleness-1 run must
average at least 0.400 there, the lowest on-policy seed. The run is `rollout.deterministic: true` (seed 0), the same
run every time on one machine, so the test does not flake on timing: on the 2-core AMD EPYC machine of 2026-11-27 it
averaged 0.562 over those steps (0.801 over the last 20% of 600 steps; on-policy 0.717-0.756). Its defaults resolve as
a user's would: algorithm.off_policy auto -> decoupled; rollout.running_requests auto -> wait (deterministic).

About 45 s on the 2-core CI machine (200 steps plus startup: 41 s on 2026-11-27).
"""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]

STEPS = 200
ON_POLICY_LAST20 = {0: 0.476, 1: 0.528, 2: 0.400}   # seeds 0-2, steps 161-200 (bench/learning_parity.py's runs)


def test_seeded_staleness_one_run_reaches_the_on_policy_band(tmp_path):
    assert launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                        "experiment.name=parity", "experiment.seed=0", f"experiment.steps={STEPS}", "ray.num_cpus=2",
                        "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "metrics.plots=false",
                        "rollout.max_staleness=1", "rollout.deterministic=true"]) == 0
    run = tmp_path / "parity"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    config = json.loads((run / "config.json").read_text())
    assert config["algorithm"]["off_policy"] == "decoupled" and config["rollout"]["running_requests"] == "wait"
    assert sum(r["staleness/lag_1"] for r in records) > 0.5 * sum(r["rollout/tokens"] for r in records)   # mostly stale
    last = [r["rollout/reward_mean"] for r in records[-STEPS // 5:]]
    reward = sum(last) / len(last)
    floor = min(ON_POLICY_LAST20.values())
    assert reward >= floor, (f"staleness-1 run averaged {reward:.3f} reward over steps {STEPS - STEPS // 5 + 1}-{STEPS}, "
                             f"below the on-policy band {floor:.3f}..{max(ON_POLICY_LAST20.values()):.3f}")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["verified_syncs"] == summary["syncs"] == STEPS + 1 and summary["ledger"]["balanced"] == 1
