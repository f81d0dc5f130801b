"""Both sync paths in one run: an engine that takes the sync in one call (mailbox stream or self-checking broadcast)
beside one the coordinator feeds bucket by bucket (the path SGLang engines take; the hf engine's `stepwise_sync`
test hook forces it). Either mix must train exactly as the default run: the first steps of the recorded baseline
(tests/data/tiny_cpu_20steps_baseline.json) to 1e-6, sync digests included."""
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


@pytest.mark.parametrize("stepwise", [0, 1])   # engines.0: colocated (ipc); engines.1: dedicated (broadcast)
def test_one_call_and_stepwise_engines_in_one_sync(tmp_path, monkeypatch, stepwise):
    base = baseline("tiny_cpu_20steps")
    set_engine_hooks(monkeypatch, *({"stepwise_sync": True} if i == stepwise else {} for i in range(2)))
    name = f"mixed{stepwise}"
    assert launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                        f"experiment.name={name}", "experiment.steps=3", "ray.num_cpus=2", "metrics.trackers=[jsonl]",
                        "metrics.ray_metrics=false", "metrics.plots=false"]) == 0
    records = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for want, got in zip(base["steps"], records):
        for key in base["keys"]:
            assert abs(want[key] - got[key]) <= 1e-6, (want["step"], key, want[key], got[key])
        assert got["sync/one_call_engines"] == 1 and got["sync/checksum_ok"] == 1.0
