"""Both ways a sync's loads are checked, in one run: the colocated engine compares every tensor with the trainer's
checksums itself (its mailbox stream), while the dedicated one, over broadcast, reports its checksums and stays paused
until the coordinator has compared them (`hold`, then `commit`): the path tensor-parallel SGLang takes, which the hf
engine's `unchecked_broadcast` test hook forces here. The run must train exactly as the default one: the first steps of
the recorded baseline (tests/data/tiny_cpu_20steps_baseline.json) to 1e-6, sync digests included."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402
from baselines import baseline  # noqa: E402
from engine_hooks import set_engine_hooks  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]


def test_a_self_checking_engine_and_one_the_coordinator_checks_in_one_sync(tmp_path, monkeypatch):
    base = baseline("tiny_cpu_20steps")
    set_engine_hooks(monkeypatch, {}, {"unchecked_broadcast": True})   # engines.0: colocated; engines.1: dedicated
    name = "mixed"
    assert launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                        f"experiment.name={name}", "experiment.steps=3", "ray.num_cpus=2", "metrics.trackers=[jsonl]",
                        "metrics.ray_metrics=false", "metrics.plots=false"]) == 0
    records = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for want, got in zip(base["steps"], records):
        for key in base["keys"]:
            assert abs(want[key] - got[key]) <= 1e-6, (want["step"], key, want[key], got[key])
        assert got["sync/held_engines"] == 1 and got["sync/checksum_ok"] == 1.0
