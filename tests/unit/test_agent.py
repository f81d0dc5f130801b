"""Agent functions (rlhf_orch/rollout/agent.py; issue #29 item 2): the built-in calculator agent makes exactly
MultiTurn's trajectories (a scripted engine, and the real hf engine seeded); the barrier sends every live agent's
turn in one engine call in sample order whatever its tools take; chat() keeps the model's ids through a chat
template whose re-tokenization would differ (a scripted tokenizer, and the real one with a Jinja template on the hf
engine); tool calls parsed; limits, tool errors and timeouts, an agent's reward and its errors; resolve_agent."""
import json
import re
import threading
import time

import pytest
import torch

from rlhf_orch.config import load_config
from rlhf_orch.engines import engine_class
from rlhf_orch.engines.base import SamplingParams
from rlhf_orch.errors import ConfigError, RolloutError
from rlhf_orch.models import build_tokenizer
from rlhf_orch.rollout import agents
from rlhf_orch.rollout.agent import AgentRunner, parse_tool_calls, tool_schema_problem
from rlhf_orch.rollout.agent_specs import resolve_agent
from rlhf_orch.rollout.multiturn import TOOLS, Calculator, MultiTurn
from rlhf_orch.types import Sample
from test_multiturn import Scripted, dec, enc, split

LIMITS = {"max_turns": 4, "max_total_tokens": 64, "max_observation_tokens": 8}


class MTTok:
    """test_multiturn's merging tokenizer behind the transformers methods AgentRunner calls."""
    eos_token = ""
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return enc(text)

    def decode(self, ids, skip_special_tokens=True):
        return dec(ids)


def agent_runner(engine, agent, tok=None, tools=None, **kw):
    limits = {**LIMITS, **kw}
    return AgentRunner(engine.generate, agent, tok or MTTok(), tools or {"calculator": Calculator()},
                       limits["max_turns"], limits["max_total_tokens"], limits["max_observation_tokens"],
                       kw.get("tool_timeout_s", 5.0))


def same(a: Sample, b: Sample) -> bool:
    keys = ("prompt_index", "prompt_ids", "response_ids", "logprobs", "finish_reason", "weight_version", "text",
            "token_versions", "loss_mask", "turn_stats")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


# ---------------------------------------------------------------- the calculator agent is MultiTurn

def test_the_calculator_agent_makes_multiturns_trajectories_and_calls():
    scripts = {0: ["calc(12+1)", "13"], 1: ["x"], 2: ["calc(2**5)", "calc(1+1)", "9"], 3: ["calc(1+1)"]}
    prompts, params = [[0, 5], [1, 5], [2], [3]], SamplingParams(max_new_tokens=20, n=2)
    ref_eng, eng = Scripted(scripts), Scripted(scripts)
    want = MultiTurn(ref_eng.generate, Calculator(), enc, dec, **LIMITS).generate(prompts, params)
    got = agent_runner(eng, agents.calculator).generate(prompts, params, [{}] * 4)
    assert len(got) == 8 and all(same(a, b) for a, b in zip(got, want))
    assert [s.turn_stats["turns"] for s in got] == [2, 2, 1, 1, 3, 3, 4, 4]
    assert got[4].turn_stats["tool_errors"] == 1 and all(s.agent_reward is None for s in got)
    # the same turns went to the engine, in the same order; the first as n = 1 requests, one per sample
    flat = lambda calls: [(c[0], c[1]) for call in calls for c in call for _ in range(c[2])]
    assert flat(eng.calls) == flat(ref_eng.calls) and len(eng.calls) == len(ref_eng.calls)


def test_on_the_hf_engine_seeded_the_calculator_agent_equals_multiturn(tiny_model_dir):
    torch.set_num_threads(1)
    engine = engine_class("hf")(name="e", model_path=tiny_model_dir, seed=0)
    tok = build_tokenizer()
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("12+7=", "3*4=")]
    params = SamplingParams(max_new_tokens=6, n=2, seed=123)
    answer = lambda text: "=19 "   # every turn gets an answer: trajectories run to max_turns (or the token budget)
    limits = dict(max_turns=3, max_total_tokens=30, max_observation_tokens=8)
    want = MultiTurn(engine.generate, answer, lambda t: tok.encode(t, add_special_tokens=False),
                     lambda ids: tok.decode(ids, skip_special_tokens=True), **limits).generate(prompts, params)
    got = agent_runner(engine, agents.calculator, tok=tok, tools={"calculator": answer}, **limits).generate(
        prompts, params, [{}, {}])
    assert all(same(a, b) for a, b in zip(got, want)) and len(got) == 4
    assert all(s.turn_stats["turns"] >= 2 for s in got)


# ---------------------------------------------------------------- the barrier

def test_every_live_agents_turn_goes_in_one_call_in_sample_order_whatever_its_tools_take():
    eng = Scripted({k: ["calc(1+1)", "calc(2+2)", "9"] for k in range(3)})

    def slow(text):   # sample 0's tool is the slowest: it asks for its next turn last
        time.sleep({"calc(1+1)": 0.3, "calc(2+2)": 0.0}[text] if text.startswith("calc") else 0.0)
        return Calculator()(text)

    rows = [{}, {}, {}]
    got = agent_runner(eng, agents.calculator, tools={"calculator": slow}).generate([[0], [1], [2]],
                                                                                    SamplingParams(max_new_tokens=20),
                                                                                    rows)
    assert len(eng.calls) == 3 and [len(c) for c in eng.calls] == [3, 3, 3]
    assert [[c[0][0] for c in call] for call in eng.calls] == [[0, 1, 2]] * 3
    assert all(s.turn_stats == {"turns": 3, "tool_calls": 2, "tool_errors": 0, "observation_tokens": 6,
                                "truncated": 0} for s in got)


def test_concurrent_generate_calls_on_one_runner_keep_their_own_barriers():
    """A streaming engine's actor runs several generate calls at once through one runner: each call batches only
    its own agents' turns, and each gets exactly the trajectories it would get alone."""
    scripts = {k: ["calc(1+1)", "calc(2+2)", "9"] for k in range(6)}
    alone = agent_runner(Scripted(scripts), agents.calculator).generate([[0], [1], [2]], SamplingParams(max_new_tokens=20),
                                                                        [{}] * 3)
    eng = Scripted(scripts)
    plain = eng.generate

    def slow(prompts, params):   # calls of both threads interleave
        time.sleep(0.05)
        return plain(prompts, params)
    runner = agent_runner(type("E", (), {"generate": staticmethod(slow)}), agents.calculator)
    out = {}

    def call(name, prompts):
        out[name] = runner.generate(prompts, SamplingParams(max_new_tokens=20), [{}] * len(prompts))
    threads = [threading.Thread(target=call, args=("a", [[0], [1], [2]])),
               threading.Thread(target=call, args=("b", [[3], [4], [5]]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(same(a, b) for a, b in zip(out["a"], alone)) and len(out["a"]) == 3
    assert [s.prompt_ids for s in out["b"]] == [[3], [4], [5]] and all(s.turn_stats["turns"] == 3 for s in out["b"])
    assert all(len({c[0][0] < 3 for c in call}) == 1 for call in eng.calls)   # no engine call mixes the two


# ---------------------------------------------------------------- limits, tools, rewards, errors

def run_one(agent, scripts=None, **kw):
    eng = Scripted(scripts or {0: ["calc(1+1)", "2"]})
    return agent_runner(eng, agent, **kw).generate([[0]], SamplingParams(max_new_tokens=20), [{"answer": "2"}]), eng


def test_limits_end_the_trajectory_and_a_finished_client_calls_no_engine():
    async def greedy(client, row):
        turns = [await client.generate() for _ in range(6)]   # asks for more turns than max_turns allows
        assert [t.finish_reason for t in turns[3:]] == ["done"] * 3 and client.done
        client.observe("=1 ")   # nothing after the end
        return 1.0
    (s,), eng = run_one(greedy, max_turns=3)
    assert s.turn_stats["turns"] == 3 and len(eng.calls) == 3 and s.loss_mask == [1] * len(s.response_ids)
    assert s.agent_reward == 1.0
    (s,), _ = run_one(agents.calculator, {0: ["calc(1+1)"]}, max_total_tokens=15)
    assert len(s.response_ids) == 15 and s.finish_reason == "length" and s.turn_stats["truncated"] == 1


def test_a_tool_that_raises_or_hangs_answers_with_an_error_and_the_trajectory_goes_on():
    def broken(text):
        if "1+1" in text:
            raise KeyError("boom")
        if "2+2" in text:
            time.sleep(3)
    (s,), _ = run_one(agents.calculator, {0: ["calc(1+1)", "calc(2+2)", "9"]},
                      tools={"calculator": broken}, tool_timeout_s=1, max_observation_tokens=40,
                      max_total_tokens=200)
    assert s.turn_stats["tool_errors"] == 2 and s.turn_stats["turns"] == 3
    assert "calc(1+1)error: calculator raised KeyError " in s.text and "calculator timed out after 1 s" in s.text

    (s,), _ = run_one(agents.calculator, {0: ["calc(2**5)", "9"]}, max_observation_tokens=40)
    assert "calc(2**5)=calc: ValueError 9" == s.text   # the calculator's own error format, as MultiTurn's


def test_tools_that_hang_past_their_timeout_do_not_starve_the_engine_calls():
    """40 trajectories whose tool hangs for 60 s, timeout 1 s: each gets its error observation and its next turn
    at once (hung tools keep daemon threads of their own, not the workers the engine calls run on)."""
    eng = Scripted({k: ["calc(2+2)", "9"] for k in range(40)})
    t0 = time.monotonic()
    hang = lambda text: time.sleep(60) if "calc" in text else None
    got = agent_runner(eng, agents.calculator, tools={"calculator": hang}, tool_timeout_s=1,
                       max_observation_tokens=60, max_total_tokens=200).generate(
        [[k] for k in range(40)], SamplingParams(max_new_tokens=20), [{}] * 40)
    assert time.monotonic() - t0 < 30   # a starved runner would wait for the 60 s sleeps
    assert all(s.turn_stats["tool_errors"] == 1 and s.turn_stats["turns"] == 2 for s in got)


def test_an_agent_that_raises_or_returns_no_number_fails_the_call_with_its_name():
    async def bad(client, row):
        await client.generate()
        raise ValueError("my bug")

    async def wrong(client, row):
        await client.generate()
        return "1.0"

    async def lazy(client, row):
        return 1.0
    with pytest.raises(RolloutError, match=r"agent .*bad raised ValueError: my bug \(row \{'answer': '2'\}\)"):
        run_one(bad)
    with pytest.raises(RolloutError, match="returned '1.0'; return a float reward or None"):
        run_one(wrong)
    with pytest.raises(RolloutError, match="without a model turn"):
        run_one(lazy)


async def three_params(client, row, extra):
    return None


def test_resolve_agent_names_the_field_and_the_fix():
    assert resolve_agent("builtin:tool_chat") is agents.tool_chat
    assert resolve_agent("rlhf_orch.rollout.agents:calculator") is agents.calculator
    with pytest.raises(ConfigError, match="rollout.agent: no built-in agent 'builtin:nope'"):
        resolve_agent("builtin:nope")
    with pytest.raises(ConfigError, match="rollout.agent: cannot import 'no_such_mod'"):
        resolve_agent("no_such_mod:f")
    with pytest.raises(ConfigError, match="is not an `async def agent"):
        resolve_agent("rlhf_orch.rollout.agent:parse_tool_calls")
    with pytest.raises(ConfigError, match=r"'test_agent:three_params' cannot be called as agent\(client, row\)"):
        resolve_agent("test_agent:three_params")


def test_the_config_checks_the_agent_and_gives_it_default_limits(tmp_path):
    cfg = load_config("configs/tiny_cpu.yaml", ["rollout.agent=builtin:calculator", "model.tiny.max_position_embeddings=128"])
    assert cfg.rollout.multi_turn is not None and cfg.rollout.multi_turn.tool_timeout_s == 10.0
    with pytest.raises(ConfigError, match="rollout.agent: cannot import 'nowhere'"):
        load_config("configs/tiny_cpu_tool.yaml", ["rollout.agent=nowhere:agent"])
    with pytest.raises(ConfigError, match="reward.function: rlhf_orch.rewards.builtin:agent_reward scores the rewards "
                                          "an agent function returns; set rollout.agent"):
        load_config("configs/tiny_cpu_tool.yaml", ["reward.function=rlhf_orch.rewards.builtin:agent_reward"])


def test_tool_calls_are_parsed_in_the_hermes_format():
    calls = parse_tool_calls('a <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> '
                             "<tool_call>{oops}</tool_call>")
    assert calls[0].name == "calculator" and calls[0].arguments == {"expression": "1+2"} and calls[0].error is None
    assert calls[1].error.startswith("unparsable tool call (JSONDecodeError)")
    assert parse_tool_calls("no calls") == []


# ---------------------------------------------------------------- chat templates

PRINTABLE = [chr(c) for c in range(32, 127)] + ["\n"]
IM_END, MERGE = len(PRINTABLE), len(PRINTABLE) + 1   # a special end token; "12" merged on re-encoding


class ChatTok:
    """A ChatML-style tokenizer: printable characters, <|im_end|> as one special id, and "12" merged into one token
    on encoding (a model that writes "1","2" would lose its ids on re-tokenization)."""
    eos_token = "<|im_end|>"
    chat_template = "chatml (rendered in Python)"

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            if text.startswith(self.eos_token, i):
                out.append(IM_END)
                i += len(self.eos_token)
            elif text.startswith("12", i):
                out.append(MERGE)
                i += 2
            else:
                out.append(PRINTABLE.index(text[i]))
                i += 1
        return out

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if i == IM_END and skip_special_tokens else self.eos_token if i == IM_END else
                       "12" if i == MERGE else PRINTABLE[i] for i in ids)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=False):
        text = f"<|im_start|>system\ntools: {json.dumps([t['function']['name'] for t in tools])}<|im_end|>\n" \
            if tools else ""
        for m in messages:
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class ChatModel:
    """Answers the k-th assistant turn of a context with scripted text, char by char, then <|im_end|>."""

    def __init__(self, turns):
        self.turns, self.contexts = turns, []

    def generate(self, prompts, params):
        ps = params if isinstance(params, list) else [params] * len(prompts)
        out = []
        for i, (p, q) in enumerate(zip(prompts, ps)):
            self.contexts.append(list(p))
            k = (sum(1 for t in p if t == IM_END) - 2) // 2   # system and user, then a turn and its tool answer each
            ids = [PRINTABLE.index(c) for c in self.turns[k]] + [IM_END]
            out.append(Sample(i, list(p), ids, [-0.5] * len(ids), "stop", 7))
        return out


def test_tool_chat_keeps_the_models_ids_through_a_template_that_would_retokenize_them_otherwise():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+1"}}</tool_call>'
    model, tok = ChatModel([call, "it is 13"]), ChatTok()
    s, = agent_runner(model, agents.tool_chat, tok=tok, max_observation_tokens=200, max_total_tokens=400).generate(
        [[0]], SamplingParams(max_new_tokens=100), [{"prompt": "what is 12+1?"}])
    tools = [agents.TOOL_SCHEMAS["calculator"][0]]
    conv = [{"role": "user", "content": "what is 12+1?"}, {"role": "assistant", "content": call},
            {"role": "tool", "name": "calculator", "content": "=13 "}, {"role": "assistant", "content": "it is 13"}]
    assert s.prompt_ids == tok.encode(tok.apply_chat_template(conv[:1], tools, True))
    turn1, turn2 = [[PRINTABLE.index(c) for c in t] + [IM_END] for t in (call, "it is 13")]
    runs = split(s)
    assert [m for m, _ in runs] == [1, 0, 1] and runs[0][1] == turn1 and runs[2][1] == turn2
    assert tok.decode(runs[1][1], False) == "\n<|im_start|>tool\n=13 <|im_end|>\n<|im_start|>assistant\n"
    # the second turn's context is the whole conversation rendered, in the model's own ids: re-encoding the same
    # text would merge its "1","2"
    ctx = model.contexts[1]
    rendered = tok.apply_chat_template(conv[:3], tools, True)
    assert tok.decode(ctx, False) == rendered and ctx != tok.encode(rendered)
    assert ctx == s.prompt_ids + s.response_ids[:len(ctx) - len(s.prompt_ids)]
    assert s.turn_stats["tool_calls"] == 1 and s.turn_stats["turns"] == 2 and s.text == call + "it is 13"
    assert s.logprobs == [-0.5] * len(turn1) + [0.0] * len(runs[1][1]) + [-0.5] * len(turn2)


JINJA = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<eos>{% endfor %}"
         "{% if add_generation_prompt %}assistant: {% endif %}")


def recording_hf(model_dir):
    """The hf engine's generate, and the response ids of each call it answered."""
    torch.set_num_threads(1)
    engine = engine_class("hf")(name="e", model_path=model_dir, seed=0)
    returned = []

    def generate(prompts, params):
        out = engine.generate(prompts, params)
        returned.append([list(s.response_ids) for s in out])
        return out
    return generate, returned


def test_chat_on_the_hf_engine_with_a_jinja_template_trains_the_engines_ids(tiny_model_dir):
    generate, returned = recording_hf(tiny_model_dir)
    tok = build_tokenizer()
    tok.chat_template = JINJA

    async def two_rounds(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        turn = await client.chat(messages)
        messages += [{"role": "assistant", "content": turn.text}, {"role": "user", "content": "again"}]
        await client.chat(messages)
        return float(len(messages))

    runner = AgentRunner(generate, two_rounds, tok, {}, max_turns=4, max_total_tokens=50, max_observation_tokens=40,
                         tool_timeout_s=1.0)
    samples = runner.generate([[5]], SamplingParams(max_new_tokens=5, n=2, temperature=1.0), [{"prompt": "1+1"}])
    assert len(samples) == 2 and len(returned) == 2
    for k, s in enumerate(samples):
        assert s.prompt_ids == tok.encode("user: 1+1<eos>assistant: ", add_special_tokens=False)
        turns = [ids for m, ids in split(s) if m == 1]
        assert turns == [returned[0][k], returned[1][k]] and s.agent_reward == 3.0
        obs = tok.decode([ids for m, ids in split(s) if m == 0][0], skip_special_tokens=False)
        assert obs.endswith("user: again<eos>assistant: ")
        assert len(s.logprobs) == len(s.response_ids) == len(s.loss_mask) == len(s.token_versions)


@pytest.mark.parametrize("tool, why", [({"name": "x"}, 'each tool must be {"type": "function"'),
                                       ({"type": "function", "function": {"parameters": {}}}, "needs a name"),
                                       ({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}},
                                        "tool 'f': parameters must be a JSON schema of type object")])
def test_chat_refuses_a_tool_schema_that_is_not_an_openai_function(tool, why):
    async def chatty(client, row):
        await client.chat([{"role": "user", "content": "hi"}], tools=[tool])
    with pytest.raises(RolloutError, match=re.escape(why)):
        agent_runner(ChatModel(["x"]), chatty, tok=ChatTok()).generate([[0]], SamplingParams(), [{}])
    assert all(tool_schema_problem(t) is None for t, _ in agents.TOOL_SCHEMAS.values())


def test_chat_refuses_a_tokenizer_without_a_template():
    async def chatty(client, row):
        await client.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(RolloutError, match="needs a tokenizer with a chat template"):
        run_one(chatty)



def test_tool_chat_runs_the_python_sandbox_through_its_schema():
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
    model, tok = ChatModel([call, "42"]), ChatTok()
    tools = {name: make() for name, make in TOOLS.items()}
    s, = AgentRunner(model.generate, agents.tool_chat, tok, tools, max_turns=3, max_total_tokens=600,
                     max_observation_tokens=300, tool_timeout_s=20).generate(
        [[0]], SamplingParams(max_new_tokens=200), [{"prompt": "6*7?"}])
    obs = tok.decode([ids for m, ids in split(s) if m == 0][0], False)
    assert obs == "\n<|im_start|>tool\n<output>\n42\n</output>\n<|im_end|>\n<|im_start|>assistant\n"
    assert s.turn_stats["tool_calls"] == 1 and s.turn_stats["tool_errors"] == 0
    system = tok.decode(s.prompt_ids, False).split("\n")[1]
    assert system == 'tools: ["calculator", "python"]<|im_end|>'   # both schemas offered


def test_turns_generated_under_newer_weights_keep_each_tokens_version():
    """Partial rollouts across turns (max_staleness >= 1): a sync between two turns (or inside one, a keep pause)
    leaves each token with the version that made it; observations take the version of the turn before; the sample's
    weight_version is its oldest."""
    eng = Scripted({0: ["calc(1+1)", "2"]}, version=3)
    plain = eng.generate

    def newer_each_call(prompts, params):
        out = plain(prompts, params)
        eng.version += 1
        return out
    s, = agent_runner(type("E", (), {"generate": staticmethod(newer_each_call)}), agents.calculator).generate(
        [[0]], SamplingParams(max_new_tokens=20), [{}])
    runs = split(s)
    n1, n_obs, n2 = (len(ids) for _, ids in runs)
    assert [m for m, _ in runs] == [1, 0, 1]
    assert s.token_versions == [3] * n1 + [3] * n_obs + [4] * n2 and s.weight_version == 3
