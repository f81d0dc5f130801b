"""The streaming vLLM engine (`kind: vllm`, `streaming: true`: AsyncLLM on its own loop thread) on a GPU: the
engine contract, then partial rollouts: requests in flight are parked by a "keep" pause, new weights are loaded
under them, and after resume their later tokens carry the new version and are exactly the new policy's (vLLM
recomputes their KV after the cache reset); an "abort" pause hands them back unfinished. Needs vLLM 0.26.0.

    python -m pytest -q -m gpu tests/gpu/test_vllm_streaming.py
"""
import threading

import pytest
import torch

from engine_contract import run_contract, run_inflight_contract, two_models
from rlhf_orch.engines.base import SamplingParams
from rlhf_orch.engines.vllm_async import StreamingVLLMEngine   # imports vLLM only when an engine starts
from rlhf_orch.models import build_tokenizer

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm")

SPEC = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return two_models(tmp_path_factory.mktemp("vllm_stream_models"), SPEC)


@pytest.fixture(scope="module")
def engine(dirs):
    e = StreamingVLLMEngine(name="s", model_path=dirs[0], dtype="bfloat16", gpu_memory_utilization=0.25,
                            enforce_eager=True, enable_sleep_mode=False, max_model_len=1024, seed=0,
                            kv_cache_memory_gb=1)
    yield e
    e.shutdown()


def test_streaming_vllm_contract(engine, dirs):
    run_contract(engine, dirs[0], dirs[1], build_tokenizer(), atol=0.05, dtype=torch.bfloat16)


def test_streaming_vllm_batches_as_wide_as_llm(engine):
    """The streaming engine's scheduler takes as many sequences as `LLM` would on this GPU, not the 128 of vLLM's
    testing defaults (AsyncLLM's own usage context)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    _, llm_seqs = EngineArgs.get_batch_defaults(1)
    sched = engine.llm._llm.vllm_config.scheduler_config
    assert sched.max_num_seqs == llm_seqs[UsageContext.LLM_CLASS] and sched.max_num_seqs >= 256


def test_streaming_vllm_final_only_gives_what_streaming_gives(engine):
    """per_token_versions=False (no partial rollouts): vLLM hands back each request only at its end (FINAL_ONLY);
    greedy, the same tokens and logprobs as the streamed call, every token stamped with the engine's version."""
    p = build_tokenizer()("12+7=", add_special_tokens=False).input_ids
    kw = dict(max_new_tokens=48, n=1, temperature=0.0, ignore_eos=True)   # greedy: n must be 1
    streamed = engine.generate([p] * 3, SamplingParams(**kw))
    final = engine.generate([p] * 3, SamplingParams(**kw, per_token_versions=False))
    assert [s.response_ids for s in final] == [s.response_ids for s in streamed]
    for a, b in zip(final, streamed):
        assert len(a.logprobs) == 48 and a.logprobs == pytest.approx(b.logprobs, abs=0.05)
        assert a.token_versions == [engine.weight_version] * 48 and a.text == b.text


def test_streaming_vllm_concurrent_calls(engine):
    """Generate calls from several threads run at once (continuous batching across them)."""
    p = build_tokenizer()("1+1=", add_special_tokens=False).input_ids
    out = [None] * 4
    def go(i):
        out[i] = engine.generate([p] * 2, SamplingParams(max_new_tokens=32, n=3, ignore_eos=True))
    ts = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    assert all(o is not None and len(o) == 6 and all(len(s.response_ids) == 32 for s in o) for o in out)


def test_streaming_vllm_keeps_requests_through_a_sync(engine, dirs):
    engine.resume()
    run_inflight_contract(engine, dirs[1], dirs[0], build_tokenizer(), max_new_tokens=600, atol=0.05,
                          dtype=torch.bfloat16, start_delay_s=0.3, kv_recomputed=True)


def test_streaming_vllm_text_decoded_at_the_end_equals_vllms(engine):
    """The engine asks vLLM for no incremental detokenization (the front end's per-token work, issue #27) and decodes
    each sample once at the end: the same text vLLM's own detokenizer writes for the same tokens."""
    tok = build_tokenizer()
    prompts = [tok(p, add_special_tokens=False).input_ids for p in ("1+1=", "12+30=", "7+8=")]
    engine.resume()
    theirs = engine.llm.generate(prompts, vllm.SamplingParams(n=4, temperature=1.0, max_tokens=48, logprobs=0, seed=3,
                                                           detokenize=True))
    assert sum(bool(r[6]) for r in theirs) > 0, "vLLM wrote no text at all: nothing compared"
    for _i, _k, toks, _lps, _v, _reason, text in theirs:
        assert engine.llm._llm.tokenizer.decode(toks, skip_special_tokens=True) == text
    ours = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=48, seed=3))
    assert len(ours) == 12 and all(s.text == tok.decode(s.response_ids, skip_special_tokens=True) for s in ours)
