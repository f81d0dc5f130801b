"""Build the built-in reward model `builtin:tiny-rm` offline, as an ordinary Hugging Face model directory.

A Llama-architecture `LlamaForSequenceClassification` with one label (a scalar score head), the policy's
shape (`model.tiny`) and the policy's built-in character tokenizer, randomly initialised. It is written once
under `<output_dir>/models/` (like `builtin:tiny-llama` for the policy), so reward workers load it by path with
`AutoModelForSequenceClassification`, exactly as they load a real reward model.

It is untrained: its scores are small and arbitrary, but deterministic for a given spec and seed. It exists to
run the reward-model path end to end without a model hub; it does not teach the policy anything useful.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from rlhf_orch.models.tiny import BUILTIN_PREFIX, TinyModelSpec, llama_config, write_model_dir

logger = logging.getLogger(__name__)

RM_NAME = "tiny-rm"
RM_BUILTIN = BUILTIN_PREFIX + RM_NAME
# The reward model's weights are drawn from seed + this, so it is not the policy's initial backbone.
SEED_OFFSET = 1


def build_reward_model(spec: TinyModelSpec, vocab_size: int, seed: int):
    """A random tiny LlamaForSequenceClassification with num_labels=1 and pad id 0 (the built-in tokenizer's)."""
    import torch
    from transformers import LlamaForSequenceClassification

    config = llama_config(spec, vocab_size, num_labels=1)
    # Forked so that building it leaves the caller's (the driver's) torch RNG exactly as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForSequenceClassification(config)


def ensure_reward_model_dir(spec: TinyModelSpec, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write the built-in reward model under `out_dir` once; return its path.

    Reused when its recorded spec and seed match (a resumed or restarted run keeps its files); the shape is in
    the folder name so runs with different shapes sharing an output_dir do not overwrite each other.
    """
    return write_model_dir(RM_NAME, {"spec": spec.model_dump(), "seed": seed, "kind": RM_NAME}, out_dir,
                           lambda vocab: build_reward_model(spec, vocab, seed + SEED_OFFSET))
