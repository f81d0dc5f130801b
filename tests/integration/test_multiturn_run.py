"""Multi-turn rollouts end to end on CPU (issue #29): real Ray actors, two DeepSpeed ranks, the two hf engines of
configs/tiny_cpu.yaml, `rollout.multi_turn` with the calculator tool.

The warm start teaches the tiny model to answer `a+b=` with `calc(a+b)` (a file dataset whose answers are the
calls), so from the first step most trajectories call the tool and get an observation back, then take a second turn.
The run must train on the model's tokens only: the engines' logprobs of every trained token equal the trainer's
(`rollout/logprob_diff_max`, over the response mask: an observation in it has engine logprob 0 and would show), every
sync is verified, and the turn metrics show the second turns and the observations.
"""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
QUIET = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "metrics.plots=false"]


def test_multi_turn_trajectories_train_on_the_models_tokens_only(tmp_path):
    rows = tmp_path / "calls.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": f"calc({a}+{b})"}) + "\n"
                            for a in range(10) for b in range(10)))
    steps = 2
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                      "experiment.name=turns", f"experiment.steps={steps}", f"data.source={rows}", "~data.max_operand",
                      "data.max_prompt_tokens=8", "trainer.warm_start_steps=150", "trainer.warm_start_real_answers=true",
                      "engines.0.sampling.max_new_tokens=10", "engines.1.sampling.max_new_tokens=10",
                      "rollout.multi_turn.max_turns=2", "rollout.multi_turn.max_observation_tokens=4",
                      "rollout.multi_turn.max_total_tokens=24", *QUIET])
    assert rc == 0
    run = tmp_path / "turns"
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert r["sync/checksum_ok"] == 1.0 and r["ledger/balanced"] == 1.0
        assert 1.0 < r["rollout/turns_mean"] <= 2.0 and r["rollout/tool_calls_mean"] > 0.3, r
        assert 0 < r["rollout/observation_tokens_mean"] <= 4.0
        # the trainer scored exactly the model's tokens: observations (engine logprob 0) are outside the mask
        assert r["rollout/logprob_diff_max"] < 1e-3, r["rollout/logprob_diff_max"]
        assert r["staleness/lag_0"] == r["rollout/tokens"]   # trained tokens, observations not counted
    summary = json.loads((run / "summary.json").read_text())
    assert summary["verified_syncs"] == summary["syncs"] == steps + 1 and summary["status"] == "finished"
