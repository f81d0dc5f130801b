"""Built-in agent functions for `rollout.agent` (rlhf_orch/rollout/agent.py has the client they drive).

    builtin:calculator   the plain-text calculator loop of rollout/multiturn.py as an agent: a turn, the
                         calculator's observation (`=<value> `), the next turn, until a turn calls no tool or a
                         limit ends it. Seeded, it makes exactly MultiTurn's trajectories (a test checks it).
    builtin:single_turn  one model turn: a row of a multi-turn dataset that needs none (verl's single_turn_agent).
    builtin:tool_chat    a tool-calling loop over the tokenizer's chat template: the row's `messages` (or its
                         prompt as one user message) with the tools of TOOL_SCHEMAS in OpenAI function format; each
                         Hermes-style tool call in a turn is run and answered with a `tool` message, until a turn
                         calls none or a limit ends it (verl's tool_agent). A row with tools_kwargs (at the top or
                         in extra_info, as verl's datasets have them) is offered only the tools it names.

Both return None: the run's reward function scores the sample's text. Not here: environments with their own state
(write an agent function).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # annotations only: rollout/agent.py imports this module for its built-ins
    from rlhf_orch.rollout.agent import AgentClient

BUILTINS = ("calculator", "tool_chat", "single_turn")
# verl's agent names (a row's agent_name in its agent datasets) -> ours; rollout.agents may override them
VERL_AGENTS = {"single_turn_agent": "builtin:single_turn", "tool_agent": "builtin:tool_chat"}

# OpenAI function-call schemas of the built-in tools, and how a call's arguments become the text the tool reads
TOOL_SCHEMAS = {
    "calculator": ({"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an integer expression with + - * and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
        lambda args: f"calc({args.get('expression', '')})"),
    "python": ({"type": "function", "function": {
        "name": "python", "description": "Run a Python program (standard library only, no network, no files outside "
                                         "its folder, a few seconds); answers with what it printed.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
        lambda args: f"```python\n{args.get('code', '')}\n```"),
}


async def calculator(client: AgentClient, row: dict) -> None:
    await tool_loop(client, "calculator")


async def tool_loop(client: AgentClient, tool: str) -> None:
    """A turn, the tool's observation of its text, the next turn, until a turn calls no tool or a limit ends it
    (rollout.multi_turn without an agent function runs this: rollout/multiturn.MultiTurn)."""
    while True:
        turn = await client.generate()
        if client.done:
            return None
        obs = await client.tool(tool, turn.text)
        if obs is None:
            return None
        client.observe(obs)


async def single_turn(client: AgentClient, row: dict) -> None:
    await client.generate()


def row_tools(row: dict) -> list[str] | None:
    """The tools a row's tools_kwargs names (verl: extra_info.tools_kwargs, {tool: {create_kwargs: ...}}), or None."""
    kwargs = row.get("tools_kwargs") or (row.get("extra_info") or {}).get("tools_kwargs")
    return list(kwargs) if isinstance(kwargs, dict) and kwargs else None


async def tool_chat(client: AgentClient, row: dict) -> None:
    wanted = row_tools(row)
    names = [n for n in TOOL_SCHEMAS if n in client.tool_names and (wanted is None or n in wanted)]
    tools = [TOOL_SCHEMAS[n][0] for n in names]
    if "messages" in row:
        messages = [dict(m) for m in row["messages"]]
    else:   # a row's prompt text, or (evaluation calls carry no rows) the prompt's own text
        messages = [{"role": "user", "content": row.get("prompt", client.prompt_text)}]
    turn = await client.chat(messages, tools=tools)
    while not client.done and turn.tool_calls:
        messages.append({"role": "assistant", "content": turn.text})
        for call in turn.tool_calls:
            if call.error or call.name not in names:
                result = call.error or f"error: no tool {call.name!r}"
            else:
                result = await client.tool(call.name, TOOL_SCHEMAS[call.name][1](call.arguments))
                result = "error: no call" if result is None else result
            messages.append({"role": "tool", "name": call.name, "content": result})
        turn = await client.chat(messages, tools=tools)
    return None
