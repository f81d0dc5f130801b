"""Built-in tiny models: a Llama-architecture causal LM and a character tokenizer, made in code."""
from rlhf_orch.models.tiny import BUILTIN_PREFIX, TinyModelSpec, build_tokenizer, ensure_model_dir

__all__ = ["BUILTIN_PREFIX", "TinyModelSpec", "build_tokenizer", "ensure_model_dir"]
