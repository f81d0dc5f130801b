"""Evaluation during and at the end of a run, with real Ray actors (2 DeepSpeed ranks, a colocated and a dedicated hf
engine, a reward worker):
- configs/tiny_cpu.yaml with eval.every=2 evaluates after steps 2 and 4 and after the last (5), writes eval/ metrics
  to metrics.jsonl at those steps and the last evaluation to summary.json, and trains exactly as the same run with
  evaluation off (the first 5 steps of the session's 20-step baseline run, `baseline_run` in integration/conftest.py:
  the same command but the step count, checkpoints and plots): same rewards, losses, sync digests, data order and
  engine sampling RNGs after step 5.
(configs/gsm8k_cpu.yaml's evaluation on its folder's test split is checked in test_gsm8k_run.py, in its run.)
"""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
QUIET = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false"]
TRAINING_KEYS = ("rollout/reward_mean", "rollout/reward_std", "rollout/tokens", "train/loss", "train/kl",
                 "train/grad_norm", "sync/digest", "sync/version")


def _run(tmp_path, name, *extra):
    assert launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                        f"experiment.name={name}", *QUIET, *extra]) == 0
    run = tmp_path / name
    return run, [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


def _engine_rngs(run):
    import torch
    return torch.load(run / "checkpoints" / "step5" / "rl_state.pt")   # as step 5 left them (before its evaluation)


def test_eval_every_two_steps_leaves_training_unchanged(tmp_path, baseline_run):
    import torch
    on, rec_on = _run(tmp_path, "eval_on", "experiment.steps=5", "eval.every=2", "eval.n=4", "eval.max_prompts=12")
    off, rec_off = baseline_run[0], baseline_run[1][:5]   # the same run without evaluation: its first 5 steps
    assert [r["step"] for r in rec_on] == [r["step"] for r in rec_off] == [1, 2, 3, 4, 5]
    for a, b in zip(rec_on, rec_off):
        for key in TRAINING_KEYS:
            assert abs(a[key] - b[key]) <= 1e-6, (a["step"], key, a[key], b[key])
        assert not any(k.startswith("eval/") for k in b)
    # the same draws in the same order, and the engines' sampling RNGs where the run without evaluation left them
    assert (on / "rollouts.jsonl").read_text() == "".join((off / "rollouts.jsonl").read_text().splitlines(True)[:5])
    rng_on, rng_off = _engine_rngs(on), _engine_rngs(off)
    assert sorted(rng_on) == sorted(rng_off) and len(rng_on) == 2
    assert all(torch.equal(rng_on[k], rng_off[k]) for k in rng_on)

    evals = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in rec_on}
    assert [s for s, e in evals.items() if e] == [2, 4, 5]   # every 2 steps, and after the last
    for step in (2, 4, 5):
        e = evals[step]
        assert e["eval/prompts"] == 12 and e["eval/k"] == 4 and e["eval/s"] > 0
        assert 0.0 <= e["eval/pass@1"] <= e["eval/pass@k"] <= 1.0
        # exact match gives 0 or 1 and the threshold is 1: the mean reward is the share of passing samples
        assert abs(e["eval/reward_mean"] - e["eval/pass@1"]) < 1e-9
        assert 0 < e["eval/response_len_mean"] <= 4
    assert any(0 < evals[s]["eval/pass@1"] for s in (2, 4, 5))   # a real signal, not zeros (warm-started policy)
    summary = json.loads((on / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["eval"] == {"step": 5, **evals[5]}
    assert "eval" not in json.loads((off / "summary.json").read_text())
    events = [json.loads(l) for l in (on / "timeline.jsonl").read_text().splitlines()]
    assert {e["actor"] for e in events if e["phase"] == "eval"} == {"driver", "engine:colocated", "engine:dedicated"}
    assert (on / "plots" / "reward.png").stat().st_size > 1000
