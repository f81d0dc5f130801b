"""The critic (rlhf_orch/trainer/critic.py) on one real DeepSpeed rank (gloo). Padding-free (#12 item 2, "every
later role"): a value model's packed forward gives the padded forward's values, and a critic step over token-budget
micro-batches (packed or not) accumulates the gradients of the whole padded shard, so the value loss is unchanged by
the trainer's token budget. The value loss coefficient (critic.vf_coef) scales the critic's gradients."""
import socket

import pytest
import torch

from rlhf_orch.trainer.packing import micro_batch_plan, packed_values, resolve_attn, seq_lengths
from test_packing import _batch, _tiny_llama

LENGTHS = [5, 17, 2, 33, 9, 12, 40, 3, 21]


@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
def test_packed_values_equal_padded(tmp_path, attn):
    from rlhf_orch.trainer.critic import ValueModel
    _tiny_llama().save_pretrained(tmp_path / "m")
    impl = resolve_attn(attn, "cpu")
    model = ValueModel(str(tmp_path / "m"), seed=0, attn=impl).eval()
    batch = _batch(LENGTHS)
    mask = batch.attention_mask.clone()
    mask[:, 0] = 0                               # position 0 has no value (nothing is read before it)
    with torch.no_grad():
        padded = model(batch.input_ids, batch.attention_mask) * mask
        packed = packed_values(model, batch, impl, torch.device("cpu"))
    assert packed.shape == padded.shape and float(padded.abs().max()) > 0
    assert torch.allclose(packed, padded, atol=1e-5, rtol=0), (packed - padded).abs().max()
    assert torch.equal(packed * (1 - mask), torch.zeros_like(packed))   # 0 at position 0 and on padding
    assert len(micro_batch_plan(seq_lengths(batch), 48, True)) > 2     # the budget below really splits the shard


def _critic_passes(model_dir: str, result: str) -> None:
    """In a fresh process (DeepSpeed keeps process-group state that a later trainer in the same process trips on):
    one critic rank, four passes over one shard, the optimizer step held back so each starts from the same weights."""
    import os
    import deepspeed
    import torch.distributed as dist
    from rlhf_orch.trainer.critic import DeepSpeedCritic
    batch = _batch(LENGTHS)
    tokens = float(batch.response_mask.sum())
    g = torch.Generator().manual_seed(1)
    returns = torch.randn(batch.input_ids.shape, generator=g) * batch.response_mask
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")   # adopts that group, as the policy trainer's rank does
    try:
        critic = DeepSpeedCritic(model_dir, 0, 1, device=torch.device("cpu"), zero_stage=0, lr=1e-3,
                                 max_tokens_per_micro_batch=48, packing=True, attn="varlen")
        critic.engine.step = lambda *a, **k: None
        forward, calls = critic._values, []
        critic._values = lambda mb: calls.append(len(mb)) or forward(mb)
        results = []
        for budget, packing, coef in ((0, False, 1.0), (48, False, 1.0), (48, True, 1.0), (0, False, 2.5)):
            critic.budget, critic.packing, critic.vf_coef = budget, packing, coef
            old = critic.values(batch)
            critic.engine.module.zero_grad()
            calls.clear()
            m = critic.train_step(batch, returns, old - 0.05, tokens)   # old values off: the clip term is live
            results.append({"values": old, "m": m, "calls": list(calls),
                            "grads": [p.grad.detach().clone() for p in critic.engine.module.parameters()]})
        torch.save({"results": results, "mask": batch.response_mask, "n": len(batch)}, result)
    finally:
        dist.destroy_process_group()


def test_critic_token_budget_gradients_equal_the_whole_shard(tmp_path):
    import multiprocessing
    _tiny_llama().save_pretrained(tmp_path / "m")
    proc = multiprocessing.get_context("spawn").Process(target=_critic_passes,
                                                        args=(str(tmp_path / "m"), str(tmp_path / "r.pt")))
    proc.start()
    proc.join(600)
    assert proc.exitcode == 0, f"the critic process exited with {proc.exitcode} (its traceback is in the captured stderr)"
    out = torch.load(tmp_path / "r.pt")
    mask, (r0, r1, r2, r3) = out["mask"], out["results"]
    assert len(r0["calls"]) == 1 and len(r1["calls"]) > 2 and len(r2["calls"]) > 2, [r["calls"] for r in out["results"]]
    assert all(sum(r["calls"]) == out["n"] for r in out["results"])   # every row once: micro-batches of the budget
    v0, m0, g0 = r0["values"], r0["m"], r0["grads"]
    assert max(float(x.abs().max()) for x in g0) > 0
    assert torch.allclose(r1["values"] * mask, v0 * mask, atol=1e-6, rtol=0)
    assert torch.allclose(r2["values"] * mask, v0 * mask, atol=1e-5, rtol=0)
    assert abs(r1["m"]["critic/vf_loss"] - m0["critic/vf_loss"]) < 1e-6
    assert abs(r2["m"]["critic/vf_loss"] - m0["critic/vf_loss"]) < 1e-5
    for a, b, c, d in zip(g0, r1["grads"], r2["grads"], r3["grads"]):
        assert torch.allclose(b, a, atol=1e-6, rtol=0)
        assert torch.allclose(c, a, atol=1e-5, rtol=0)
        assert torch.allclose(d, 2.5 * a, atol=1e-7, rtol=1e-6)   # vf_coef 2.5: the same step, scaled
    assert r3["m"]["critic/vf_loss"] == m0["critic/vf_loss"]        # reported before the coefficient
