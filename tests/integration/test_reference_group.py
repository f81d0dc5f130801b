"""A separate reference group end to end on CPU (real Ray actors: two policy ranks hold no reference; two reference
workers load the snapshot the policy wrote and compute the KL reference's logprobs of each shard, handed to the
ranks as object references). The run must train exactly as the default (reference inside every policy rank): the
first steps of the recorded baseline (tests/data/tiny_cpu_20steps_baseline.json, GRPO with kl_coef 0.02) to 1e-6,
sync digests included. A resume reloads the saved snapshot into the group. (A reference section without a KL term
is refused before Ray starts: test_refused_before_ray.py.)"""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402
from baselines import baseline  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
QUIET = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "metrics.plots=false"]
APART = ["reference.placement=separate", "reference.num_workers=2"]


def _run(tmp_path, name, steps, *extra):
    assert launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                        f"experiment.name={name}", f"experiment.steps={steps}", *QUIET, *APART, *extra]) == 0
    return [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_separate_reference_trains_as_the_colocated_one_and_resumes(tmp_path):
    base = baseline("tiny_cpu_20steps")
    _run(tmp_path, "apart", 2)
    records = _run(tmp_path, "apart", 4, "resume=true")          # steps 3-4 on the reloaded snapshot
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for want, got in zip(base["steps"], records):
        for key in base["keys"]:
            assert abs(want[key] - got[key]) <= 1e-6, (want["step"], key, want[key], got[key])
    assert records[-1]["train/kl"] > 0
    events = [json.loads(l) for l in (tmp_path / "apart" / "timeline.jsonl").read_text().splitlines()]
    assert sum(e.get("actor") == "reference" and e.get("phase") == "load" for e in events) == 1, events[:5]
