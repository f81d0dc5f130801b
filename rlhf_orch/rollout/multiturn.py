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
that raises answers with an error observation; it never ends the run.

Built in: `Calculator`, a tool called as `calc(<expression>)` in a turn's text (integers, + - * and parentheses),
whose observation is `=<value> ` (the space keeps the next turn's text apart); "python", rollout/sandbox.py's
PythonSandbox (a turn's last ```python block run in a limited subprocess). Agent functions, chat templates and the
OpenAI-compatible endpoint are rollout/agent.py's.
"""
from __future__ import annotations

import ast
import dataclasses
import logging
import re
from typing import Callable, Protocol, Sequence

from rlhf_orch.engines.base import SamplingParams, per_prompt_params
from rlhf_orch.errors import ToolError
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


def append_observation(s: Sample, ids: list[int]) -> None:
    """Observation tokens join a trajectory: in the context, out of the loss (mask 0, logprob 0), with the version of
    the turn before them."""
    s.token_versions += [s.token_versions[-1] if s.token_versions else s.weight_version] * len(ids)
    s.response_ids += ids
    s.logprobs += [0.0] * len(ids)
    s.loss_mask += [0] * len(ids)


@dataclasses.dataclass
class _Trajectory:
    sample: Sample              # the first turn's sample, grown turn by turn (its ids, mask and versions)
    last_turn: list[int]        # the ids of the model's latest turn, which the tool reads
    stats: dict[str, int]
    done: bool = False


class MultiTurn:
    """Runs trajectories over an engine's `generate` (see the module docstring). `encode(text) -> ids` and
    `decode(ids) -> text` are the engine's tokenizer's (no special tokens added; special tokens skipped)."""

    def __init__(self, generate: Callable[[list[list[int]], object], list[Sample]], tool: Tool,
                 encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], max_turns: int,
                 max_total_tokens: int, max_observation_tokens: int):
        self._generate, self.tool, self.encode, self.decode = generate, tool, encode, decode
        self.max_turns, self.max_total_tokens, self.max_obs = max_turns, max_total_tokens, max_observation_tokens

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[Sample]:
        each = per_prompt_params(params, len(prompts))
        first = [dataclasses.replace(p, max_new_tokens=min(p.max_new_tokens, self.max_total_tokens)) for p in each]
        trajs = [self._start(s) for s in self._generate([list(p) for p in prompts], first)]
        for turn in range(1, self.max_turns):
            live = [t for t in trajs if not t.done and self._observe(t)]
            if not live:
                break
            # one more turn each, n = 1, from its own context, with its prompt's parameters (rows may bound their
            # own length); evaluation seeds differ per trajectory and turn
            ps = []
            for i, t in enumerate(live):
                own = each[t.sample.prompt_index]
                ps.append(dataclasses.replace(own, n=1, max_new_tokens=min(own.max_new_tokens, self._room(t)),
                                              seed=None if own.seed is None else own.seed + 7919 * turn + i))
            for t, s in zip(live, self._generate([t.sample.prompt_ids + t.sample.response_ids for t in live], ps)):
                self._extend(t, s)
        return [self._finish(t) for t in trajs]

    # ---- one trajectory ---------------------------------------------------------------------------
    def _start(self, s: Sample) -> _Trajectory:
        t = _Trajectory(sample=dataclasses.replace(s, response_ids=[], logprobs=[], token_versions=[], loss_mask=[]),
                        last_turn=[], stats={"turns": 0, "tool_calls": 0, "tool_errors": 0,
                                             "observation_tokens": 0, "truncated": 0})
        self._extend(t, s)
        return t

    def _room(self, t: _Trajectory) -> int:
        return self.max_total_tokens - len(t.sample.response_ids)

    def _extend(self, t: _Trajectory, s: Sample) -> None:
        """Append a model turn, exactly the engine's ids, logprobs and versions."""
        t.stats["turns"] += 1
        t.last_turn = list(s.response_ids)
        t.sample.response_ids += s.response_ids
        t.sample.logprobs += s.logprobs
        t.sample.token_versions += s.versions
        t.sample.loss_mask += [1] * len(s.response_ids)
        t.sample.finish_reason = s.finish_reason
        t.sample.weight_version = min(t.sample.weight_version, s.weight_version)
        t.sample.engine = s.engine
        t.done = s.finish_reason == "abort"
        if self._room(t) <= 0:
            t.done, t.sample.finish_reason, t.stats["truncated"] = True, "length", 1

    def _observe(self, t: _Trajectory) -> bool:
        """Run the tool on the last turn's text (there is room for another turn); append its observation. False:
        the trajectory ends here."""
        try:
            obs = self.tool(self.decode(t.last_turn))
        except ToolError as e:
            obs, t.stats["tool_errors"] = f"={e} ", t.stats["tool_errors"] + 1
        except Exception as e:   # a broken tool answers with its error; the run goes on
            logger.warning("tool %s raised %s: %s", type(self.tool).__name__, type(e).__name__, e)
            obs, t.stats["tool_errors"] = f"=error {type(e).__name__} ", t.stats["tool_errors"] + 1
        if obs is None:
            t.done = True
            return False
        t.stats["tool_calls"] += 1
        ids = self.encode(obs)[:self.max_obs]
        room = self._room(t)
        if len(ids) >= room:   # no room left for a turn after it: the observation is cut, the trajectory ends
            ids, t.done, t.sample.finish_reason, t.stats["truncated"] = ids[:room], True, "length", 1
        append_observation(t.sample, ids)
        t.stats["observation_tokens"] += len(ids)
        return not t.done

    def _finish(self, t: _Trajectory) -> Sample:
        s = t.sample
        s.turn_stats = dict(t.stats)
        s.text = self.decode(s.response_ids)
        return s
