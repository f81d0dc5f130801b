"""PPO's trainer side on a GPU: one DeepSpeed rank holding the policy, its frozen reference and a critic (bf16,
ZeRO-2) runs token-level steps with KL in the reward and an adaptive controller; the critic's value loss falls on
a fixed batch and every metric is finite. The critic runs packed token-budget micro-batches as the policy does,
and a FrozenReference (reference.placement: separate) loaded from the rank's snapshot on the same GPU gives the
logprobs of the rank's own reference.

    python -m pytest -q -m gpu -s tests/gpu/test_ppo_gpu.py
"""
import math
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

pytestmark = pytest.mark.gpu


def test_ppo_rank_with_critic_reference_and_kl_controller(tmp_path):
    from tests.unit.test_packing import _batch
    from rlhf_orch.trainer.critic import DeepSpeedCritic
    from rlhf_orch.trainer.deepspeed_trainer import DeepSpeedTrainer
    from rlhf_orch.trainer.token_step import token_level_step
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0")
    algo = {"name": "ppo", "gamma": 1.0, "lam": 0.95, "use_kl_in_reward": True,
            "kl_ctrl": {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.01, "horizon": 100}}
    tr = DeepSpeedTrainer(str(tmp_path / "m"), 0, 1, device="cuda", zero_stage=2, lr=1e-5, bf16=True, algorithm=algo,
                          max_tokens_per_micro_batch=2048, packing=True)
    tr.snapshot_reference(str(tmp_path / "reference.pt"))
    critic = DeepSpeedCritic(str(tmp_path / "m"), 0, 1, device=tr.device, zero_stage=2, lr=1e-3, bf16=True,
                             max_tokens_per_micro_batch=2048, packing=True)
    lengths = [5, 17, 2, 333, 9, 120, 64, 40, 700, 31]
    from rlhf_orch.trainer.reference import FrozenReference
    apart = FrozenReference(str(tmp_path / "m"), str(tmp_path / "reference.pt"), device="cuda",
                            max_tokens_per_micro_batch=2048, packing=True)
    probe = _batch(lengths, prompt=8, vocab=1000)
    diff = (apart.logprobs(probe) - tr.reference_logprobs(probe)).abs().max()
    print(f"separate reference vs the rank's own: max |diff| {float(diff):.2e}")
    assert float(diff) <= 1e-5
    out = []
    for _ in range(4):
        batch = _batch(lengths, prompt=8, vocab=1000)
        batch.rewards = torch.linspace(-1, 1, len(lengths))
        out.append(token_level_step(tr, critic, 0, batch, float(batch.response_mask.sum())))
        print({k: round(v, 4) for k, v in out[-1].items() if k.startswith(("critic/", "kl_ctrl/", "ppo/"))})
    assert all(math.isfinite(v) for m in out for v in m.values())
    assert out[-1]["critic/vf_loss"] < out[0]["critic/vf_loss"]
    assert out[1]["kl_ctrl/beta"] < out[0]["kl_ctrl/beta"]            # step 1's KL is 0 < target: beta falls
    torch.distributed.destroy_process_group()
