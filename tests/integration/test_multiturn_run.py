"""Multi-turn rollouts end to end on CPU (issue #29): configs/tiny_cpu_tool.yaml, real Ray actors, two DeepSpeed
ranks, two hf engines, `rollout.multi_turn` with the calculator tool, 120 steps.

The warm start teaches the form of a two-turn trajectory (the call `calc(a+b)`, then digits); the tool answers
`=<sum> `; the reward gives half for a call that got the sum and half for a last turn that repeats it, which the
warm start does not teach (its last turns hold another row's digits). The run must learn it: the reward of the last
20 steps clearly above the first 20's. And it must train on the model's tokens only: the engines' logprobs of every
trained token equal the trainer's (`rollout/logprob_diff_max`, over the response mask: an observation in it has
engine logprob 0 and would show), every sync is verified, the turn metrics show the second turns and observations.
"""
import json
import os
import signal
import statistics
import sys
from pathlib import Path

import openai
import pytest
import ray

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
QUIET = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "metrics.plots=false"]


def test_multi_turn_run_learns_to_use_the_tool_and_trains_on_the_models_tokens_only(tmp_path):
    steps = 120
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu_tool.yaml"), f"experiment.output_dir={tmp_path}",
                      "experiment.name=turns", f"experiment.steps={steps}", *QUIET])
    assert rc == 0
    run = tmp_path / "turns"
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert r["sync/checksum_ok"] == 1.0 and r["ledger/balanced"] == 1.0
        assert 1.5 < r["rollout/turns_mean"] <= 2.0 and r["rollout/tool_calls_mean"] > 0.5, r
        assert 0 < r["rollout/observation_tokens_mean"] <= 5.0
        # the trainer scored exactly the model's tokens: observations (engine logprob 0) are outside the mask
        assert r["rollout/logprob_diff_max"] < 1e-3, r["rollout/logprob_diff_max"]
        assert r["staleness/lag_0"] == r["rollout/tokens"]   # trained tokens, observations not counted
    first = statistics.mean(r["rollout/reward_mean"] for r in records[:20])
    last = statistics.mean(r["rollout/reward_mean"] for r in records[-20:])
    # 2026-11-28 (Intel Xeon VM): 0.53 -> 0.90; the half for the call comes mostly from the warm start
    assert last > first + 0.2 and last > 0.75, (first, last)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["verified_syncs"] == summary["syncs"] == steps + 1 and summary["status"] == "finished"



async def turns_agent(client, row) -> float:
    """The calculator loop as an agent function (rollout.agent) that scores its own trajectory by its number of
    model turns (reward.function: rlhf_orch.rewards.builtin:agent_reward), so the step's mean reward must equal its
    rollout/turns_mean exactly. Its first turn comes through the OpenAI client and the engine's endpoint
    (rollout.openai_endpoint), the others through the client itself. It reads its row: the tool's answer must be
    the row's sum."""
    oai = openai.AsyncOpenAI(base_url=client.base_url, api_key="none", max_retries=0)
    text = (await oai.completions.create(model="policy", prompt=row["prompt"])).choices[0].text
    await oai.close()
    while not client.done:
        obs = await client.tool("calculator", text)
        if obs is None:
            break
        assert obs == f"={row['sum']} " or text != f"calc({row['prompt'][:-1]})", (obs, row)
        client.observe(obs)
        text = (await client.generate()).text
    return float(client.stats["turns"])


def test_an_agent_function_runs_the_trajectories_and_gives_the_rewards(tmp_path):
    """rollout.agent end to end: the manager sends each group's row to its engine's agent runner, the agent's
    reward is each sample's (the step's mean reward equals its mean number of turns), each engine serves an
    OpenAI-compatible endpoint (listed in the run folder), with the turn metrics and the token-exactness check of
    the run above."""
    steps = 4
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu_tool.yaml"), f"experiment.output_dir={tmp_path}",
                      "experiment.name=agent", f"experiment.steps={steps}", "trainer.warm_start_steps=300",
                      "rollout.agent=tests.integration.test_multiturn_run:turns_agent", "rollout.openai_endpoint=true",
                      "reward.function=rlhf_orch.rewards.builtin:agent_reward", *QUIET])
    assert rc == 0
    records = [json.loads(l) for l in (tmp_path / "agent" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert r["sync/checksum_ok"] == 1.0 and r["ledger/balanced"] == 1.0
        assert r["rollout/turns_mean"] > 1.0 and r["rollout/logprob_diff_max"] < 1e-3, r
        assert r["rollout/reward_mean"] == pytest.approx(r["rollout/turns_mean"], abs=1e-9), r
    urls = json.loads((tmp_path / "agent" / "openai_endpoints.json").read_text())
    assert sorted(urls) == ["colocated", "dedicated"] and all(u.startswith("http://127.0.0.1:") for u in urls.values())


_turns_here = {"n": 0}


async def dies_mid_trajectory(client, row) -> None:
    """builtin:calculator's loop, except that the engine process named ...-engine-dedicated kills itself (SIGKILL)
    right after its 80th first turn: in step 2, with trajectories of that call between their turns."""
    turn = await client.generate()
    _turns_here["n"] += 1
    if _turns_here["n"] == 80 and ray.get_runtime_context().get_actor_name().endswith("-engine-dedicated"):
        os.kill(os.getpid(), signal.SIGKILL)
    while not client.done:
        obs = await client.tool("calculator", turn.text)
        if obs is None:
            break
        client.observe(obs)
        turn = await client.generate()


def test_an_engine_killed_mid_trajectory_loses_and_repeats_nothing(tmp_path):
    """The dedicated engine's process dies between two turns of its trajectories (max_engine_restarts 0): its
    groups go back to the queue whole and run on the colocated engine; every step trains its 16 groups, none twice
    (the ledger balances), the run finishes, and openai_endpoints.json no longer lists the dead engine. At
    max_staleness 1 with partial rollouts and partial_extra_lag 1: syncs pause turns mid-decode and the turns go on
    with the new weights (a turn asked for during a pause waits for it to end); a trajectory still running at its step
    may be trained a step later, its first tokens at most two versions old (checked on every token)."""
    steps = 4
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu_tool.yaml"), f"experiment.output_dir={tmp_path}",
                      "experiment.name=killed", f"experiment.steps={steps}", "trainer.warm_start_steps=0",
                      "rollout.agent=tests.integration.test_multiturn_run:dies_mid_trajectory",
                      "fault_tolerance.max_engine_restarts=0", "rollout.max_staleness=1",
                      "rollout.partial_rollouts=true", "rollout.partial_extra_lag=1", "rollout.openai_endpoint=true",
                      *QUIET])
    assert rc == 0
    run = tmp_path / "killed"
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records[-1]["fault/engines_live"] == 1 and all(r["rollout/turns_mean"] >= 1.0 for r in records)
    assert all(r["staleness/max_lag"] <= 2 and r["staleness/lag_0"] + r["staleness/lag_1"] + r["staleness/lag_2"]
               == r["rollout/tokens"] for r in records)
    summary = json.loads((run / "summary.json").read_text())
    [fault] = summary["faults"]
    assert fault["engine"] == "dedicated" and "died" in fault["cause"]
    ledger = summary["ledger"]
    assert ledger["balanced"] == 1 and ledger["trained"] == steps * 16 and ledger["requeued_on_failure"] > 0, ledger
    # the run folder lists the endpoints that serve: the dead engine's is gone
    assert sorted(json.loads((run / "openai_endpoints.json").read_text())) == ["colocated"]
