"""An OpenAI-compatible endpoint for agent code (issue #29 item 3): `rollout.openai_endpoint: true`.

Agent code written for the OpenAI client runs unchanged inside an agent function (rollout/agent.py):

    async def agent(client, row):
        oai = openai.AsyncOpenAI(base_url=client.base_url, api_key="none")
        r = await oai.chat.completions.create(model="policy", messages=[...], tools=[...])

`client.base_url` is the sample's own: `http://127.0.0.1:<port>/s/<sample key>/v1`, so every call lands in the
trajectory of the sample it belongs to, as token ids (chat() and generate() of its AgentClient: the model's ids are
never decoded and encoded again). A request to `/v1/...` with the header `X-Rlhf-Sample: <key>` does the same.

Served: POST `chat/completions` (messages, tools, max_tokens / max_completion_tokens: AgentClient.chat; the reply's
tool_calls are the turn's Hermes-style calls, finish_reason "tool_calls" when there are some), POST `completions`
(a string prompt: the first call's prompt starts the trajectory, a later one must extend the text so far, which
joins as an observation; AgentClient.complete), GET `models`. n > 1, streaming, logprobs and per-request sampling
settings are refused with a 400 that says so: a sample is one trajectory and the run's sampling settings hold.

One server per engine process (a daemon thread with its own event loop), on 127.0.0.1 and a free port by default:
the agent code runs in that process. Handlers hand each request to the loop of the agent that owns the sample.
No Ray.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
import uuid

from aiohttp import web

from rlhf_orch.errors import RLHFOrchError

logger = logging.getLogger(__name__)

SAMPLE_HEADER = "X-Rlhf-Sample"
_UNSUPPORTED = {"n": 1, "stream": False, "logprobs": None, "top_logprobs": None, "temperature": None, "top_p": None,
                "best_of": None, "echo": False}


class OpenAIEndpoint:
    """Start with `start()`; `register(client, loop)` gives a sample's key, `url(key)` its base URL."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, model_name: str = "policy"):
        self.host, self.port, self.model_name = host, port, model_name
        self._clients: dict[str, tuple[object, asyncio.AbstractEventLoop]] = {}
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> str:
        threading.Thread(target=self._serve, name="openai-endpoint", daemon=True).start()
        if not self._started.wait(timeout_s) or self._error is not None:
            raise RLHFOrchError(f"rollout.openai_endpoint: the server did not start on {self.host}: {self._error}")
        logger.info("OpenAI-compatible endpoint on %s (per sample: %s/s/<key>/v1)", self.base, self.base)
        return self.base

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        for prefix in ("/s/{key}/v1", "/v1"):
            app.router.add_post(prefix + "/chat/completions", self._chat)
            app.router.add_post(prefix + "/completions", self._complete)
            app.router.add_get(prefix + "/models", self._models)
        runner = web.AppRunner(app, access_log=None)
        try:
            self._loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.host, self.port)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]   # the free port the OS gave
        except BaseException as e:   # reported by start()
            self._error = e
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()

    # ---- samples ----------------------------------------------------------------------------------
    def register(self, client, loop: asyncio.AbstractEventLoop) -> str:
        key = f"{self._prefix}-{next(self._ids)}"
        self._clients[key] = (client, loop)
        return key

    def unregister(self, key: str) -> None:
        self._clients.pop(key, None)

    def url(self, key: str) -> str:
        return f"{self.base}/s/{key}/v1"

    # ---- handlers ---------------------------------------------------------------------------------
    def _owner(self, request: web.Request):
        key = request.match_info.get("key") or request.headers.get(SAMPLE_HEADER)
        if key is None:
            raise _bad(f"no sample: use the sample's base URL (client.base_url) or the {SAMPLE_HEADER} header", 400)
        if key not in self._clients:
            raise _bad(f"sample {key!r} is not running (its trajectory ended or belongs to another engine)", 404)
        return self._clients[key]

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise _bad("the body is not JSON", 400) from None
        for name, default in _UNSUPPORTED.items():
            if body.get(name, default) not in (default, None):
                raise _bad(f"{name}={body[name]!r} is not supported: a sample is one trajectory, sampled with the "
                           "run's settings (engines.N.sampling)", 400)
        return body

    async def _on_agent_loop(self, loop, coro):
        try:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))
        except RLHFOrchError as e:
            raise _bad(str(e), 400) from None

    async def _chat(self, request: web.Request) -> web.Response:
        client, loop = self._owner(request)
        body = await self._body(request)
        if not isinstance(body.get("messages"), list):
            raise _bad("messages: a list of {role, content} is required", 400)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        turn = await self._on_agent_loop(loop, client.chat(body["messages"], tools=body.get("tools"),
                                                           max_new_tokens=limit))
        calls = [{"id": f"call_{i}_{uuid.uuid4().hex[:8]}", "type": "function",
                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                 for i, c in enumerate(turn.tool_calls) if c.error is None]
        message = {"role": "assistant", "content": turn.text}
        if calls:
            message["tool_calls"] = calls
        reason = "tool_calls" if calls else _reason(turn.finish_reason)
        return web.json_response(self._reply("chat.completion", client, turn,
                                             {"index": 0, "message": message, "finish_reason": reason}))

    async def _complete(self, request: web.Request) -> web.Response:
        client, loop = self._owner(request)
        body = await self._body(request)
        if not isinstance(body.get("prompt"), str):
            raise _bad("prompt: one string is required", 400)
        turn = await self._on_agent_loop(loop, client.complete(body["prompt"], body.get("max_tokens")))
        return web.json_response(self._reply("text_completion", client, turn,
                                             {"index": 0, "text": turn.text, "finish_reason": _reason(turn.finish_reason)}))

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "owned_by": "rlhf_orch"}]})

    def _reply(self, kind: str, client, turn, choice: dict) -> dict:
        context = len(client.context) - len(turn.token_ids)
        return {"id": f"{kind}-{uuid.uuid4().hex[:12]}", "object": kind, "created": int(time.time()),
                "model": self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": context, "completion_tokens": len(turn.token_ids),
                          "total_tokens": context + len(turn.token_ids)}}


def _reason(finish_reason: str) -> str:
    return {"stop": "stop", "length": "length"}.get(finish_reason, "length")   # abort, done: the trajectory ended


def _bad(message: str, status: int) -> web.HTTPException:
    cls = web.HTTPNotFound if status == 404 else web.HTTPBadRequest
    return cls(text=json.dumps({"error": {"message": message, "type": "invalid_request_error"}}),
               content_type="application/json")
