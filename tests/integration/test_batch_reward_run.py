"""A batch, async reward function in a real run: `@rlhf_orch.rewards.batched async def fn(responses, rows)` from a
test module is imported by the Ray reward worker, awaited there once per chunk of samples (on the worker's event
loop, bounded by reward.timeout_s), and its values are the rewards the run trains on and logs. 2 GRPO steps of
configs/tiny_cpu.yaml (8 prompts x 4 samples) on one DeepSpeed rank and one hf engine, no warm start."""
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

import pytest

from rlhf_orch.rewards import batched

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
RECORD = "RLHF_ORCH_TEST_REWARD_RECORD"
QUIET = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "metrics.plots=false"]


def value(response: str, row: dict) -> float:
    """Exact match plus a length term: not a value the built-in exact_match could have produced."""
    return (1.0 if response.strip() == row["answer"] else 0.0) + 0.01 * len(response)


@batched
async def async_batch_reward(responses: list[str], rows: list[dict]) -> list[float]:
    """Scores a whole chunk; appends the call (its pid, size, values, and whether it ran as a task on an event loop)
    to $RLHF_ORCH_TEST_REWARD_RECORD (the reward worker inherits the driver's environment on a local Ray)."""
    await asyncio.sleep(0.01)   # a real await: the call must run as a coroutine, not be called like a sync function
    values = [value(r, row) for r, row in zip(responses, rows)]
    with open(os.environ[RECORD], "a", encoding="utf-8") as f:
        f.write(json.dumps({"pid": os.getpid(), "on_loop": asyncio.current_task() is not None, "values": values,
                            "responses": responses, "answers": [row["answer"] for row in rows]}) + "\n")
    return values


def test_async_batch_reward_scores_the_run_in_the_reward_worker(tmp_path, reward_record):
    record = reward_record
    fn = "tests.integration.test_batch_reward_run:async_batch_reward"
    assert launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                        "experiment.name=batch_reward", "experiment.steps=2", "trainer.warm_start_steps=0",
                        "trainer.num_ranks=1", "engines=[{kind: hf, sampling: {temperature: 1.0, max_new_tokens: 4}}]",
                        "data.prompts_per_step=8", "algorithm.group_size=4", f"reward.function={fn}",
                        "reward.timeout_s=60", *QUIET]) == 0
    run = tmp_path / "batch_reward"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished", summary
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    calls = [json.loads(l) for l in record.read_text().splitlines()]
    # The pre-launch check called it once in the driver (two rows, placeholder responses); the rest are the worker's.
    assert [len(c["values"]) for c in calls if c["pid"] == os.getpid()] == [2]
    worker = [c for c in calls if c["pid"] != os.getpid()]
    assert worker and all(c["on_loop"] for c in worker)
    assert len({c["pid"] for c in worker}) == 1                        # reward.num_workers 1
    assert max(len(c["values"]) for c in worker) > 1                   # whole chunks, not one call per sample
    for c in worker:   # the function's own values, recomputed from what it was given
        assert c["values"] == [value(r, {"answer": a}) for r, a in zip(c["responses"], c["answers"])]
    scored = [v for c in worker for v in c["values"]]
    per_step = 8 * 4                                                   # prompts_per_step x group_size
    assert len(scored) == 2 * per_step   # max_staleness 0: step 2's groups start after step 1's sync, in order
    assert any(v % 1 for v in scored)                                  # the length term: not exact_match's 0/1
    for step, r in enumerate(records):
        step_values = scored[step * per_step:(step + 1) * per_step]
        assert r["rollout/reward_mean"] == pytest.approx(statistics.fmean(step_values), abs=1e-6)
