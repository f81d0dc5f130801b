"""The engine contract against the built-in hf engine (CPU)."""
import pytest
import torch

from engine_contract import run_contract
from rlhf_orch.engines import engine_class
from rlhf_orch.errors import ConfigError
from rlhf_orch.models import TinyModelSpec, build_tokenizer, ensure_model_dir


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    return str(ensure_model_dir("tiny-llama", TinyModelSpec(), tmp_path_factory.mktemp("other"), seed=1))


def test_hf_engine_contract(tiny_model_dir, other_model_dir):
    torch.set_num_threads(1)
    engine = engine_class("hf")(name="e", model_path=tiny_model_dir, device="cpu", device_id="slot0", seed=0)
    assert engine.device_ids() == ["slot0"]
    run_contract(engine, tiny_model_dir, other_model_dir, build_tokenizer())


def test_top_p_keeps_most_likely_token(tiny_model_dir):
    from rlhf_orch.engines.base import SamplingParams
    engine = engine_class("hf")(name="e", model_path=tiny_model_dir, seed=0)
    tok = build_tokenizer()
    p = tok("1+2=", add_special_tokens=False).input_ids
    greedy = engine.generate([p], SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=3, n=4))
    assert len({tuple(s.response_ids) for s in greedy}) == 1   # top_p -> 0 is greedy


def test_unknown_kind_and_lazy_registry():
    import subprocess
    import sys
    with pytest.raises(ConfigError, match="unknown engine kind 'x'"):
        engine_class("x")
    # A fresh interpreter: importing the library must not pull in any engine or DeepSpeed.
    code = ("import sys, rlhf_orch.config, rlhf_orch.engines, rlhf_orch.weight_sync, rlhf_orch.trainer, rlhf_orch.metrics, "
            "rlhf_orch.rollout, rlhf_orch.rollout.batching, rlhf_orch.engines.vllm_async;"
            "bad = [m for m in ('vllm', 'sglang', 'deepspeed', 'ray') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hf_engine_sleep_contract(tiny_model_dir):
    from engine_contract import run_sleep_contract
    engine = engine_class("hf")(name="e", model_path=tiny_model_dir, seed=0)
    run_sleep_contract(engine, tiny_model_dir, build_tokenizer())


def test_hf_engine_wakes_with_nan_weights_until_loaded(tiny_model_dir):
    engine = engine_class("hf")(name="e", model_path=tiny_model_dir, seed=0)
    engine.sleep(2)
    assert all(p.numel() == 0 for p in engine.params.values())     # the memory is really released
    engine.wake_up()
    assert all(torch.isnan(p).all() for p in engine.params.values())  # a missed sync cannot pass for weights


def test_hf_engine_keeps_requests_through_a_sync_and_aborts_on_request(tiny_model_dir, other_model_dir):
    from engine_contract import run_inflight_contract
    engine = engine_class("hf")(name="e", model_path=tiny_model_dir, seed=0, decode_delay_s=0.02)
    engine.finish_sync(0)
    run_inflight_contract(engine, tiny_model_dir, other_model_dir, build_tokenizer())


def test_hf_engine_per_prompt_lengths(tiny_model_dir):
    from rlhf_orch.engines.base import SamplingParams
    from rlhf_orch.errors import EngineError
    engine = engine_class("hf")(name="e", model_path=tiny_model_dir, seed=0)
    tok = build_tokenizer()
    p = tok("1+2=", add_special_tokens=False).input_ids
    out = engine.generate([p, p], [SamplingParams(max_new_tokens=3, n=2, ignore_eos=True),
                                   SamplingParams(max_new_tokens=7, n=2, ignore_eos=True)])
    assert [len(s.response_ids) for s in out] == [3, 3, 7, 7]
    assert [s.prompt_index for s in out] == [0, 0, 1, 1]
    with pytest.raises(EngineError, match="max_new_tokens and ignore_eos only"):
        engine.generate([p, p], [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)])


@pytest.mark.parametrize("api", ["installed", "past_key_values"])
def test_hf_engine_logprobs_equal_one_plain_forward(tiny_model_dir, api):
    """Each sampled token's logprob equals the one a single forward of prompt + response gives (what the trainer
    computes), with the installed transformers' forward and with one that takes the KV cache as `past_key_values`
    only, as transformers 5.17 does on the GPU machine: there the engine passed `cache`, the forward swallowed it
    into **kwargs, and every decode step ran without its context (logprobs off by up to ~1, 2026-11-28)."""
    from rlhf_orch.engines.base import SamplingParams
    from rlhf_orch.engines.hf import cache_arg
    torch.manual_seed(0)
    engine = engine_class("hf")(name="e", model_path=tiny_model_dir, seed=3)
    if api == "past_key_values":
        real = engine.model.forward
        new_name = cache_arg(engine.model) == "cache"

        def forward(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                    **kwargs):   # like 5.17: a keyword it does not know is dropped
            extra = {"cache" if new_name else "past_key_values": past_key_values} if past_key_values is not None else {}
            return real(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=use_cache, **extra)

        engine.model.forward = forward
        engine._cache_arg = cache_arg(engine.model)
        assert engine._cache_arg == "past_key_values"
    tok = build_tokenizer()
    prompts = [tok(t, add_special_tokens=False).input_ids for t in ("1+2=", "3+4+1=", "9=")]   # left padding
    samples = engine.generate(prompts, SamplingParams(max_new_tokens=6, n=4, ignore_eos=True))
    worst = 0.0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            lp = torch.log_softmax(engine.model(input_ids=ids).logits[0].float(), -1)
            want = [float(lp[len(s.prompt_ids) - 1 + i, t]) for i, t in enumerate(s.response_ids)]
            worst = max(worst, max(abs(a - b) for a, b in zip(s.logprobs, want)))
    assert len(samples) == 12 and worst < 1e-4, worst
