"""`trainer.offload: auto` on one GPU: the colocated runs of configs/vllm_coloc_1gpu.yaml (vLLM, sleep_level 2) and
an hf engine colocated the same way move everything in step 1, measure, and then, on a GPU with room for both
(a tiny model, a 2 GiB KV cache), move nothing: hand-overs under 0.1 s, nothing moved, the same verified syncs.

    python -m pytest -q -m gpu tests/gpu/test_colocation_auto.py
"""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

pytestmark = pytest.mark.gpu
QUIET = ["metrics.ray_metrics=false", "metrics.plots=false", "metrics.trackers=[jsonl]"]


def _run(tmp_path, config, name, *overrides):
    import launch
    rc = launch.main(["--config", str(ROOT / config), f"experiment.output_dir={tmp_path}", f"experiment.name={name}",
                      "experiment.steps=4", "trainer.warm_start_steps=2", "trainer.offload=auto", *QUIET, *overrides])
    assert rc == 0
    return [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _check(recs):
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    first, rest = recs[0], recs[1:]
    # step 1: the configured hand-overs (offload + sleep), measured
    assert "colocate/offload_s" in first and "colocate/sleep_s" in first and first["colocate/moved_gb"] > 0
    # a big GPU and a tiny model: both tenants fit side by side, so nothing moves after step 1
    assert (first["colocate/plan_offload"], first["colocate/plan_sleep"]) == (0.0, 0.0)
    for r in rest:
        assert r["colocate/handover_s"] < 0.1, r["step"]
        assert r["perf/to_generate_s"] + r["perf/to_train_s"] < 0.1, r["step"]
        assert r["colocate/moved_gb"] == 0.0
        assert not any(k in r for k in ("colocate/offload_s", "colocate/reload_s", "colocate/sleep_s",
                                        "colocate/wake_kv_s", "colocate/plan_offload"))
    for r in recs:
        assert r["sync/checksum_ok"] == 1.0


@pytest.fixture(autouse=True)
def big_gpu():
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    if total < 40:
        pytest.skip(f"a GPU with room for trainer and engine side by side (has {total:.0f} GiB)")


def test_auto_vllm_colocated_moves_nothing_after_step_one(tmp_path):
    pytest.importorskip("vllm")
    _check(_run(tmp_path, "configs/vllm_coloc_1gpu.yaml", "auto_vllm"))


def test_auto_hf_colocated_moves_nothing_after_step_one(tmp_path):
    _check(_run(tmp_path, "configs/tiny_gpu.yaml", "auto_hf",
                "engines=[{kind: hf, name: c, placement: colocated, sleep_level: 2, sampling: {max_new_tokens: 4}}]"))
