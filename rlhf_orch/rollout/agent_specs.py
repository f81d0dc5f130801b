"""Agent specs (issue #29): which agent function runs a row, and the checks of those settings before launch.

`rollout.agent: package.module:function` (or `builtin:<name>`, rollout/agents.py) names the agent of rows that name
none; `rollout.agents` maps names to more (verl's `tool_agent` / `single_turn_agent` built in); a row names its agent
at `data.agent_key` (verl's `agent_name`). `resolve_agent` imports and checks one spec; `agent_problems` and
`row_agent_problems` are what config/checks.py and data/prepare.py report before any actor starts. Running agents is
rollout/agent.py's.
"""
from __future__ import annotations

import importlib
import inspect
import logging
from typing import TYPE_CHECKING, Awaitable, Callable

from rlhf_orch.errors import ConfigError
from rlhf_orch.rewards import AGENT_REWARD
from rlhf_orch.rollout import agents

if TYPE_CHECKING:   # annotations only: rollout/agent.py imports this module
    from rlhf_orch.rollout.agent import AgentClient

logger = logging.getLogger(__name__)

AgentFn = Callable[["AgentClient", dict], Awaitable[float | None]]


def agent_table(default: str | None, named: dict[str, str]) -> dict[str | None, str]:
    """Agent specs by name: None -> rollout.agent (rows that name none), then verl's names (rollout/agents.VERL_AGENTS)
    and rollout.agents over them."""
    return {**agents.VERL_AGENTS, **named, None: default}


def row_agent(row: dict, key: str) -> str | None:
    """The agent name a row gives at dotted `key` (verl's agent_name, or e.g. extra_info.agent), or None. (Not
    rlhf_orch.data.rows.lookup: the data package checks rows with this module, which would import it back.)"""
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return None if value is None else str(value)


def agent_problems(rollout, reward_function: str) -> list[str]:
    """The rollout section's agent settings (config/checks.py calls this before any actor starts)."""
    p, r = [], rollout
    if reward_function == AGENT_REWARD and r.agent is None:
        p.append(f"reward.function: {AGENT_REWARD} scores the rewards an agent function returns; set rollout.agent "
                 "or give another reward function")
    if r.openai_endpoint and r.agent is None:
        p.append("rollout.openai_endpoint: the endpoint serves agent code; set rollout.agent (an agent function that "
                 "uses client.base_url) or remove openai_endpoint")
    if r.agents and r.agent is None:
        p.append("rollout.agents: set rollout.agent too, the agent of rows that name none")
    if r.agent is not None:
        for name, spec in agent_table(r.agent, r.agents).items():
            try:
                resolve_agent(spec)
            except ConfigError as e:
                p.append(str(e) if name is None else str(e).replace("rollout.agent:", f"rollout.agents.{name}:", 1))
    return p


def row_agent_problems(rows: list[dict], rollout, key: str, source: str) -> list[str]:
    """Rows that name an agent (at data.agent_key) rollout.agents does not have; a warning when rows name agents
    and no rollout.agent is set (they then run as plain single-turn prompts)."""
    named = [(i, n) for i, n in ((i, row_agent(r, key)) for i, r in enumerate(rows)) if n is not None]
    if not named:
        return []
    if rollout.agent is None:
        logger.warning("%d rows of %s name an agent at %r (first: %r) but rollout.agent is not set: they run as "
                       "single-turn prompts", len(named), source, key, named[0][1])
        return []
    known = agent_table(rollout.agent, rollout.agents)
    bad = [(i, n) for i, n in named if n not in known]
    if not bad:
        return []
    return [f"data.agent_key: {len(bad)} rows of {source} name agents rollout.agents does not define (first: row "
            f"{bad[0][0]}, {bad[0][1]!r}; defined: {', '.join(sorted(k for k in known if k))}); add them to "
            "rollout.agents (name: package.module:function) or point data.agent_key elsewhere"]


def resolve_agent(spec: str) -> AgentFn:
    """The agent function `spec` names; a ConfigError naming rollout.agent and the fix otherwise (before any actor)."""
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name not in agents.BUILTINS:
            raise ConfigError(f"rollout.agent: no built-in agent {spec!r}; built-ins: "
                              f"{', '.join('builtin:' + n for n in agents.BUILTINS)}")
        return getattr(agents, name)
    mod, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), name) if name else None
    except Exception as e:
        raise ConfigError(f"rollout.agent: cannot import {mod!r} ({type(e).__name__}: {e}); give "
                          "package.module:function, importable where the run starts") from e
    if fn is None or not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"rollout.agent: {spec!r} is not an `async def agent(client, row)` function; give "
                          "package.module:function of one")
    try:
        inspect.signature(fn).bind(None, {})
    except TypeError as e:
        raise ConfigError(f"rollout.agent: {spec!r} cannot be called as agent(client, row) ({e}); give it those two "
                          "parameters") from None
    return fn
