"""The keyword arguments of the trainer-side models, made from the run's typed config where they are built.

The policy ranks (`DeepSpeedTrainer`), a critic (`DeepSpeedCritic`: inside the policy ranks or a group of its own)
and a frozen KL reference (`FrozenReference`) are built inside Ray actors. Those actors receive the run's config
(`ExperimentConfig`) across Ray and call these functions on their side, so the driver builds no keyword dicts and
no default is repeated on the receiving side (issue #28). Nothing here validates: config/checks.py did that before
Ray started. No Ray here.
"""
from __future__ import annotations

# The policy's forward settings the reference must share to give the same numbers (FrozenReference's arguments).
FORWARD_KEYS = ("temperature", "micro_batch_size", "max_tokens_per_micro_batch", "packing", "attn",
                "logprob_chunk_tokens")


def policy_options(cfg) -> dict:
    """DeepSpeedTrainer's keyword arguments (the critic's, if it lives in these ranks, are `critic_options`)."""
    t = cfg.trainer
    return dict(zero_stage=t.zero_stage, lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, bf16=t.bf16,
                algorithm=cfg.algorithm.model_dump(), temperature=cfg.engines[0].sampling.temperature,
                ppo_epochs=t.ppo_epochs, seed=cfg.experiment.seed, micro_batch_size=t.micro_batch_size,
                gradient_checkpointing=t.gradient_checkpointing, max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
                packing=t.packing, attn=t.attn, logprob_chunk_tokens=t.logprob_chunk_tokens, peak_tflops=t.peak_tflops)


def critic_options(cfg, colocated: bool) -> dict | None:
    """The critic's settings: for the policy ranks (`colocated`: None unless the critic lives in them, and then with
    its model path and warm-up steps) or for a critic group of its own (None unless it has one)."""
    c, t = cfg.critic, cfg.trainer
    if colocated != (c.placement == "colocated"):
        return None
    kw = dict(lr=c.lr, weight_decay=c.weight_decay, zero_stage=t.zero_stage if c.zero_stage is None else c.zero_stage,
              grad_clip=t.grad_clip, bf16=t.bf16, seed=cfg.experiment.seed, cliprange_value=c.cliprange_value,
              vf_coef=c.vf_coef, gradient_checkpointing=t.gradient_checkpointing,
              micro_batch_size=t.micro_batch_size if c.micro_batch_size is None else c.micro_batch_size,
              max_tokens_per_micro_batch=t.max_tokens_per_micro_batch, packing=t.packing, attn=t.attn)
    return {**kw, "model_path": c.model_path, "warmup_steps": c.warmup_steps} if colocated else kw


def reference_options(cfg, state_path: str) -> dict:
    """A reference rank's FrozenReference arguments: the policy's snapshot and its forward settings."""
    policy = policy_options(cfg)
    return {"state_path": state_path, **{k: policy[k] for k in FORWARD_KEYS}}
