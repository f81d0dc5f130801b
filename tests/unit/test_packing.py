"""Token-budget micro-batches, token-balanced rank shards and the packed forward (CPU, float32)."""
import random

import pytest
import torch

from rlhf_orch.algorithms import aggregate_token_loss, policy_loss
from rlhf_orch.trainer.batch import build_train_batch, shard, shard_balanced
from rlhf_orch.trainer.packing import (balance_rows, block_causal_mask, flash_attn_available, imbalance, micro_batch_plan,
                                       packed_logprobs, resolve_attn, seq_lengths)
from rlhf_orch.errors import ConfigError
from rlhf_orch.types import Sample


def _long_tail(n: int, seed: int = 0) -> list[int]:
    """Mostly short lengths with a few very long ones, like random-weight RL responses."""
    rng = random.Random(seed)
    return [min(int(rng.paretovariate(1.2) * 8), 400) for _ in range(n)]


def _batch(lengths: list[int], prompt: int = 3, vocab: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(lengths):
        p = min(prompt, n - 1)
        ids = torch.randint(4, vocab, (n,), generator=g).tolist()
        lp = (-torch.rand(n - p, generator=g)).tolist()
        samples.append(Sample(i, ids[:p], ids[p:], lp, "stop", 0))
    adv = torch.randn(len(lengths), generator=g)
    return build_train_batch(samples, adv, pad_id=0)


def _tiny_llama(vocab: int = 50):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def _padded_logprobs(model, batch, temperature=1.0):
    # The trainer's padded path (DeepSpeedTrainer._logprobs).
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits[:, :-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    tok = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(tok, (1, 0))


@pytest.mark.parametrize("packed", [True, False])
def test_micro_batches_cover_every_row_once_within_budget(packed):
    lengths = _long_tail(200)
    budget = 512
    plan = micro_batch_plan(lengths, budget, packed)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:
        cost = sum(lengths[i] for i in mb) if packed else len(mb) * max(lengths[i] for i in mb)
        assert cost <= budget or len(mb) == 1
    # Greedy on sorted lengths fills micro-batches: far fewer than one per row.
    assert len(plan) <= 2 * sum(lengths) / budget + 2


def test_rank_balancing_covers_every_row_and_beats_contiguous_shards():
    lengths = sorted(_long_tail(64, seed=3), reverse=True)[:8] + _long_tail(56, seed=4)
    world = 4
    ranks = balance_rows(lengths, world)
    assert sorted(i for r in ranks for i in r) == list(range(len(lengths)))
    balanced = imbalance([sum(lengths[i] for i in r) for r in ranks])
    per = len(lengths) // world
    contiguous = imbalance([sum(lengths[r * per:(r + 1) * per]) for r in range(world)])
    assert balanced < contiguous
    assert balanced < 0.05


def test_shard_balanced_keeps_per_row_bookkeeping():
    lengths = [30, 4, 5, 28, 6, 7, 3, 25]
    batch = _batch(lengths)
    batch.old_logprobs = torch.randn(batch.input_ids.shape)
    shards, imb = shard_balanced(batch, 2)
    assert imb < imbalance([sum(lengths[:4]), sum(lengths[4:])])
    seen = []
    for s in shards:
        for b in range(len(s)):
            # Find the source row by its advantage (unique floats) and compare every per-row tensor.
            src = int(torch.nonzero(batch.advantages == s.advantages[b])[0])
            seen.append(src)
            for name in ("input_ids", "attention_mask", "response_mask", "engine_logprobs", "old_logprobs"):
                assert torch.equal(getattr(s, name)[b], getattr(batch, name)[src]), name
    assert sorted(seen) == list(range(len(lengths)))
    assert len(shard(batch, 2)[0]) == 4   # the default stays contiguous


def test_block_causal_mask():
    m = block_causal_mask([2, 3], "cpu")[0, 0]
    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, want)


@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
def test_packed_logprobs_equal_padded(attn):
    model = _tiny_llama().eval()
    impl = resolve_attn(attn, "cpu")
    batch = _batch([5, 17, 2, 33, 9, 12])
    with torch.no_grad():
        padded = _padded_logprobs(model, batch, 0.7) * batch.attention_mask
        model.set_attn_implementation(impl)
        # The same model serves unpacked right-padded batches (the warm start) exactly too.
        again = _padded_logprobs(model, batch, 0.7) * batch.attention_mask
        assert torch.allclose(again, padded, atol=1e-6, rtol=0)
        packed, ent = packed_logprobs(model, batch, 0.7, impl, torch.device("cpu"), with_entropy=True)
    assert packed.shape == padded.shape == ent.shape
    assert float(ent.max()) > 0 and float(ent.max()) <= torch.log(torch.tensor(50.0)) + 1e-5
    assert torch.allclose(packed, padded, atol=1e-5, rtol=0), (packed - padded).abs().max()


def _loss(lp, batch, num_tokens):
    per_tok, _ = policy_loss(lp, batch.engine_logprobs, batch.advantages, batch.response_mask, 0.2, 0.28)
    return aggregate_token_loss(per_tok, batch.response_mask, num_tokens)


@pytest.mark.parametrize("packed,attn", [(False, "sdpa"), (True, "sdpa"), (True, "varlen")])
def test_token_budget_gradients_equal_the_full_padded_batch(packed, attn):
    model = _tiny_llama()
    impl = resolve_attn(attn, "cpu")
    batch = _batch([5, 17, 2, 33, 9, 12, 40, 3, 21])
    tokens = float(batch.response_mask.sum())
    model.zero_grad()
    _loss(_padded_logprobs(model, batch), batch, tokens).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    plan = micro_batch_plan(seq_lengths(batch), 48, packed)
    assert len(plan) > 2
    for rows in plan:
        mb = batch.select(rows)
        width = int(mb.attention_mask.sum(1).max())
        mb = mb.trim(width)
        if packed:
            model.set_attn_implementation(impl)
            lp = packed_logprobs(model, mb, 1.0, impl, torch.device("cpu"))[0]
            model.set_attn_implementation("sdpa")
        else:
            lp = _padded_logprobs(model, mb)
        _loss(lp, mb, tokens).backward()
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 0
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want[n], atol=1e-6, rtol=0), (n, (p.grad - want[n]).abs().max())
        # The tiny model's gradients are ~1e-3, so also hold the difference to a small fraction of them.
        assert float((p.grad - want[n]).abs().max()) <= 1e-4 * scale, n


def test_attn_resolution():
    assert resolve_attn("auto", "cpu") == "rlhf_varlen"
    assert resolve_attn("varlen", "cpu") == "rlhf_varlen"
    assert resolve_attn("sdpa", "cuda") == "sdpa"
    if not flash_attn_available():
        with pytest.raises(ConfigError, match="flash-attn"):
            resolve_attn("flash_attention_2", "cuda")


def test_warm_start_step_with_a_token_budget_equals_the_whole_batch(tmp_path, monkeypatch):
    """sft_step over packed token-budget micro-batches accumulates the whole padded batch's gradients (one
    DeepSpeed rank on gloo; the optimizer step is held back so both passes start from the same weights)."""
    import socket
    from rlhf_orch.trainer.deepspeed_trainer import DeepSpeedTrainer
    _tiny_llama().save_pretrained(tmp_path / "m")
    batch = _batch([5, 17, 2, 33, 9, 12, 40, 3, 21])
    tokens = float(batch.response_mask.sum())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    # DeepSpeed keeps process-group state, so one trainer serves both passes (as bench/trainer_throughput.py).
    tr = DeepSpeedTrainer(str(tmp_path / "m"), 0, 1, zero_stage=0, max_tokens_per_micro_batch=48, packing=True,
                          attn="varlen")
    try:
        monkeypatch.setattr(tr.engine, "step", lambda *a, **k: None)
        results = []
        for budget in (0, 48):
            tr.budget = budget
            tr.engine.module.zero_grad()
            loss = tr.sft_step(batch, tokens)["warm_start/loss"]
            results.append((loss, [p.grad.detach().clone() for p in tr.engine.module.parameters()]))
    finally:
        torch.distributed.destroy_process_group()
    assert abs(results[0][0] - results[1][0]) < 1e-6
    assert max(float(g.abs().max()) for g in results[0][1]) > 0
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
