"""The OpenAI-compatible endpoint (rlhf_orch/rollout/openai_server.py; issue #29 item 3): agent code using the real
`openai` client against each sample's base URL, over real HTTP on 127.0.0.1. Chat with tools lands in the sample's
trajectory as the model's ids (a template that would re-tokenize them otherwise); completions on the hf engine with
the real tokenizer; the header route; errors as OpenAI errors; the config check."""
import json

import httpx
import openai
import pytest

from rlhf_orch.config import load_config
from rlhf_orch.engines.base import SamplingParams
from rlhf_orch.errors import ConfigError, RolloutError
from rlhf_orch.models import build_tokenizer
from rlhf_orch.rollout.agent import AgentRunner
from rlhf_orch.rollout.agents import TOOL_SCHEMAS
from rlhf_orch.rollout.multiturn import Calculator
from rlhf_orch.rollout.openai_server import SAMPLE_HEADER, OpenAIEndpoint
from test_agent import IM_END, PRINTABLE, ChatModel, ChatTok, recording_hf
from test_multiturn import split


@pytest.fixture(scope="module")
def endpoint():
    server = OpenAIEndpoint()
    server.start()
    return server


def runner(generate, agent, tok, endpoint, **kw):
    return AgentRunner(generate, agent, tok, {"calculator": Calculator()}, kw.get("max_turns", 4),
                       kw.get("max_total_tokens", 600), kw.get("max_observation_tokens", 300), 5.0, endpoint)


def test_chat_completions_with_tools_through_the_openai_client(endpoint):
    assert endpoint.base.startswith("http://127.0.0.1:") and endpoint.port > 0
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+1"}}</tool_call>'
    model, tok = ChatModel([call, "it is 13"]), ChatTok()
    seen = {}

    async def agent(client, row):
        oai = openai.AsyncOpenAI(base_url=client.base_url, api_key="none", max_retries=0)
        tools = [TOOL_SCHEMAS["calculator"][0]]
        messages = [{"role": "user", "content": row["prompt"]}]
        r = await oai.chat.completions.create(model="policy", messages=messages, tools=tools)
        msg = r.choices[0].message
        seen["first"] = (r.choices[0].finish_reason, msg.tool_calls, r.usage)
        messages.append(msg.model_dump(exclude_none=True))   # as agent frameworks do: content and tool_calls
        for c in msg.tool_calls:
            result = await client.tool("calculator", f"calc({json.loads(c.function.arguments)['expression']})")
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
        r = await oai.chat.completions.create(model="policy", messages=messages, tools=tools)
        seen["second"] = (r.choices[0].finish_reason, r.choices[0].message.content)
        await oai.close()
        return 1.0

    s, = runner(model.generate, agent, tok, endpoint).generate([[0]], SamplingParams(max_new_tokens=100),
                                                               [{"prompt": "what is 12+1?"}])
    reason, calls, usage = seen["first"]
    assert reason == "tool_calls" and calls[0].function.name == "calculator"
    assert calls[0].function.arguments == '{"expression": "12+1"}'
    assert usage.prompt_tokens == len(s.prompt_ids) and usage.completion_tokens == len(call) + 1
    assert seen["second"] == ("stop", "it is 13")
    turn1, turn2 = [[PRINTABLE.index(c) for c in t] + [IM_END] for t in (call, "it is 13")]
    runs = split(s)
    assert [m for m, _ in runs] == [1, 0, 1] and runs[0][1] == turn1 and runs[2][1] == turn2
    assert tok.decode(runs[1][1], False) == "\n<|im_start|>tool\n=13 <|im_end|>\n<|im_start|>assistant\n"
    assert s.agent_reward == 1.0 and endpoint._clients == {}   # the sample's key is gone with its trajectory


def test_completions_on_the_hf_engine_keep_the_engines_ids(endpoint, tiny_model_dir):
    generate, returned = recording_hf(tiny_model_dir)
    tok = build_tokenizer()

    async def agent(client, row):
        oai = openai.AsyncOpenAI(base_url=client.base_url, api_key="none", max_retries=0)
        r = await oai.completions.create(model="policy", prompt=row["prompt"], max_tokens=4)
        text = row["prompt"] + r.choices[0].text + "=19 "
        r = await oai.completions.create(model="policy", prompt=text, max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="must extend the trajectory"):
            await oai.completions.create(model="policy", prompt="something else", max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
            await oai.completions.create(model="policy", prompt=text, n=2)
        await oai.close()
        return None

    samples = runner(generate, agent, tok, endpoint, max_total_tokens=40).generate(
        [[5]], SamplingParams(max_new_tokens=6, n=2), [{"prompt": "12+7="}])
    assert len(returned) == 2
    for k, s in enumerate(samples):
        assert s.prompt_ids == tok.encode("12+7=", add_special_tokens=False)
        turns = [ids for m, ids in split(s) if m == 1]
        obs = [ids for m, ids in split(s) if m == 0]
        assert turns == [returned[0][k], returned[1][k]] and all(len(t) <= 4 for t in turns)
        assert obs == [tok.encode("=19 ", add_special_tokens=False)]


def test_the_header_route_and_unknown_samples(endpoint):
    model, tok = ChatModel(["hi"]), ChatTok()
    got = {}

    async def agent(client, row):
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{endpoint.base}/v1/completions", headers={SAMPLE_HEADER: client.key},
                                json={"prompt": "hello", "max_tokens": 3})
            got["header"] = r.json()["choices"][0]
            r = await http.post(f"{endpoint.base}/v1/completions", json={"prompt": "x"})
            got["none"] = (r.status_code, r.json()["error"]["message"])
            r = await http.post(f"{endpoint.base}/s/nope/v1/chat/completions", json={"messages": []})
            got["unknown"] = r.status_code
            r = await http.get(f"{client.base_url}/models")
            got["models"] = r.json()["data"][0]["id"]
        return 0.0

    s, = runner(model.generate, agent, tok, endpoint).generate([[0]], SamplingParams(max_new_tokens=50), [{}])
    assert got["header"]["text"] == "hi" and s.prompt_ids == tok.encode("hello")
    assert got["none"][0] == 400 and SAMPLE_HEADER in got["none"][1]
    assert got["unknown"] == 404 and got["models"] == "policy"


def test_base_url_needs_the_endpoint_and_the_config_checks_it():
    async def agent(client, row):
        client.base_url
    with pytest.raises(RolloutError, match="client.base_url needs rollout.openai_endpoint: true"):
        runner(ChatModel(["x"]).generate, agent, ChatTok(), None).generate([[0]], SamplingParams(), [{}])
    with pytest.raises(ConfigError, match="rollout.openai_endpoint: the endpoint serves agent code; set rollout.agent"):
        load_config("configs/tiny_cpu_tool.yaml", ["rollout.openai_endpoint=true"])
    cfg = load_config("configs/tiny_cpu_tool.yaml", ["rollout.openai_endpoint=true", "rollout.agent=builtin:calculator"])
    assert cfg.rollout.openai_endpoint
