"""Agent functions (issue #29 item 2): a rollout is whatever `async def agent(client, row)` does with its client.

`rollout.agent: package.module:function` (or a built-in, `builtin:calculator` / `builtin:tool_chat`) names an
`async def agent(client: AgentClient, row: dict) -> float | None`, run once per sample (n per prompt). The client
continues one trajectory, token ids in and token ids out:

    turn = await client.generate()           # a model turn from the whole context: Turn(text, token_ids, ...)
    client.observe(text)                     # an observation joins the context: encoded once, never trained
    turn = await client.chat(messages, tools=...)   # the same through the tokenizer's chat template (below)
    obs = await client.tool("calculator", turn.text)  # a built-in tool, bounded by rollout.multi_turn.tool_timeout_s

and returns a reward (used instead of reward.function's: set `reward.function: builtin:agent_reward`) or None (the
reward function scores the sample's text). The trajectory's `response_ids` are every token after the prompt, model
turns exactly as the engine produced them and observations exactly as encoded: nothing is decoded and encoded again.
`loss_mask`, `logprobs`, `token_versions` and `turn_stats` are those of rollout/multiturn.py.

Batching without losing determinism: the agents of one generate call run concurrently on one event loop, and a
model turn is requested, not run: when every live agent waits for a turn (none is running a tool or its own code),
all of them go to the engine in one `generate` call, in sample order ("a barrier"), as MultiTurn's turns do; so
a seeded call gives the same trajectories whatever the timing of tools. Per-turn seeds follow MultiTurn's.

Chat: the first `chat(messages, tools)` renders the conversation with the generation prompt; that is the
trajectory's prompt (the dataset's prompt ids are replaced). Later calls pass the conversation so far plus new
messages (tool results, user turns); the client keeps the model's turns as assistant messages itself (an
assistant message the agent appends at that place is skipped) and renders only what follows the model's last
turn: the template's text after the assistant's content (less the end token the model generated) plus the new
messages and the next generation prompt, encoded once as an observation. Tool calls are parsed from a turn's text
in the Hermes format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) that Qwen's and most open chat
templates use.

Limits: `max_turns` model turns and `max_total_tokens` response tokens per trajectory (then `client.done`, and a
further `generate` returns an empty turn without calling the engine); observations are cut at
`max_observation_tokens`. A turn aborted by a weight sync ends the trajectory (finish_reason "abort": the
scheduler re-queues its group); with partial rollouts each token keeps its version (as in MultiTurn). An agent that
raises fails the call with its function, row and error named. The OpenAI-compatible endpoint is
rollout/openai_server.py's; naming agents (rollout.agent, rollout.agents, a row's agent name) and checking those
settings before launch is rollout/agent_specs.py's.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import threading
from typing import Callable, Sequence

from rlhf_orch.engines.base import SamplingParams, per_prompt_params
from rlhf_orch.errors import RolloutError, ToolError
from rlhf_orch.rollout.agent_specs import AgentFn, row_agent
from rlhf_orch.types import Sample

logger = logging.getLogger(__name__)

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None     # the call's text was not a JSON object with a name: what was wrong


@dataclasses.dataclass
class Turn:
    text: str
    token_ids: list[int]
    finish_reason: str           # "stop", "length", "abort"; "done" when the client had ended already
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)


def in_daemon_thread(fn, *args) -> asyncio.Future:
    """fn(*args) in a daemon thread of its own, as a future of the running loop. Not the loop's executor: a tool that
    hangs past its timeout keeps its thread (Python cannot kill one), and enough of them would leave no worker for
    the engine calls; a daemon thread also does not hold the process at exit."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(method, value) -> None:
        if not fut.done():   # cancelled by a timeout: nobody waits for the value
            method(value)

    def run() -> None:
        try:
            value, method = fn(*args), fut.set_result
        except BaseException as e:
            value, method = e, fut.set_exception
        try:
            loop.call_soon_threadsafe(settle, method, value)
        except RuntimeError:   # the call's loop is gone: it ended without this answer
            pass
    threading.Thread(target=run, name="agent-tool", daemon=True).start()
    return fut


def parse_tool_calls(text: str) -> list[ToolCall]:
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            obj = json.loads(body)
            calls.append(ToolCall(str(obj["name"]), dict(obj.get("arguments") or {})))
        except (ValueError, KeyError, TypeError) as e:
            calls.append(ToolCall("", {}, f"unparsable tool call ({type(e).__name__}): {body[:80]}"))
    return calls


def tool_schema_problem(tool) -> str | None:
    """What is wrong with one `tools` entry of chat() (OpenAI function format), or None."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        return 'each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}'
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        return "a tool's function needs a name"
    params = fn.get("parameters", {"type": "object"})
    if not isinstance(params, dict) or params.get("type") != "object" or \
            not isinstance(params.get("properties", {}), dict):
        return f"tool {fn['name']!r}: parameters must be a JSON schema of type object with a properties object"
    return None


def append_observation(s: Sample, ids: list[int]) -> None:
    """Observation tokens join a trajectory: in the context, out of the loss (mask 0, logprob 0), with the version of
    the turn before them."""
    s.token_versions += [s.token_versions[-1] if s.token_versions else s.weight_version] * len(ids)
    s.response_ids += ids
    s.logprobs += [0.0] * len(ids)
    s.loss_mask += [0] * len(ids)


class AgentClient:
    """One trajectory's handle (module docstring). `done` once a limit is reached or a turn was aborted."""

    def __init__(self, runner: "AgentRunner", barrier: "_Barrier", pos: int, index: int, prompt_ids: list[int],
                 params: SamplingParams, prompt_seed: int | None):
        self._runner, self._barrier = runner, barrier
        self.pos, self.index, self.params, self.prompt_seed = pos, index, params, prompt_seed
        self.prompt_ids = list(prompt_ids)
        self.sample: Sample | None = None    # from the first model turn on
        self.done, self.reason = False, ""
        self.stats = {"turns": 0, "tool_calls": 0, "tool_errors": 0, "observation_tokens": 0, "truncated": 0}
        self._history: list[dict] | None = None   # chat: the messages rendered so far (model turns included)
        self.key: str | None = None               # its key on the OpenAI endpoint, while it runs

    # ---- the trajectory ---------------------------------------------------------------------------
    @property
    def prompt_text(self) -> str:
        return self._runner.decode(self.prompt_ids)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + (self.sample.response_ids if self.sample else [])

    def room(self) -> int:
        return self._runner.max_total_tokens - (len(self.sample.response_ids) if self.sample else 0)

    async def generate(self, max_new_tokens: int | None = None) -> Turn:
        if self.done:
            return Turn("", [], "done")
        s = await self._barrier.request(self, max_new_tokens)
        self.stats["turns"] += 1
        if self.sample is None:
            self.sample = dataclasses.replace(s, response_ids=[], logprobs=[], token_versions=[], loss_mask=[])
        t = self.sample
        t.response_ids += s.response_ids
        t.logprobs += s.logprobs
        t.token_versions += s.versions
        t.loss_mask += [1] * len(s.response_ids)
        t.finish_reason, t.engine = s.finish_reason, s.engine
        t.weight_version = min(t.weight_version, s.weight_version)
        if s.finish_reason == "abort":
            self.done, self.reason = True, "abort"
        elif self.stats["turns"] >= self._runner.max_turns:
            self.done, self.reason = True, "turns"
        if self.room() <= 0:
            self._truncate()
        text = self._runner.decode(s.response_ids)
        return Turn(text, list(s.response_ids), s.finish_reason, parse_tool_calls(text))

    def observe(self, text: str) -> list[int]:
        """Append `text` as an observation (cut at max_observation_tokens and at the trajectory's room); its ids."""
        if self.sample is None:
            raise RolloutError("agent: observe() before the first model turn; put what the model sees first in the "
                               "prompt (or in chat()'s messages)")
        if self.done:
            return []
        ids = self._runner.encode(text)[:self._runner.max_obs]
        if len(ids) >= self.room():   # no room for a turn after it: cut, and the trajectory ends
            ids = ids[:self.room()]
            self._truncate()
        append_observation(self.sample, ids)
        self.stats["observation_tokens"] += len(ids)
        return ids

    def _truncate(self) -> None:
        self.done, self.reason, self.stats["truncated"] = True, "length", 1
        self.sample.finish_reason = "length"

    # ---- tools ------------------------------------------------------------------------------------
    @property
    def tool_names(self) -> list[str]:
        return sorted(self._runner.tools)

    async def tool(self, name: str, turn_text: str) -> str | None:
        """The built-in tool `name` (rollout/multiturn.TOOLS) on `turn_text`, in a thread, at most tool_timeout_s:
        its observation, None (no call in the text), or an error text (the tool raised, or ran out of time)."""
        tool = self._runner.tools.get(name)
        if tool is None:
            raise RolloutError(f"agent: no tool {name!r}; tools: {', '.join(sorted(self._runner.tools))}")
        err = getattr(tool, "error_text", lambda message: f"error: {message} ")   # in the tool's own format
        try:
            obs = await asyncio.wait_for(in_daemon_thread(tool, turn_text), self._runner.tool_timeout_s)
        except asyncio.TimeoutError:
            obs = err(f"{name} timed out after {self._runner.tool_timeout_s:g} s")
        except ToolError as e:
            obs = err(str(e))
        except Exception as e:   # a broken tool answers with its error; the run goes on
            logger.warning("tool %s raised %s: %s", name, type(e).__name__, e)
            obs = err(f"{name} raised {type(e).__name__}")
        else:
            if obs is None:
                return None
            self.stats["tool_calls"] += 1
            return obs
        self.stats["tool_calls"] += 1
        self.stats["tool_errors"] += 1
        return obs

    # ---- chat -------------------------------------------------------------------------------------
    async def chat(self, messages: list[dict], tools: list[dict] | None = None,
                   max_new_tokens: int | None = None) -> Turn:
        render = self._runner.render
        for tool in tools or []:
            problem = tool_schema_problem(tool)
            if problem:
                raise RolloutError(f"agent: chat(tools=...): {problem}")
        if self._history is None:
            if self.sample is not None:
                raise RolloutError("agent: chat() after generate(): start the trajectory with chat()")
            self._history, self._tools = list(messages), tools
            self.prompt_ids = self._runner.encode(render(messages, tools, True))
        else:
            if self.done:
                return Turn("", [], "done")
            prev = self._history   # ends with the model's last turn, as an assistant message
            n = len(prev)
            said = lambda ms: [(m.get("role"), m.get("content")) for m in ms if m.get("role") != "assistant"]
            if said(messages[:n - 1]) != said(prev[:n - 1]):   # assistant turns are the model's: the client's own
                raise RolloutError("agent: chat() messages must continue the conversation so far (the same first "
                                   f"{n - 1} messages)")
            new = list(messages[n:] if len(messages) >= n and messages[n - 1].get("role") == "assistant"
                       else messages[n - 1:])
            self.observe(self._glue(prev, new))
            self._history = prev + new
        turn = await self.generate(max_new_tokens)
        self._history.append({"role": "assistant", "content": turn.text})
        return turn

    async def complete(self, prompt: str, max_new_tokens: int | None = None) -> Turn:
        """A text completion (the endpoint's /v1/completions): the first call's `prompt` starts the trajectory; a
        later one must extend the trajectory's text so far (special tokens left out), and what it adds joins as an
        observation; then a model turn."""
        if self.sample is None:
            self.prompt_ids = self._runner.encode(prompt)
        elif not self.done:
            so_far = self._runner.decode(self.context)
            if not prompt.startswith(so_far):
                raise RolloutError("agent: a completion's prompt must extend the trajectory's text so far (its last "
                                   "prompt plus the text returned), which keeps the model's tokens")
            if prompt[len(so_far):]:
                self.observe(prompt[len(so_far):])
        return await self.generate(max_new_tokens)

    @property
    def base_url(self) -> str:
        """This sample's OpenAI-compatible base URL (rollout.openai_endpoint: true; rollout/openai_server.py)."""
        if self._runner.endpoint is None or self.key is None:
            raise RolloutError("agent: client.base_url needs rollout.openai_endpoint: true")
        return self._runner.endpoint.url(self.key)

    def _glue(self, prev: list[dict], new: list[dict]) -> str:
        """The text between the model's last turn (prev[-1]) and the next generation: the template's end of the
        assistant message, less the end token the model generated, then `new` and the generation prompt."""
        render, tools, eos = self._runner.render, self._tools, self._runner.eos_text
        head = render(prev[:-1], tools, True)
        done = render(prev, tools, False)
        whole = render(prev + new, tools, True)
        content = prev[-1]["content"]
        if not (done.startswith(head + content) and whole.startswith(done)):
            raise RolloutError("agent: the chat template does not render a conversation as its prefix plus the "
                               "assistant's text; chat() cannot keep the model's tokens with it (use generate() "
                               "and observe())")
        tail = done[len(head) + len(content):]
        if eos and tail.startswith(eos) and self.sample.finish_reason == "stop":
            tail = tail[len(eos):]   # the model wrote its end token itself (it is in its ids)
        return tail + whole[len(done):]


class AgentRunner:
    """`generate(prompts, params, rows)` as an engine's generate, each sample one run of `agent` (module docstring).
    `generate_fn` is the engine's; `tokenizer` a transformers tokenizer (encode, decode, chat template)."""

    def __init__(self, generate_fn: Callable[[list[list[int]], object], list[Sample]], agent: AgentFn, tokenizer,
                 tools: dict[str, Callable[[str], str | None]], max_turns: int, max_total_tokens: int,
                 max_observation_tokens: int, tool_timeout_s: float | None, endpoint=None,
                 by_name: dict[str, AgentFn] | None = None, agent_key: str = "agent_name"):
        """`agent` runs every row unless `by_name` has the name the row gives at `agent_key` (agent_table)."""
        self._generate, self.agent, self.tok, self.tools = generate_fn, agent, tokenizer, tools
        self.by_name, self.agent_key = by_name or {}, agent_key
        self.endpoint = endpoint   # rollout/openai_server.OpenAIEndpoint, started, or None
        self.max_turns, self.max_total_tokens, self.max_obs = max_turns, max_total_tokens, max_observation_tokens
        self.tool_timeout_s = tool_timeout_s
        self.eos_text = tokenizer.eos_token or ""

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise RolloutError("agent: chat() needs a tokenizer with a chat template (tokenizer_config.json's "
                               "chat_template); this model has none: use generate() and observe()")
        return self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                            tokenize=False)

    def generate(self, prompts: Sequence[Sequence[int]], params, rows: Sequence[dict]) -> list[Sample]:
        if len(rows) != len(prompts):
            raise RolloutError(f"agent: {len(prompts)} prompts but {len(rows)} rows")
        return asyncio.run(self._run(prompts, per_prompt_params(params, len(prompts)), rows))

    async def _run(self, prompts, each: list[SamplingParams], rows) -> list[Sample]:
        # this call's own barrier: a streaming engine's actor runs several calls at once, each on its own loop
        barrier, clients = _Barrier(self._generate), []
        for i, (p, own) in enumerate(zip(prompts, each)):
            for j in range(own.n):   # sample j of a seeded prompt draws from seed + j, as one call with n would
                one = dataclasses.replace(own, n=1, seed=None if own.seed is None else own.seed + j)
                clients.append(AgentClient(self, barrier, len(clients), i, list(p), one, own.seed))
        barrier.live = len(clients)
        if self.endpoint is not None:
            for c in clients:
                c.key = self.endpoint.register(c, asyncio.get_running_loop())
        try:
            results = await asyncio.gather(*(self._one(c, rows[c.index]) for c in clients))
        finally:
            for c in clients:
                if c.key is not None:
                    self.endpoint.unregister(c.key)
        return [self._finish(c, r) for c, r in zip(clients, results)]

    def agent_for(self, row: dict) -> AgentFn:
        name = row_agent(row, self.agent_key) if self.by_name else None
        if name is None:
            return self.agent
        if name not in self.by_name:   # the data check refuses such rows before launch (data/prepare.py)
            raise RolloutError(f"agent: row names agent {name!r} (at {self.agent_key}); rollout.agents has "
                               f"{', '.join(sorted(self.by_name))}")
        return self.by_name[name]

    async def _one(self, client: AgentClient, row: dict):
        agent = self.agent_for(row)
        try:
            return await agent(client, row)
        except RolloutError:
            raise
        except Exception as e:
            name = getattr(agent, "__qualname__", repr(agent))
            raise RolloutError(f"agent {name} raised {type(e).__name__}: {e} (row {str(row)[:200]})") from e
        finally:
            client._barrier.done()

    def _finish(self, c: AgentClient, reward) -> Sample:
        if c.sample is None:
            raise RolloutError("agent: the agent returned without a model turn (call client.generate() or chat())")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise RolloutError(f"agent: returned {reward!r}; return a float reward or None")
        s = c.sample
        s.prompt_ids, s.prompt_index = c.prompt_ids, c.index
        s.turn_stats = dict(c.stats)
        s.text = self.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m]) if c._history is not None \
            else self.decode(s.response_ids)
        s.agent_reward = None if reward is None else float(reward)
        return s



class _Barrier:
    """One generate call's agents: when every live one waits for a turn, all of them go to the engine in one call,
    in sample order (module docstring)."""

    def __init__(self, generate_fn: Callable[[list[list[int]], object], list[Sample]]):
        self._generate = generate_fn
        self.live = 0                  # agents still running
        self._pending: list[tuple[AgentClient, int | None, asyncio.Future]] = []
        self._flushing, self._round = False, 0

    async def request(self, client: AgentClient, max_new_tokens: int | None) -> Sample:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((client, max_new_tokens, fut))
        self._maybe_flush()
        return await fut

    def done(self) -> None:
        """An agent returned (or raised): the others no longer wait for it."""
        self.live -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if not self._flushing and self._pending and len(self._pending) >= self.live:
            self._flushing = True
            asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        batch = sorted(self._pending, key=lambda x: x[0].pos)   # sample order, whatever order they asked in
        self._pending = []
        turn = self._round
        self._round += 1
        ps = []
        for i, (c, limit, _) in enumerate(batch):
            p = c.params
            # turn 0: the sample's own seed (the prompt's + j); then MultiTurn's per-turn seeds
            seed = p.seed if c.prompt_seed is None or turn == 0 else c.prompt_seed + 7919 * turn + i
            ps.append(dataclasses.replace(p, max_new_tokens=min(p.max_new_tokens, c.room(), limit or p.max_new_tokens),
                                          seed=seed))
        try:
            samples = await asyncio.to_thread(self._generate, [c.context for c, _, _ in batch], ps)
        except BaseException as e:
            for _, _, fut in batch:
                fut.set_exception(e)
            raise
        finally:
            self._flushing = False
        for (_, _, fut), s in zip(batch, samples):
            fut.set_result(s)
