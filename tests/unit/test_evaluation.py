"""Evaluation's pure parts (rlhf_orch/evaluation.py: pass@k, aggregation, prompt selection, seeds, the eval
prompts of a config) and the hf engine's side of it: greedy decoding and seeded requests that leave the engine's
own sampling RNG, the training stream, exactly where it was."""
import itertools
import math
import random
from pathlib import Path

import pytest
import torch

from rlhf_orch.config import load_config
from rlhf_orch.engines import engine_class
from rlhf_orch.engines.base import SamplingParams
from rlhf_orch.errors import ConfigError, DataError, EngineError
from rlhf_orch.evaluation import (aggregate, eval_seed, eval_set_for, last_eval, pass_at_k, select_prompts, shard)
from rlhf_orch.models import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny_cpu.yaml")
GSM8K = str(ROOT / "configs/gsm8k_cpu.yaml")


# ---- pass@k and aggregation -----------------------------------------------------------------------
def test_pass_at_k_equals_the_combinatorial_definition():
    for n in range(1, 9):
        for c, k in itertools.product(range(n + 1), range(1, n + 1)):
            # P(a random k-subset of the n samples holds a passing one), counted over every subset
            subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
            want = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
            assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    assert pass_at_k(200, 3, 1) == pytest.approx(3 / 200)
    assert 0.0 < pass_at_k(1000, 1, 100) < 1.0   # large n: the product form, no overflow


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_aggregate_by_hand():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    lengths = [[2, 3, 4, 5], [1, 1, 1, 1], [6, 6, 6, 6]]
    m = aggregate(rewards, lengths, k=4, threshold=1.0)
    assert m["eval/reward_mean"] == pytest.approx(6 / 12)
    assert m["eval/pass@1"] == pytest.approx((2 / 4 + 0 + 1) / 3)
    assert m["eval/pass@k"] == pytest.approx((1 + 0 + 1) / 3)
    assert m["eval/k"] == 4 and m["eval/prompts"] == 3
    assert m["eval/response_len_mean"] == pytest.approx(42 / 12)
    m2 = aggregate(rewards, lengths, k=2, threshold=1.0)
    assert m2["eval/pass@k"] == pytest.approx((1 - math.comb(2, 2) / math.comb(4, 2) + 0 + 1) / 3)
    # the threshold decides what passes; rewards are averaged as they are
    soft = aggregate([[0.4, 0.7], [0.9, 0.2]], [[1, 1], [1, 1]], k=2, threshold=0.5)
    assert soft["eval/pass@1"] == pytest.approx(0.5) and soft["eval/pass@k"] == pytest.approx(1.0)
    assert soft["eval/reward_mean"] == pytest.approx(0.55)
    greedy = aggregate([[1.0], [0.0], [1.0]], [[3], [2], [1]], k=1, threshold=1.0)
    assert greedy["eval/pass@1"] == greedy["eval/pass@k"] == pytest.approx(2 / 3)


def test_aggregate_rejects_ragged_or_empty_input():
    with pytest.raises(ValueError):
        aggregate([[1.0, 0.0], [1.0]], [[1, 1], [1]], k=1, threshold=1.0)
    with pytest.raises(ValueError):
        aggregate([[1.0, 0.0]], [[1]], k=1, threshold=1.0)
    with pytest.raises(ValueError):
        aggregate([], [], k=1, threshold=1.0)


def test_last_eval_takes_the_latest_record_with_an_evaluation():
    records = [{"step": 1, "rollout/reward_mean": 0.1}, {"step": 2, "eval/reward_mean": 0.5, "eval/pass@1": 0.5,
                                                          "train/loss": 1.0}, {"step": 3, "rollout/reward_mean": 0.2}]
    assert last_eval(records) == {"step": 2, "eval/reward_mean": 0.5, "eval/pass@1": 0.5}
    assert last_eval(records[:1]) is None


# ---- selection, seeds, shards, when ----------------------------------------------------------------
def test_select_prompts_is_a_fixed_seeded_subset():
    assert select_prompts(10, 0, 0) == list(range(10)) == select_prompts(10, 10, 0) == select_prompts(10, 99, 0)
    a = select_prompts(100, 8, 0)
    assert len(a) == 8 == len(set(a)) and a == sorted(a) and a == select_prompts(100, 8, 0)
    assert a != select_prompts(100, 8, 1)


def test_eval_seed_depends_on_seed_step_and_prompt():
    seeds = {eval_seed(s, step, i, 4) for s in (0, 1) for step in (1, 2) for i in range(50)}
    assert len(seeds) == 2 * 2 * 50 and all(0 <= x < 2**31 - 1 - 4 for x in seeds)
    assert eval_seed(0, 3, 7, 4) == eval_seed(0, 3, 7, 4)


def test_shard_covers_everything_in_order():
    for count, parts in [(10, 3), (2, 5), (7, 1), (8, 4), (1, 2)]:
        out = shard(count, parts)
        assert len(out) == min(count, parts) and all(b > a for a, b in out)
        assert [i for a, b in out for i in range(a, b)] == list(range(count))
        assert max(b - a for a, b in out) - min(b - a for a, b in out) <= 1


def _eval_cfg(*overrides, config=TINY):
    return load_config(config, [*overrides])


def test_when_to_evaluate():
    tok = build_tokenizer()
    assert eval_set_for(_eval_cfg(), tok) is None                                  # off by default
    assert eval_set_for(_eval_cfg("eval.every=0", "eval.final=false"), tok) is None
    es = eval_set_for(_eval_cfg("eval.every=2"), tok)
    assert [s for s in range(1, 8) if es.due(s, 7)] == [2, 4, 6, 7]               # final defaults to true
    es = eval_set_for(_eval_cfg("eval.every=2", "eval.final=false"), tok)
    assert [s for s in range(1, 8) if es.due(s, 7)] == [2, 4, 6]
    es = eval_set_for(_eval_cfg("eval.final=true"), tok)
    assert [s for s in range(1, 8) if es.due(s, 7)] == [7]                          # only after the last step


def test_request_params_greedy_and_seeded():
    tok = build_tokenizer()
    cfg = _eval_cfg("eval.every=1")
    sampling = cfg.engines[0].sampling
    es = eval_set_for(cfg, tok)
    assert len(es.prompts) == 25   # builtin:arithmetic with max_operand 4 has no split: all of its rows
    greedy = es.request_params(sampling, 3, range(4))
    assert {(p.temperature, p.top_p, p.seed, p.n, p.max_new_tokens) for p in greedy} == {(0.0, 1.0, None, 1, 4)}
    cfg = _eval_cfg("eval.every=1", "eval.n=4", "eval.temperature=0.7", "eval.max_prompts=6")
    es = eval_set_for(cfg, tok)
    assert len(es.prompts) == 6
    params = es.request_params(sampling, 3, range(6))
    assert {(p.temperature, p.n) for p in params} == {(0.7, 4)} and len({p.seed for p in params}) == 6
    # a prompt's seed is its own, whichever engine's shard it is in
    assert [p.seed for p in es.request_params(sampling, 3, range(2, 6))] == [p.seed for p in params[2:]]
    assert [p.seed for p in es.request_params(sampling, 4, range(6))] != [p.seed for p in params]


# ---- the eval prompts of a config ------------------------------------------------------------------
def test_eval_prompts_from_the_validation_split_of_a_folder():
    pytest.importorskip("datasets")
    es = eval_set_for(_eval_cfg("eval.every=5", "eval.max_prompts=5", config=GSM8K), build_tokenizer())
    assert "split test" in es.source and len(es.prompts) == 5
    for p in es.prompts:   # rendered with the data section's chat template and answer key, like training rows
        assert p.row["extra_info"]["split"] == "test" and p.row["answer"] == p.row["reward_model"]["ground_truth"]
        assert p.row["prompt"] == f"user: {p.row['extra_info']['question']} assistant:"
        assert p.token_ids == build_tokenizer()(p.row["prompt"], add_special_tokens=False).input_ids


def _gsm8k_rows(split: str, answers: list[int]) -> list[dict]:
    """verl's GSM8K layout (examples/make_gsm8k_parquet.py), one row per answer, marked with its split."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"ann has {a} pens. how many?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a)},
             "extra_info": {"split": split, "index": i}} for i, a in enumerate(answers)]


def test_eval_source_file_or_folder_with_split_is_exactly_what_is_scored(tmp_path):
    """eval.source given as a parquet folder with eval.split, and as one JSONL file: the evaluation prompts are that
    split's rows, all of them in file order, rendered with the data section's keys and chat template; the engines get
    their token ids and the reward workers their rows (driver/evaluation.py: `(text, es.prompts[i].row)`)."""
    import json

    from rlhf_orch.rewards.scorer import RewardScorer
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("math_verify")
    splits = {"train": [1, 2, 3, 4], "validation": [11, 12, 13], "test": [21, 22, 23, 24, 25]}
    folder = tmp_path / "held_out"
    folder.mkdir()
    for split, answers in splits.items():
        datasets.Dataset.from_list(_gsm8k_rows(split, answers)).to_parquet(str(folder / f"{split}.parquet"))
    one = tmp_path / "held_out.jsonl"
    one.write_text("".join(json.dumps(r) + "\n" for r in _gsm8k_rows("test", splits["test"])))
    tok, want = build_tokenizer(), _gsm8k_rows("test", splits["test"])
    scorer = RewardScorer("rlhf_orch.rewards.math:gsm8k")   # configs/gsm8k_cpu.yaml's reward
    for source, label in ((folder, f"{folder} (split test)"), (one, str(one))):
        # validation comes first in the default order: eval.split=test must be what is read
        es = eval_set_for(_eval_cfg("eval.every=5", f"eval.source={source}", "eval.split=test", config=GSM8K), tok)
        assert es.source == label and [p.index for p in es.prompts] == list(range(5))
        rendered = [f"user: ann has {a} pens. how many? assistant:" for a in splits["test"]]
        assert [p.row["prompt"] for p in es.prompts] == rendered
        assert [p.token_ids for p in es.prompts] == tok(rendered, add_special_tokens=False).input_ids
        for p, row in zip(es.prompts, want):
            assert p.row == {**row, "prompt": p.row["prompt"], "answer": row["reward_model"]["ground_truth"]}
        # what the reward workers get for the evaluation's samples: right answers score 1, another split's 0
        assert scorer.score([(f"#### {a}", p.row) for a, p in zip(splits["test"], es.prompts)]) == [1.0] * 5
        assert scorer.score([(f"#### {a}", p.row) for a, p in zip(splits["validation"], es.prompts)]) == [0.0] * 3


def test_eval_source_problems_name_the_field(tmp_path):
    tok = build_tokenizer()
    with pytest.raises(ConfigError) as e:
        _eval_cfg("eval.every=1", "eval.temperature=0.5", "eval.source=builtin:nope")
    text = str(e.value)
    assert "eval.temperature: eval.n 1 is greedy" in text and "eval.source: unknown built-in task 'nope'" in text
    with pytest.raises(ConfigError, match="eval.source: file 'missing.jsonl' not found"):
        _eval_cfg("eval.every=1", "eval.source=missing.jsonl")
    with pytest.raises(ConfigError, match="eval.split: applies to file sources only"):
        _eval_cfg("eval.every=1", "eval.split=test")
    one = tmp_path / "train.jsonl"
    one.write_text('{"prompt": "1+1=", "answer": "2"}\n' * 20)
    own = tmp_path / "own.yaml"   # a config of its own: tiny_cpu.yaml sets builtin-only data fields
    own.write_text(f"experiment: {{output_dir: {tmp_path}}}\ndata: {{source: {one}, prompts_per_step: 4}}\n"
                   "engines: [{kind: hf}]\neval: {every: 1}\n")
    with pytest.raises(DataError, match="eval.source: data.source .* is one file, which has no validation split"):
        eval_set_for(load_config(own), tok)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text('{"prompt": "2+2=", "answer": "4"}\n{"prompt": "%s1=", "answer": "1"}\n' % ("1+" * 20))
    with pytest.raises(DataError, match="data.max_prompt_tokens: 1 of 2 prompts of the eval source"):
        eval_set_for(_eval_cfg("eval.every=1", f"eval.source={held_out}"), tok)
    held_out.write_text('{"prompt": "2+2=", "answer": "4"}\n{"question": "3+3="}\n')
    with pytest.raises(DataError, match=r"eval.source \(.*held_out.jsonl, split validation\): .*held_out.jsonl:2"):
        eval_set_for(_eval_cfg("eval.every=1", f"eval.source={held_out}"), tok)
    pytest.importorskip("datasets")
    with pytest.raises(DataError, match=r"eval.split: 'examples/gsm8k' has no split 'dev' \(its splits: train, test\)"):
        eval_set_for(_eval_cfg("eval.every=1", "eval.source=examples/gsm8k", "eval.split=dev", config=GSM8K), tok)


# ---- the hf engine: greedy, and seeded requests beside the training stream --------------------------
@pytest.fixture()
def engine_and_prompts(tiny_model_dir):
    torch.set_num_threads(1)
    tok = build_tokenizer()
    engine = engine_class("hf")(name="e", model_path=tiny_model_dir, seed=0)
    prompts = [tok(t, add_special_tokens=False).input_ids for t in ("1+2=", "3+4=", "2+2=")]
    return engine, prompts


def test_greedy_is_argmax_with_untempered_logprobs(engine_and_prompts):
    engine, prompts = engine_and_prompts
    before = engine.rng_state().clone()
    out = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    assert torch.equal(engine.rng_state(), before)   # greedy draws nothing
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        for tok, lp in zip(out[0].response_ids, out[0].logprobs):
            logp = torch.log_softmax(engine.model(input_ids=ids).logits[0, -1].float(), -1)
            assert tok == int(logp.argmax()) and lp == pytest.approx(float(logp[tok]), abs=1e-5)
            ids = torch.cat([ids, torch.tensor([[tok]])], 1)


def test_seeded_requests_leave_the_training_stream_untouched(engine_and_prompts, tiny_model_dir):
    engine, prompts = engine_and_prompts
    train = SamplingParams(temperature=1.0, max_new_tokens=4, n=4)
    fresh = engine_class("hf")(name="f", model_path=tiny_model_dir, seed=0)
    want = [s.response_ids for s in fresh.generate(prompts, train)]
    before = engine.rng_state().clone()
    seeded = [SamplingParams(temperature=1.0, max_new_tokens=4, n=4, seed=1000 + 10 * i) for i in range(3)]
    a = [s.response_ids for s in engine.generate(prompts, seeded)]
    assert torch.equal(engine.rng_state(), before)
    assert [s.response_ids for s in engine.generate(prompts, train)] == want   # as if the seeded call never happened
    # reproducible, n distinct streams per prompt (seed + j), and the same for a prompt whatever else is in the call
    assert [s.response_ids for s in engine.generate(prompts, seeded)] == a
    assert len({tuple(r) for r in a[:4]}) > 1
    assert [s.response_ids for s in engine.generate(prompts[1:], seeded[1:])] == a[4:]
    with pytest.raises(EngineError, match="seed, given for every prompt or for none"):
        engine.generate(prompts[:2], [seeded[0], train])


def test_pass_at_k_matches_simulation():
    # the estimator is unbiased: the mean over many random n-sample draws of pass@k equals 1 - (1 - p)^k
    rng, p, n, k = random.Random(0), 0.3, 8, 3
    est = [pass_at_k(n, sum(rng.random() < p for _ in range(n)), k) for _ in range(20000)]
    assert sum(est) / len(est) == pytest.approx(1 - (1 - p) ** k, abs=0.01)


def test_reward_plot_gets_an_eval_panel(tmp_path):
    import matplotlib.image as mpimg
    from rlhf_orch.metrics import plot_run
    records = [{"step": s, "rollout/reward_mean": 0.1 * s} for s in range(1, 7)]
    plain = plot_run(records, tmp_path / "plain")
    for r in records[1::2]:
        r.update({"eval/reward_mean": 0.05 * r["step"], "eval/pass@1": 0.05 * r["step"], "eval/pass@k": 0.1 * r["step"],
                  "eval/k": 4.0})
    with_eval = plot_run(records, tmp_path / "eval")
    assert [p.name for p in plain] == [p.name for p in with_eval] == ["reward.png"]
    # the eval panel sits under the reward curve: a taller figure
    assert mpimg.imread(with_eval[0]).shape[0] > 1.3 * mpimg.imread(plain[0]).shape[0]
