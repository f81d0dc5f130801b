"""Chunked LM-head logprobs equal the full-logits path (values, entropies, gradients), and the FLOPs count."""
import pytest
import torch

from rlhf_orch.errors import TrainerError
from rlhf_orch.metrics.flops import ModelFlops, peak_flops
from rlhf_orch.trainer.logprob import model_logprobs
from rlhf_orch.trainer.packing import packed_logprobs, resolve_attn


def _model(vocab=300, tie=False):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tie, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def _ids(B=3, T=21, vocab=300):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    mask[2, 8:] = 0
    return ids, mask


def _full_entropy(model, ids, mask, temperature):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        logp = torch.log_softmax(logits / temperature, -1)
        return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk,tie", [(7, False), (64, True), (1000, False)])
def test_chunked_equals_full_values_entropy_and_gradients(chunk, tie):
    model = _model(tie=tie)
    ids, mask = _ids()
    full, ent_full = model_logprobs(model, ids, 0.7, 0, True, attention_mask=mask)
    (full * mask[:, 1:]).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    chunked, ent = model_logprobs(model, ids, 0.7, chunk, True, attention_mask=mask)
    (chunked * mask[:, 1:]).sum().backward()
    m = mask[:, 1:].bool()
    assert torch.allclose(chunked[m], full[m], atol=1e-6, rtol=0)
    assert torch.allclose(ent[m], ent_full[m], atol=1e-5, rtol=0)
    assert torch.allclose(ent_full, _full_entropy(model, ids, mask, 0.7), atol=1e-6)
    assert not ent.requires_grad
    # Gradients sum over every position in another order when chunked; how far the float32 rounding drifts depends on
    # the CPU kernels (tests/conftest.py pins AVX2 ones: 3.3e-6 at most on embed_tokens, under 1e-6 with AVX-512).
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want[n], atol=1e-5, rtol=0), (n, (p.grad - want[n]).abs().max())


def test_chunked_packed_path_equals_full_packed_path():
    model = _model()
    impl = resolve_attn("varlen", "cpu")
    model.set_attn_implementation(impl)
    from tests.unit.test_packing import _batch
    batch = _batch([5, 17, 2, 33, 9], vocab=300)
    with torch.no_grad():
        a, ea = packed_logprobs(model, batch, 1.0, impl, torch.device("cpu"), 0, True)
        b, eb = packed_logprobs(model, batch, 1.0, impl, torch.device("cpu"), 5, True)
    assert torch.allclose(a, b, atol=1e-6, rtol=0)
    assert torch.allclose(ea, eb, atol=1e-5, rtol=0)


def test_chunking_refuses_post_processed_logits():
    model = _model()
    model.config.final_logit_softcapping = 30.0
    ids, mask = _ids()
    with pytest.raises(TrainerError, match="logprob_chunk_tokens"):
        model_logprobs(model, ids, 1.0, 8, attention_mask=mask)


def test_model_flops_count():
    model = _model(vocab=300)
    f = ModelFlops(model)
    # Per layer: q 32x32, k and v 32x16 each (2 kv heads of 8), o 32x32, MLP 3 x 32x64; LM head 300x32.
    per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64
    assert f.params == 2 * per_layer + 300 * 32
    assert f.forward([10, 3]) == 2 * f.params * 13 + 2 * 2 * 32 * (100 + 9)
    assert f.training([10, 3]) == 3 * f.forward([10, 3])
    assert peak_flops("NVIDIA H200", True) == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe", True) == pytest.approx(756e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", False) == pytest.approx(66.9e12)
    assert peak_flops("cpu", True) is None
