"""The checks every rollout engine must pass, written once and run per kind.

`run_contract(engine, model_dir, other_model_dir)` is called by tests/unit/test_engine_hf.py (CPU, CI)
and by the GPU-marked tests of the vllm and sglang engines. `other_model_dir` holds the same
architecture with different weights: loading them must change what the engine computes (a load
that only updates a copy the kernels never read is the classic silent failure).
"""
from __future__ import annotations

import pytest
import torch

from rlhf_orch.engines.base import SamplingParams
from rlhf_orch.errors import EngineError
from rlhf_orch.weight_sync.buckets import checksums


def reference_logprobs(model_dir: str, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return lp[len(prompt) - 1:].tolist()


def two_models(root, spec: dict) -> tuple[str, str]:
    """Two built-in tiny models of one shape under `root`, seeds 0 and 1: the engine's, and the other weights."""
    from rlhf_orch.models import TinyModelSpec, ensure_model_dir
    return tuple(str(ensure_model_dir("tiny-llama", TinyModelSpec(**spec), root / name, seed=seed))
                 for name, seed in (("a", 0), ("b", 1)))


def named_weights(model_dir: str, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def run_contract(engine, model_dir: str, other_model_dir: str, tokenizer, atol: float = 1e-4, dtype=torch.float32):
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in ("1+2=", "3+4=", "10+1=")]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, n=3)

    # 1. shape of the output: n samples per prompt, grouped, stamped with the version
    samples = engine.generate(prompts, params)
    assert len(samples) == 9
    assert [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for s in samples:
        assert s.prompt_ids == prompts[s.prompt_index]
        assert 1 <= len(s.response_ids) <= 4 and len(s.logprobs) == len(s.response_ids)
        assert all(lp <= 0.0 for lp in s.logprobs)
        assert s.finish_reason in ("stop", "length")
        if s.finish_reason == "stop":
            assert s.response_ids[-1] == tokenizer.eos_token_id
        assert s.weight_version == engine.weight_version

    # 2. logprobs are the policy's: they match an independent forward of the same weights
    s = samples[0]
    ref = reference_logprobs(model_dir, s.prompt_ids, s.response_ids, params.temperature)
    assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(ref), atol=atol), (s.logprobs, ref)

    # 3. a paused engine refuses to generate; resume restores it
    engine.pause()
    with pytest.raises(EngineError, match="paused"):
        engine.generate(prompts, params)
    engine.resume()

    # 4. loading other weights changes what the engine computes, and checksums report the new weights
    new = named_weights(other_model_dir, dtype)
    engine.pause()
    engine.load_weights(new)
    assert engine.checksums([n for n, _ in new]) == checksums(t for _, t in new)
    engine.finish_sync(7)
    engine.resume()
    assert engine.weight_version == 7
    after = engine.generate(prompts[:1], SamplingParams(temperature=1.0, max_new_tokens=4, n=1))[0]
    assert after.weight_version == 7
    ref_new = reference_logprobs(other_model_dir, after.prompt_ids, after.response_ids, 1.0)
    assert torch.allclose(torch.tensor(after.logprobs), torch.tensor(ref_new), atol=atol)
    ref_old = reference_logprobs(model_dir, after.prompt_ids, after.response_ids, 1.0)
    assert not torch.allclose(torch.tensor(ref_new), torch.tensor(ref_old), atol=atol), "models must differ"


def run_sleep_contract(engine, model_dir: str, tokenizer, atol: float = 1e-4, dtype=torch.float32):
    """Colocation: sleep frees the engine for a trainer; after level 2 the weights come back only through a
    load (the sync), after level 1 they come back by themselves. An asleep engine refuses to generate."""
    prompt = tokenizer("2+2=", add_special_tokens=False).input_ids
    params = SamplingParams(temperature=1.0, max_new_tokens=4, n=1)
    weights = named_weights(model_dir, dtype)

    def check(version):
        s = engine.generate([prompt], params)[0]
        assert s.weight_version == version
        ref = reference_logprobs(model_dir, s.prompt_ids, s.response_ids, 1.0)
        assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(ref), atol=atol), (s.logprobs, ref)

    # level 2: weights dropped; wake the weights, load them (what the sync does), then the KV cache
    engine.load_weights(weights)
    engine.sleep(2)
    assert engine.is_asleep()
    with pytest.raises(EngineError, match="asleep"):
        engine.generate([prompt], params)
    engine.wake_up(["weights"])
    engine.pause()
    engine.load_weights(weights)
    assert engine.checksums([n for n, _ in weights]) == checksums(t for _, t in weights)
    engine.finish_sync(11)
    engine.resume()
    engine.wake_up(["kv_cache"])
    assert not engine.is_asleep()
    check(11)

    # level 1: weights kept in CPU memory and restored by wake_up alone
    engine.sleep(1)
    engine.wake_up()
    check(11)


def run_inflight_contract(engine, model_dir: str, other_model_dir: str, tokenizer, max_new_tokens: int = 24,
                          atol: float = 1e-4, dtype=torch.float32, start_delay_s: float = 0.1, kv_recomputed: bool = False):
    """Partial rollouts: a "keep" pause parks running requests, a sync changes the weights under them, and after
    resume their later tokens carry the new version; an "abort" pause hands requests back unfinished.
    `kv_recomputed`: the engine recomputes kept requests' KV under the new weights (vLLM after its cache reset),
    so later tokens are exactly the new policy's; otherwise (hf) they only differ from the old policy's."""
    import threading
    import time

    prompt = tokenizer("3+4=", add_special_tokens=False).input_ids
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, n=2, ignore_eos=True)
    v0 = engine.weight_version
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=engine.generate([prompt], params)))
    worker.start()
    time.sleep(start_delay_s)
    engine.pause("keep")
    assert worker.is_alive(), "the request finished before the pause: make it longer"
    new = named_weights(other_model_dir, dtype)
    engine.load_weights(new)
    engine.finish_sync(v0 + 1)
    engine.resume()
    worker.join(timeout=120)
    samples = result["out"]
    assert len(samples) == 2
    for s in samples:
        assert len(s.response_ids) == max_new_tokens and s.finish_reason == "length"
        assert len(s.token_versions) == len(s.response_ids)
        assert s.token_versions == sorted(s.token_versions) and s.min_version == v0 and s.max_version == v0 + 1
        cut = s.token_versions.index(v0 + 1)
        lp = torch.tensor(s.logprobs)
        gap = lambda ref, sl: float((lp[sl] - torch.tensor(ref)[sl]).abs().mean())   # mean over long responses
        # tokens before the update are the old policy's; later ones are not
        ref_old = reference_logprobs(model_dir, s.prompt_ids, s.response_ids, 1.0)
        assert gap(ref_old, slice(0, cut)) < atol, gap(ref_old, slice(0, cut))
        assert gap(ref_old, slice(cut, None)) > atol, gap(ref_old, slice(cut, None))
        if kv_recomputed:
            ref_new = reference_logprobs(other_model_dir, s.prompt_ids, s.response_ids, 1.0)
            assert gap(ref_new, slice(cut, None)) < atol, gap(ref_new, slice(cut, None))

    worker = threading.Thread(target=lambda: result.update(out=engine.generate([prompt], params)))
    worker.start()
    time.sleep(start_delay_s)
    engine.pause("abort")
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert all(s.finish_reason == "abort" and len(s.response_ids) < max_new_tokens for s in result["out"])
    engine.resume()
    again = engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=3, n=1))
    assert again[0].finish_reason in ("stop", "length") and again[0].weight_version == v0 + 1
