"""Rollout engines behind one Protocol, created by `kind` through a lazy registry.

Importing rlhf_orch.engines imports no engine library: `engine_class("vllm")` imports vLLM only when
a vLLM engine is actually built.
"""
from __future__ import annotations

import importlib

from rlhf_orch.engines.base import RolloutEngine, SamplingParams
from rlhf_orch.errors import ConfigError

_REGISTRY = {
    "hf": "rlhf_orch.engines.hf:HFEngine",
    "vllm": "rlhf_orch.engines.vllm:VLLMEngine",
    "sglang": "rlhf_orch.engines.sglang:SGLangEngine",
    "vllm-streaming": "rlhf_orch.engines.vllm_async:StreamingVLLMEngine",   # kind vllm with streaming: true
    "sglang-streaming": "rlhf_orch.engines.sglang_async:StreamingSGLangEngine",   # kind sglang with streaming: true
}
_PUBLIC = ("hf", "vllm", "sglang")


def engine_class(kind: str):
    target = _REGISTRY.get(kind)
    if target is None:
        raise ConfigError(f"engines.kind: unknown engine kind {kind!r}; use one of: {', '.join(_PUBLIC)}")
    mod, _, cls = target.partition(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except ImportError as e:
        raise ConfigError(f"engines.kind: {kind} needs its extra installed (pip install 'rlhf_orch[{kind}]'): {e}") from e


__all__ = ["RolloutEngine", "SamplingParams", "engine_class"]
