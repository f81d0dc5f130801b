"""Build the built-in reward model `builtin:tiny-rm` offline, as an ordinary Hugging Face model directory.

A Llama-architecture `LlamaForSequenceClassification` with one label (a scalar score head), the policy's
shape (`model.tiny`) and the policy's built-in character tokenizer, randomly initialised. It is written once
under `<output_dir>/models/` (like `builtin:tiny-llama` for the policy), so reward workers load it by path with
`AutoModelForSequenceClassification`, exactly as they load a real reward model.

It is untrained: its scores are small and arbitrary, but deterministic for a given spec and seed. It exists to
run the reward-model path end to end without a model hub; it does not teach the policy anything useful.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from rlhf_orch.models.tiny import BUILTIN_PREFIX, TinyModelSpec, build_tokenizer

logger = logging.getLogger(__name__)

RM_NAME = "tiny-rm"
RM_BUILTIN = BUILTIN_PREFIX + RM_NAME
# The reward model's weights are drawn from seed + this, so it is not the policy's initial backbone.
SEED_OFFSET = 1


def build_reward_model(spec: TinyModelSpec, vocab_size: int, seed: int):
    """A random tiny LlamaForSequenceClassification with num_labels=1 and pad id 0 (the built-in tokenizer's)."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        num_labels=1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    # Forked so that building it leaves the caller's (the driver's) torch RNG exactly as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForSequenceClassification(config)


def ensure_reward_model_dir(spec: TinyModelSpec, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write the built-in reward model under `out_dir` once; return its path.

    Reused when its recorded spec and seed match (a resumed or restarted run keeps its files); the shape is in
    the folder name so runs with different shapes sharing an output_dir do not overwrite each other.
    """
    wanted = {"spec": spec.model_dump(), "seed": seed, "kind": RM_NAME}
    digest = hashlib.sha1(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:8]
    path = Path(out_dir) / f"{RM_NAME}-{digest}-seed{seed}"
    stamp = path / "rlhf_orch_spec.json"
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return path
    tok = build_tokenizer()
    model = build_reward_model(spec, len(tok), seed + SEED_OFFSET)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    stamp.write_text(json.dumps(wanted))
    logger.info("built %s (%d parameters) at %s", RM_NAME, sum(p.numel() for p in model.parameters()), path)
    return path
