"""Build a tiny causal LM and its tokenizer offline, as an ordinary Hugging Face model directory.

Nothing here downloads: the tokenizer is a character-level `tokenizers` model and the network is a
randomly initialised Llama-architecture `transformers` model. The result is written once to a directory
(`config.json`, `model.safetensors`, `tokenizer.json`, ...) so the trainer and every engine load the
same files by path, exactly as they would load a real checkpoint: the built-in default exercises the
same loading code as production models.

It does not train the model (the trainer's optional supervised warm start does that).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Digits, operators and lowercase letters cover the synthetic tasks; order fixes the token ids.
CHARS = list("0123456789+-*=() abcdefghijklmnopqrstuvwxyz?:.,")


class TinyModelSpec(BaseModel):
    """Shape of the built-in model (Llama architecture). Defaults train fast on 2 CPU cores."""

    model_config = ConfigDict(extra="forbid")
    hidden_size: int = Field(64, ge=8, description="Width of the residual stream.")
    intermediate_size: int = Field(256, ge=8, description="MLP width.")
    num_hidden_layers: int = Field(2, ge=1, description="Transformer blocks.")
    num_attention_heads: int = Field(4, ge=1, description="Query heads; must divide hidden_size.")
    num_key_value_heads: int = Field(2, ge=1, description="KV heads (GQA); must divide the query heads.")
    max_position_embeddings: int = Field(64, ge=8, description="Longest prompt + response in tokens.")
    tie_word_embeddings: bool = Field(False, description="Share the input embedding with the LM head.")


def build_tokenizer():
    """A character-level fast tokenizer with <pad>=0, <bos>=1, <eos>=2, <unk>=3."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def llama_config(spec: TinyModelSpec, vocab_size: int, **extra):
    """The Llama config of `spec` with the built-in tokenizer's special ids (`extra`: e.g. num_labels)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **extra,
    )


def _build_model(spec: TinyModelSpec, vocab_size: int, seed: int):
    import torch
    from transformers import LlamaForCausalLM

    config = llama_config(spec, vocab_size)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def write_model_dir(name: str, wanted: dict, out_dir: str | os.PathLike, build) -> Path:
    """Write `build(vocab_size)` and the built-in tokenizer to `<out_dir>/<name>-<digest>-seed<seed>` once;
    return the path. The folder is reused when its recorded `wanted` (spec, seed, ...) matches, so a resumed
    run keeps its files; the digest of `wanted` is in the name, so runs with other shapes do not collide."""
    digest = hashlib.sha1(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:8]
    path = Path(out_dir) / f"{name}-{digest}-seed{wanted['seed']}"
    stamp = path / "rlhf_orch_spec.json"
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return path
    tok = build_tokenizer()
    model = build(len(tok))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    stamp.write_text(json.dumps(wanted))
    logger.info("built %s (%d parameters) at %s", name, sum(p.numel() for p in model.parameters()), path)
    return path


def ensure_model_dir(name: str, spec: TinyModelSpec, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write the built-in model `name` (e.g. "tiny-llama") under `out_dir` once; return its path.

    The directory is reused when its recorded spec and seed match, so a resumed run keeps its files.
    """
    if name != "tiny-llama":
        raise ValueError(f"unknown built-in model {name!r}; the only built-in is 'tiny-llama'")
    # The shape is in the folder name: two runs sharing an output_dir with different shapes (side by side,
    # even at the same time) must not overwrite each other's model.
    return write_model_dir(name, {"spec": spec.model_dump(), "seed": seed}, out_dir,
                           lambda vocab: _build_model(spec, vocab, seed))
