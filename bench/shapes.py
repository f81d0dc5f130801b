"""Parameter specs (HF names, shapes) of real model families, for benchmarks with random weights.

Weight sync depends on bytes and tensor counts, not values, so these lists stand in for checkpoints:
Llama-3.2-1B (146 tensors, 2.47 GB bf16), Llama-3.1-8B (291 tensors, 16.06 GB) and Qwen3-30B-A3B
with per-expert tensors as in its HF checkpoint (18,867 tensors, ~61 GB). `tiny` is for smoke runs.
`SHAPES` (Llama config arguments) and `model_dir` give engines (vLLM, SGLang) a config folder of the same
shape to start from with `load_format="dummy"`: the folder holds no weights.
"""
from __future__ import annotations

from pathlib import Path

from rlhf_orch.types import ParamSpec


def _attention(p, hidden, heads, kv_heads, hd, dtype) -> list[ParamSpec]:
    return [ParamSpec(p + "self_attn.q_proj.weight", dtype, (heads * hd, hidden)),
            ParamSpec(p + "self_attn.k_proj.weight", dtype, (kv_heads * hd, hidden)),
            ParamSpec(p + "self_attn.v_proj.weight", dtype, (kv_heads * hd, hidden)),
            ParamSpec(p + "self_attn.o_proj.weight", dtype, (hidden, heads * hd))]


def llama(vocab, hidden, inter, layers, heads, kv_heads, tied, dtype="bfloat16", head_dim=None) -> list[ParamSpec]:
    hd = head_dim or hidden // heads
    out = [ParamSpec("model.embed_tokens.weight", dtype, (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += _attention(p, hidden, heads, kv_heads, hd, dtype)
        out += [ParamSpec(p + "mlp.gate_proj.weight", dtype, (inter, hidden)),
                ParamSpec(p + "mlp.up_proj.weight", dtype, (inter, hidden)),
                ParamSpec(p + "mlp.down_proj.weight", dtype, (hidden, inter)),
                ParamSpec(p + "input_layernorm.weight", dtype, (hidden,)),
                ParamSpec(p + "post_attention_layernorm.weight", dtype, (hidden,))]
    out.append(ParamSpec("model.norm.weight", dtype, (hidden,)))
    if not tied:
        out.append(ParamSpec("lm_head.weight", dtype, (vocab, hidden)))
    return out


def qwen3_moe(vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128,
              moe_inter=768, dtype="bfloat16") -> list[ParamSpec]:
    out = [ParamSpec("model.embed_tokens.weight", dtype, (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += _attention(p, hidden, heads, kv_heads, head_dim, dtype)
        out += [ParamSpec(p + "self_attn.q_norm.weight", dtype, (head_dim,)),
                ParamSpec(p + "self_attn.k_norm.weight", dtype, (head_dim,)),
                ParamSpec(p + "mlp.gate.weight", dtype, (experts, hidden))]
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            out += [ParamSpec(q + "gate_proj.weight", dtype, (moe_inter, hidden)),
                    ParamSpec(q + "up_proj.weight", dtype, (moe_inter, hidden)),
                    ParamSpec(q + "down_proj.weight", dtype, (hidden, moe_inter))]
        out += [ParamSpec(p + "input_layernorm.weight", dtype, (hidden,)),
                ParamSpec(p + "post_attention_layernorm.weight", dtype, (hidden,))]
    out += [ParamSpec("model.norm.weight", dtype, (hidden,)), ParamSpec("lm_head.weight", dtype, (vocab, hidden))]
    return out


MODELS = {
    "tiny": lambda: llama(512, 256, 512, 2, 4, 2, tied=False),
    "llama-3.2-1b": lambda: llama(128256, 2048, 8192, 16, 32, 8, tied=True),
    "llama-3.1-8b": lambda: llama(128256, 4096, 14336, 32, 32, 8, tied=False),
    "qwen3-30b-a3b": qwen3_moe,
}

# transformers config arguments of the same shapes (bench/rollout.py and bench/async_rl.py use the Llama ones)
SHAPES = {"llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
          "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
          "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)}
QWEN3_MOE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                 num_experts_per_tok=8, tie_word_embeddings=False)


def hf_config(model: str):
    """The transformers config whose checkpoint tensors are MODELS[model]() (names and shapes; transformers 5 fuses
    the MoE experts in memory, but engines load per-expert checkpoint names, as MODELS lists them)."""
    from transformers import LlamaConfig, Qwen3MoeConfig
    if model == "qwen3-30b-a3b":
        return Qwen3MoeConfig(**QWEN3_MOE, max_position_embeddings=2048, torch_dtype="bfloat16",
                              architectures=["Qwen3MoeForCausalLM"])
    return LlamaConfig(**SHAPES[model], max_position_embeddings=2048, torch_dtype="bfloat16",
                       architectures=["LlamaForCausalLM"])


def model_dir(model: str, root: Path) -> str:
    """A model folder (config + our character tokenizer, no weights) for an engine started with load_format="dummy"."""
    from rlhf_orch.models import build_tokenizer
    path = Path(root) / model
    hf_config(model).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)
