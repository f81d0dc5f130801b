"""verl's agent datasets (issue #29 item 6): a parquet file in verl's multi-turn layout (chat-message prompts,
reward_model.ground_truth, extra_info with tools_kwargs, agent_name) loads as it is; each row runs the agent it
names (verl's tool_agent / single_turn_agent, or rollout.agents), tool_chat offers only the tools a row's
tools_kwargs names, data.agent_key points elsewhere, and unknown names are refused before launch."""
from pathlib import Path

import datasets
import pytest

from rlhf_orch.config import load_config
from rlhf_orch.data.prepare import rows_for
from rlhf_orch.engines.base import SamplingParams
from rlhf_orch.errors import ConfigError, RolloutError
from rlhf_orch.rollout import agents
from rlhf_orch.rollout.agent import AgentRunner
from rlhf_orch.rollout.agent_specs import agent_table, resolve_agent
from rlhf_orch.rollout.multiturn import TOOLS
from test_agent import ChatModel, ChatTok

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "examples/tiny_chat_template.jinja"


def verl_agent_rows() -> list[dict]:
    """The layout of verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py, with the tiny model's characters."""
    rows = []
    for i in range(4):
        tool = i % 2 == 0
        rows.append({"data_source": "openai/gsm8k", "ability": "math", "agent_name": "tool_agent" if tool
                     else "single_turn_agent",
                     "prompt": [{"role": "system", "content": "use the calculator"},
                                {"role": "user", "content": f"what is {i}+{i}?"}],
                     "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
                     "extra_info": {"split": "train", "index": i, "need_tools_kwargs": tool, "agent": "tool_agent",
                                    "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": str(2 * i)}}}}})
    return rows


def write(tmp_path, rows) -> str:
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def config(path, *more):
    return load_config("configs/tiny_cpu_tool.yaml", [
        f"data.source={path}", "data.answer_key=reward_model.ground_truth", f"data.chat_template_path={TEMPLATE}",
        "data.max_prompt_tokens=64", "data.prompts_per_step=4", "model.tiny.max_position_embeddings=128", "rollout.agent=builtin:calculator",
        "reward.function=rlhf_orch.rewards.builtin:exact_match", *more])


def test_verls_agent_parquet_loads_as_it_is(tmp_path):
    cfg = config(write(tmp_path, verl_agent_rows()))
    rows = rows_for(cfg)
    assert [r["agent_name"] for r in rows] == ["tool_agent", "single_turn_agent"] * 2
    assert rows[0]["prompt"] == "system: use the calculator user: what is 0+0? assistant:"
    assert rows[0]["messages"][1] == {"role": "user", "content": "what is 0+0?"}   # kept for chat()
    assert rows[2]["extra_info"]["tools_kwargs"]["calculator"]["create_kwargs"] == {"ground_truth": "4"}
    assert rows[1]["answer"] == "2"


def test_unknown_agent_names_and_the_agent_key_override(tmp_path):
    rows = verl_agent_rows()
    rows[3]["agent_name"] = "react_agent"
    path = write(tmp_path, rows)
    with pytest.raises(ConfigError, match=r"data.agent_key: 1 rows of .* name agents rollout.agents does not define "
                                          r"\(first: row 3, 'react_agent'; defined: single_turn_agent, tool_agent\)"):
        config(path)
    cfg = config(path, "rollout.agents={react_agent: 'builtin:tool_chat'}")   # defined: loads
    assert rows_for(cfg)[3]["agent_name"] == "react_agent"
    with pytest.raises(ConfigError, match=r"data.agent_key: 4 rows .*\(first: row 0, '0'"):
        config(path, "data.agent_key=extra_info.index")   # indices name no agent
    cfg = config(path, "data.agent_key=extra_info.agent")
    assert {r["extra_info"]["agent"] for r in rows_for(cfg)} == {"tool_agent"}
    with pytest.raises(ConfigError, match="rollout.agents.nope: no built-in agent"):
        config(path, "rollout.agents={nope: 'builtin:nope'}")


def test_each_row_runs_the_agent_it_names_with_the_tools_it_names():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    rows = [{"prompt": "p0", "messages": [{"role": "user", "content": "what is 2+2?"}], "agent_name": "tool_agent",
             "extra_info": {"tools_kwargs": {"calculator": {}}}},
            {"prompt": "p1", "agent_name": "single_turn_agent"},
            {"prompt": "p2"}]   # names none: rollout.agent
    model, tok = ChatModel([call, "4"]), ChatTok()
    table = agent_table("builtin:single_turn", {})
    default = resolve_agent(table.pop(None))
    runner = AgentRunner(model.generate, default, tok, {n: make() for n, make in TOOLS.items()}, 4, 600, 300, 20.0,
                         None, {n: resolve_agent(s) for n, s in table.items()}, "agent_name")
    ids = lambda text: tok.encode(text)
    s0, s1, s2 = runner.generate([ids("x"), ids("y"), ids("z")], SamplingParams(max_new_tokens=200), rows)
    assert s0.turn_stats["turns"] == 2 and s0.turn_stats["tool_calls"] == 1
    # only the calculator offered (tools_kwargs names it), not the python tool
    assert tok.decode(s0.prompt_ids, False).split("\n")[1] == 'tools: ["calculator"]<|im_end|>'
    assert s1.turn_stats["turns"] == 1 and s2.turn_stats["turns"] == 1 and s1.prompt_ids == ids("y")
    assert agents.row_tools(rows[1]) is None and agents.row_tools(rows[0]) == ["calculator"]
    with pytest.raises(RolloutError, match="row names agent 'other'"):
        runner.generate([ids("x")], SamplingParams(max_new_tokens=5), [{"agent_name": "other"}])
