"""Multi-turn rollouts as token lists (rlhf_orch/rollout/multiturn.py; issue #29): the calculator tool, trajectories
assembled from exactly the engine's ids (a scripted engine whose tokenizer would merge them on re-encoding, and the
real hf engine on CPU), the loss mask with holes into the train batch, turn metrics, limits, aborts, tool errors."""
import threading
import time

import pytest
import torch

from rlhf_orch.data.dataset import load_rows
from rlhf_orch.engines import engine_class
from rlhf_orch.engines.base import SamplingParams
from rlhf_orch.models import build_tokenizer
from rlhf_orch.rewards.builtin import tool_final_answer
from rlhf_orch.rollout.batching import staleness_metrics, turn_metrics
from rlhf_orch.rollout.multiturn import Calculator, MultiTurn, ToolError
from rlhf_orch.trainer.batch import build_train_batch
from rlhf_orch.types import Sample


# ---------------------------------------------------------------- the calculator

@pytest.mark.parametrize("text, want", [("calc(12+7)", "=19 "), ("x calc(2*(3+4)) y", "=14 "), ("calc(1-9)", "=-8 "),
                                        ("calc(1+1) then calc(5*5)", "=25 "), ("no call", None), ("calc ( 1)", None)])
def test_calculator_answers_the_last_call(text, want):
    assert Calculator()(text) == want


@pytest.mark.parametrize("text", ["calc(2**99)", "calc(1/2)", "calc(a+1)", "calc()", "calc(" + "9" * 70 + ")",
                                  "calc(" + "*".join(["99999999999"] * 5) + ")"])
def test_calculator_refuses_what_it_does_not_compute(text):
    with pytest.raises(ToolError):
        Calculator()(text)


# ---------------------------------------------------------------- a scripted engine, a merging tokenizer

CHARS = list("0123456789+-*=():, abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
EOS = 90
MERGED = {"12": 91}   # re-encoding text merges "1","2" into one token: what the model emitted would be lost


def enc(text: str) -> list[int]:
    out, i = [], 0
    while i < len(text):
        if text[i:i + 2] in MERGED:
            out.append(MERGED[text[i:i + 2]])
            i += 2
        else:
            out.append(CHARS.index(text[i]))
            i += 1
    return out


def dec(ids: list[int]) -> str:
    back = {v: k for k, v in MERGED.items()}
    return "".join(back.get(i) or ("" if i == EOS else CHARS[i]) for i in ids)


class Scripted:
    """generate() answers each context with the next scripted turn of its trajectory (by the prompt's first id),
    the model's ids char by char (never merged), a logprob per token and the weight version in force."""

    def __init__(self, scripts: dict[int, list[str]], version: int = 3, abort_at: tuple[int, int] | None = None):
        self.scripts, self.version, self.abort_at, self.calls = scripts, version, abort_at, []

    def generate(self, prompts, params):
        ps = params if isinstance(params, list) else [params] * len(prompts)
        self.calls.append([(list(p), q.max_new_tokens, q.n) for p, q in zip(prompts, ps)])
        out = []
        for i, (p, q) in enumerate(zip(prompts, ps)):
            for j in range(q.n):
                key = p[0]
                turn = sum(1 for t in p if t == EOS)   # turns so far end with EOS
                text = self.scripts[key][min(turn, len(self.scripts[key]) - 1)]
                ids = ([CHARS.index(c) for c in text] + [EOS])[:q.max_new_tokens]
                reason = "abort" if self.abort_at == (key, turn) else ("stop" if ids[-1] == EOS else "length")
                out.append(Sample(i, list(p), ids, [-0.1 * (k + 1) for k in range(len(ids))], reason, self.version,
                                  token_versions=[self.version] * len(ids)))
        return out


def runner(engine, **kw):
    limits = {"max_turns": 4, "max_total_tokens": 64, "max_observation_tokens": 8, **kw}
    return MultiTurn(engine.generate, Calculator(), enc, dec, **limits)


def split(s: Sample) -> list[tuple[int, list[int]]]:
    """The response cut into runs of one mask value: [(mask, ids), ...]."""
    out: list = []
    for t, m in zip(s.response_ids, s.loss_mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


def test_turns_are_the_engines_ids_and_observations_are_masked():
    eng = Scripted({0: ["calc(12+1)", "13"], 1: ["x"]})
    samples = runner(eng).generate([[0, 5], [1, 5]], SamplingParams(max_new_tokens=20, n=2))
    assert len(samples) == 4 and [s.prompt_ids for s in samples] == [[0, 5]] * 2 + [[1, 5]] * 2
    s = samples[0]
    turn1 = [CHARS.index(c) for c in "calc(12+1)"] + [EOS]
    turn2 = [CHARS.index(c) for c in "13"] + [EOS]
    assert split(s) == [(1, turn1), (0, enc("=13 ")), (1, turn2)]
    # exactly the engine's ids: re-encoding the text would merge "1","2" and drop the EOS between turns
    assert enc(s.text) != s.response_ids and s.text == "calc(12+1)=13 13"
    assert s.logprobs == [-0.1 * (k + 1) for k in range(len(turn1))] + [0.0] * 4 + [-0.1 * (k + 1) for k in range(3)]
    assert s.token_versions == [3] * len(s.response_ids) and s.weight_version == 3
    assert s.finish_reason == "stop" and s.turn_stats == {"turns": 2, "tool_calls": 1, "tool_errors": 0,
                                                          "observation_tokens": 4, "truncated": 0}
    # the second turn was generated from the whole context, n = 1, with the room left
    (ctx, max_new, n), = [c for c in eng.calls[1] if c[0][0] == 0][:1]
    assert ctx == [0, 5] + turn1 + enc("=13 ") and n == 1 and max_new == 20
    one = samples[2]   # no tool call: one turn, nothing masked
    assert one.loss_mask == [1, 1] and one.turn_stats["turns"] == 1 and one.turn_stats["tool_calls"] == 0


def test_each_trajectory_keeps_its_prompts_parameters():
    eng = Scripted({0: ["calc(1+1)", "2" * 15], 1: ["calc(1+1)", "3" * 15]})
    a, b = runner(eng).generate([[0], [1]], [SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=12)])
    assert [ids for m, ids in split(a) if m][1] == [CHARS.index("2")] * 15 + [EOS]
    assert [ids for m, ids in split(b) if m][1] == [CHARS.index("3")] * 12 and b.finish_reason == "length"


def test_limits_end_trajectories():
    eng = Scripted({0: ["calc(1+1)"]})   # calls the tool every turn
    s, = runner(eng, max_turns=3).generate([[0]], SamplingParams(max_new_tokens=20))
    assert s.turn_stats["turns"] == 3 and s.turn_stats["tool_calls"] == 2 and s.finish_reason == "stop"
    s, = runner(eng, max_total_tokens=15).generate([[0]], SamplingParams(max_new_tokens=20))
    assert len(s.response_ids) == 15 and s.finish_reason == "length" and s.turn_stats["truncated"] == 1
    assert len(s.loss_mask) == len(s.logprobs) == len(s.token_versions) == 15
    s, = runner(eng, max_observation_tokens=1).generate([[0]], SamplingParams(max_new_tokens=20))
    assert [len(ids) for m, ids in split(s) if m == 0] == [1, 1, 1]


def test_an_aborted_turn_ends_the_trajectory_as_aborted_and_a_tool_error_is_an_observation():
    eng = Scripted({0: ["calc(1+1)", "calc(2**5)", "9"], 1: ["calc(1+1)", "7"]}, abort_at=(1, 1))
    a, b = runner(eng, max_observation_tokens=32).generate([[0], [1]], SamplingParams(max_new_tokens=20))
    assert a.finish_reason == "stop" and a.turn_stats["tool_errors"] == 1 and a.turn_stats["turns"] == 3
    assert "calc(2**5)=calc: ValueError 9" in a.text   # Pow is not computed: the error is the observation
    assert b.finish_reason == "abort" and b.turn_stats["turns"] == 2   # the scheduler re-queues its group


def test_a_tool_that_hangs_or_breaks_answers_with_an_error_and_the_trajectory_goes_on():
    eng = Scripted({0: ["calc(1+1)", "calc(2+2)", "9"], 1: ["calc(1+1)", "calc(3+3)", "8"]})

    def tool(text):
        if text.startswith("calc(1+1)"):   # trajectory 0's and 1's first calls hang past the timeout
            threading.Event().wait(5)
        if text.startswith("calc(3+3)"):
            raise KeyError("boom")
        return Calculator()(text)

    t0 = time.perf_counter()
    a, b = MultiTurn(eng.generate, tool, enc, dec, max_turns=4, max_total_tokens=64, max_observation_tokens=32,
                     tool_timeout_s=1, name="calc").generate([[0], [1]], SamplingParams(max_new_tokens=20))
    assert time.perf_counter() - t0 < 4   # the hung calls were not waited for
    assert a.text.startswith("calc(1+1)=calc timed out after 1 s calc(2+2)=4 9"), a.text
    assert b.text.startswith("calc(1+1)=calc timed out after 1 s calc(3+3)=error KeyError 8"), b.text
    assert a.turn_stats["tool_errors"] == 1 and b.turn_stats["tool_errors"] == 2
    assert a.turn_stats["turns"] == b.turn_stats["turns"] == 3


def test_loss_mask_holes_reach_the_train_batch_and_metrics():
    eng = Scripted({0: ["calc(12+1)", "13"]})
    samples = runner(eng).generate([[0, 5]], SamplingParams(max_new_tokens=20, n=2))
    batch = build_train_batch(samples, torch.ones(2), pad_id=0)
    p = len(samples[0].prompt_ids)
    want = torch.zeros(batch.response_mask.shape[1])
    want[p:p + len(samples[0].loss_mask)] = torch.tensor(samples[0].loss_mask, dtype=torch.float32)
    assert torch.equal(batch.response_mask[0], want) and batch.response_mask.sum() == 2 * 14
    assert batch.engine_logprobs[0, p + 11:p + 15].abs().sum() == 0   # the observation "=13 "
    assert batch.response_mask[0, p + 11:p + 15].sum() == 0 and batch.response_mask[0, p + 15] == 1
    m = turn_metrics(samples)
    assert m == {"rollout/turns_mean": 2.0, "rollout/tool_calls_mean": 1.0, "rollout/tool_errors_mean": 0.0,
                 "rollout/observation_tokens_mean": 4.0, "rollout/truncated_mean": 0.0}
    assert turn_metrics([Sample(0, [1], [2], [0.0], "stop", 0)]) == {}   # single-turn batches: no new keys
    assert staleness_metrics(samples, 3, 0)["staleness/lag_0"] == 2 * 14   # trained tokens only


def test_the_hf_engine_trajectory_keeps_every_id_it_produced(tiny_model_dir):
    """The real engine on CPU: a tool that answers the first two turns whatever they say. Each model turn in the
    trajectory is exactly the ids that turn's generate call returned, observations are the tool's encoded text, and
    re-encoding the sample's text would not give its ids back (the EOS ending each turn is not in the text)."""
    torch.set_num_threads(1)
    engine = engine_class("hf")(name="e", model_path=tiny_model_dir, seed=0)
    tok = build_tokenizer()
    returned: list[list[list[int]]] = []

    def generate(prompts, params):
        out = engine.generate(prompts, params)
        returned.append([s.response_ids for s in out])
        return out

    answers = iter(["=19", "=7"] * 4)
    mt = MultiTurn(generate, lambda text: next(answers) if len(returned) < 3 else None,
                   lambda text: tok.encode(text, add_special_tokens=False),
                   lambda ids: tok.decode(ids, skip_special_tokens=True),
                   max_turns=3, max_total_tokens=40, max_observation_tokens=8)
    prompt = tok.encode("12+7=", add_special_tokens=False)
    samples = mt.generate([prompt], SamplingParams(max_new_tokens=6, n=2))
    assert len(returned) == 3 and all(s.turn_stats["turns"] == 3 for s in samples)
    for k, s in enumerate(samples):
        turns = [ids for m, ids in split(s) if m == 1]
        obs = [ids for m, ids in split(s) if m == 0]
        assert turns == [returned[0][k], returned[1][k], returned[2][k]]
        assert obs == [tok.encode(("=19", "=7")[k], add_special_tokens=False)] * 2   # the tool answers in call order
        assert len(s.logprobs) == len(s.response_ids) == len(s.loss_mask) == len(s.token_versions)
    with_eos = [s for s in samples if any(ids[-1] == tok.eos_token_id for m, ids in split(s)[:-1] if m == 1)]
    for s in with_eos:
        assert tok.encode(s.text, add_special_tokens=False) != s.response_ids


# ---------------------------------------------------------------- the CPU example's task and reward

def test_tool_sums_rows_and_the_final_answer_reward():
    rows = load_rows("builtin:tool_sums")
    assert len(rows) == 40 * 40 and rows == load_rows("builtin:tool_sums")   # seeded order
    r = next(x for x in rows if x["prompt"] == "12+34=")
    assert r["sum"] == "46" and r["answer"].startswith("calc(12+34)<eos>=46 ")   # the warm start's two turns
    last = r["answer"].split(" ")[-1]
    assert last.isdigit() and 20 <= int(last) <= 98    # the last turn's form, another row's digits
    assert Calculator()(r["answer"].split("<eos>")[0]) == "=46 "
    tok = build_tokenizer()
    assert tok.eos_token_id in tok.encode(r["answer"], add_special_tokens=False)   # the turn ends as a model turn does
    assert tool_final_answer("calc(12+34)=46 46", r) == 1.0       # the tool called right, its answer copied
    assert tool_final_answer("calc(12+34)=46 47", r) == 0.75      # called right, one digit of two copied
    assert tool_final_answer("calc(12+33)=45 45", r) == 0.25      # a wrong call: only the in-place digit counts
    assert tool_final_answer("46", r) == 0.5                      # no tool: the answer alone is half
    assert tool_final_answer("calc(1)=1 5)", r) == 0.0
