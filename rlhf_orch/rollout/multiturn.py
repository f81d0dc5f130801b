"""Multi-turn rollouts as token lists (issue #29, its first part): a model turn, a tool's observation, the next turn.

`MultiTurn.generate(prompts, params)` takes what an engine's `generate` takes and returns what it returns, one
`Sample` per (prompt, completion), but each sample may be many turns: the engine generates a turn; a tool reads the
turn's text and answers with an observation, whose tokens are appended to the context; the engine generates the next
turn from the whole context, token ids in, token ids out. A sample's `response_ids` are every token after the prompt,
model turns and observations interleaved, exactly the ids the engine produced and saw (model tokens are never
decoded and encoded again; an observation is encoded once, from the tool's text); `loss_mask` is 1 on the model's
tokens and 0 on the observations' (in the context, never trained), `logprobs` are the engine's (0 on observations),
`token_versions` the weights each model token came from (an observation takes the version of the turn before it).
`turn_stats` counts turns, tool calls, tool errors, observation tokens and truncation for the step's metrics.

A trajectory ends when a turn calls no tool, after `max_turns` turns, or when its response reaches
`max_total_tokens` (then "length"). A turn the engine aborted (a weight sync's abort pause) ends the trajectory with
finish_reason "abort", so the scheduler re-queues its whole group, as for a single-turn sample. With partial rollouts
(max_staleness >= 1) a sync may come between two turns or, as a keep pause, inside one: each token keeps the version
that made it, and the group's staleness deadline is its admission's, so no token is staler than the bound. A tool
that raises or runs past `tool_timeout_s` answers with an error observation; it never ends the run.

How: MultiTurn is rollout/agent.AgentRunner running the built-in tool loop (rollout/agents.tool_loop) as every
sample's agent, so trajectories, limits and the batching of turns have one implementation; the first turn of every
sample goes to the engine in one call, then every live trajectory's next turn in one call, in sample order.

Built in: `Calculator`, a tool called as `calc(<expression>)` in a turn's text (integers, + - * and parentheses),
whose observation is `=<value> ` (the space keeps the next turn's text apart); "python", rollout/sandbox.py's
PythonSandbox (a turn's last ```python block run in a limited subprocess). Agent functions, chat templates and the
OpenAI-compatible endpoint are rollout/agent.py's.
"""
from __future__ import annotations

import ast
import logging
import re
from typing import Callable, Protocol, Sequence

from rlhf_orch.engines.base import SamplingParams
from rlhf_orch.errors import ToolError
from rlhf_orch.rollout import agents
from rlhf_orch.rollout.agent import AgentRunner
from rlhf_orch.rollout.sandbox import PythonSandbox
from rlhf_orch.types import Sample

logger = logging.getLogger(__name__)


class Tool(Protocol):
    def __call__(self, turn_text: str) -> str | None:
        """The observation to append after a model turn whose text is `turn_text`, or None: no call, the end."""


class Calculator:
    """`calc(<expr>)`: the value of the last such call in the turn, as `=<value> `. Integers, + - * and parentheses
    only (an AST walk, no eval), at most `max_chars` characters and `max_digits` digits in the result."""

    CALL = re.compile(r"calc\(([^()]*(?:\([^()]*\)[^()]*)*)\)")

    def __init__(self, max_chars: int = 64, max_digits: int = 32):
        self.max_chars, self.max_digits = max_chars, max_digits

    def __call__(self, turn_text: str) -> str | None:
        calls = self.CALL.findall(turn_text)
        if not calls:
            return None
        expr = calls[-1].strip()
        if not expr or len(expr) > self.max_chars:
            raise ToolError("calc: empty or too long")
        try:
            value = self._eval(ast.parse(expr, mode="eval").body)
        except (SyntaxError, ValueError, RecursionError) as e:
            raise ToolError(f"calc: {type(e).__name__}") from e
        if len(str(abs(value))) > self.max_digits:
            raise ToolError("calc: too large")
        return f"={value} "   # the space ends the observation: the next turn's text stays apart from it

    @staticmethod
    def error_text(message: str) -> str:
        """An error observation in the calculator's own format (MultiTurn's and agents' alike)."""
        return f"={message} "

    def _eval(self, node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = self._eval(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Mult) and len(str(abs(a))) + len(str(abs(b))) > 2 * self.max_digits:
                raise ValueError("too large")
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        raise ValueError(f"{type(node).__name__} not allowed")


TOOLS: dict[str, Callable[[], Tool]] = {"calculator": Calculator, "python": PythonSandbox}


class _Codec:
    """encode/decode callables behind the tokenizer methods AgentRunner calls (no chat template: MultiTurn's turns
    are plain text)."""
    eos_token = ""
    chat_template = None

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]):
        self._encode, self._decode = encode, decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._decode(ids)


class _Observing:
    """A tool as MultiTurn runs it: errors answer in the calculator's format (`=<message> `), and a tool that raises
    something else answers `=error <type> ` (logged), never ending the run."""

    error_text = staticmethod(Calculator.error_text)

    def __init__(self, tool: Tool):
        self.tool = tool

    def __call__(self, turn_text: str) -> str | None:
        try:
            return self.tool(turn_text)
        except ToolError:
            raise
        except Exception as e:
            logger.warning("tool %s raised %s: %s", type(self.tool).__name__, type(e).__name__, e)
            raise ToolError(f"error {type(e).__name__}") from e


class MultiTurn:
    """Runs trajectories over an engine's `generate` (see the module docstring): the built-in tool loop
    (rollout/agents.tool_loop) as an agent of rollout/agent.AgentRunner, which owns the trajectory bookkeeping and
    batches every live trajectory's next turn into one engine call. `encode(text) -> ids` and `decode(ids) -> text`
    are the engine's tokenizer's (no special tokens added; special tokens skipped); `tool_timeout_s` bounds each
    tool call (None: no bound); `name` is the tool's in its error observations."""

    def __init__(self, generate: Callable[[list[list[int]], object], list[Sample]], tool: Tool,
                 encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], max_turns: int,
                 max_total_tokens: int, max_observation_tokens: int, tool_timeout_s: float | None = None,
                 name: str = "tool"):
        self._runner = AgentRunner(generate, lambda client, row: agents.tool_loop(client, name),
                                   _Codec(encode, decode), {name: _Observing(tool)}, max_turns, max_total_tokens,
                                   max_observation_tokens, tool_timeout_s)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[Sample]:
        return self._runner.generate(prompts, params, [{}] * len(prompts))
