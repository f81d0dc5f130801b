"""Padding-free training on a GPU: packed micro-batches through torch's flash varlen kernel give the padded
path's logprobs to bf16 tolerance and the same gradient direction; the chunked LM head equals the full
logits; a DeepSpeed rank trains packed + chunked and reports MFU.

    python -m pytest -q -m gpu tests/gpu/test_packing_gpu.py
"""
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

pytestmark = pytest.mark.gpu

LENGTHS = [5, 17, 2, 333, 9, 120, 64, 1, 700, 31]


def _model(dtype, vocab=1000):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", dtype)


def _batch(lengths, vocab=1000):
    from tests.unit.test_packing import _batch as cpu_batch
    return cpu_batch(lengths, prompt=8, vocab=vocab)


def _padded(model, batch, chunk=0):
    from rlhf_orch.trainer.logprob import model_logprobs
    ids, mask = batch.input_ids.cuda(), batch.attention_mask.cuda()
    tok, _ = model_logprobs(model, ids, 1.0, chunk, attention_mask=mask)
    return torch.nn.functional.pad(tok, (1, 0)) * mask


def _packed(model, batch, chunk=0):
    from rlhf_orch.trainer.packing import packed_logprobs, resolve_attn
    impl = resolve_attn("varlen", "cuda")
    model.set_attn_implementation(impl)
    try:
        return packed_logprobs(model, batch, 1.0, impl, torch.device("cuda"), chunk)[0]
    finally:
        model.set_attn_implementation("sdpa")


def test_torch_varlen_kernel_is_used():
    from rlhf_orch.trainer.packing import resolve_attn
    from rlhf_orch.trainer.varlen import torch_varlen_available
    assert torch_varlen_available(), "torch.nn.attention.varlen is missing: the packed path would fall back to a loop"
    assert resolve_attn("auto", "cuda") in ("rlhf_varlen", "flash_attention_2")


def test_packed_varlen_logprobs_match_padded_in_bf16():
    batch = _batch(LENGTHS)
    mask = batch.attention_mask.cuda().bool()
    ref_model = _model(torch.float32)
    with torch.no_grad():
        exact = _padded(ref_model, batch)
    model = _model(torch.bfloat16)
    with torch.no_grad():
        padded = _padded(model, batch)
        packed = _packed(model, batch)
    # bf16 tolerance: the packed path's error against float32 is of the padded bf16 path's own size.
    err_padded = (padded - exact)[mask].abs()
    err_packed = (packed - exact)[mask].abs()
    diff = (packed - padded)[mask].abs()
    print(f"\nbf16 vs fp32: padded mean {err_padded.mean():.4f} max {err_padded.max():.4f}; packed mean "
          f"{err_packed.mean():.4f} max {err_packed.max():.4f}; packed vs padded max {diff.max():.4f}")
    assert err_packed.mean() <= 1.5 * err_padded.mean() + 1e-3
    assert err_packed.max() <= 2 * err_padded.max() + 1e-2


def test_packed_varlen_gradients_match_padded():
    from rlhf_orch.algorithms import aggregate_token_loss
    batch = _batch(LENGTHS)
    rmask = batch.response_mask.cuda()
    grads = []
    for fn in (_padded, _packed):
        model = _model(torch.bfloat16)
        loss = aggregate_token_loss(-fn(model, batch), rmask, float(rmask.sum()))
        loss.backward()
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    cos = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    rel = (grads[0] - grads[1]).norm() / grads[0].norm()
    print(f"\ngradients packed vs padded (bf16): cosine {cos:.5f}, relative difference {rel:.4f}")
    assert cos > 0.999 and rel < 0.05


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_head_equals_full_logits_in_bf16(packed):
    model = _model(torch.bfloat16, vocab=32000)
    batch = _batch(LENGTHS, vocab=32000)
    fn = _packed if packed else _padded
    with torch.no_grad():
        full = fn(model, batch)
        chunked = fn(model, batch, chunk=256)
    assert (full - chunked).abs().max() < 2e-2   # the same bf16 matmuls, chunked: rounding only


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_deepspeed_rank_trains_packed_and_chunked_with_mfu(tmp_path):
    from rlhf_orch.trainer.deepspeed_trainer import DeepSpeedTrainer
    _model(torch.bfloat16, vocab=32000).save_pretrained(tmp_path / "m")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), LOCAL_RANK="0")
    tr = DeepSpeedTrainer(str(tmp_path / "m"), 0, 1, device="cuda", zero_stage=2, lr=1e-4, bf16=True,
                          max_tokens_per_micro_batch=1024, packing=True, attn="auto", logprob_chunk_tokens=512)
    batch = _batch(LENGTHS, vocab=32000)
    m = tr.train_step(batch, float(batch.response_mask.sum()))
    print({k: round(v, 4) for k, v in m.items()})
    assert m["train/padding_frac"] == 0.0 and m["train/micro_batches"] >= 2
    assert 0.0 < m["train/mfu"] < 1.0 and m["train/entropy"] > 0
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    torch.distributed.destroy_process_group()
