"""Rollout engines behind one Protocol, created by `kind` through a lazy registry.

Importing rlhf_orch.engines imports no engine library: `engine_class("vllm")` imports vLLM only when
a vLLM engine is actually built.
"""
from __future__ import annotations

import importlib
import json
import os

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


# Engine-section fields that are not the engine's own arguments (placement, sampling and sleep are the driver's).
_NOT_ENGINE_ARGS = {"name", "count", "placement", "sampling", "kind", "sleep_level", "python_path"}


# Test hooks of the hf engine: a slow engine or a slow sync, or loads over broadcast that the coordinator checks. They
# are not part of the user's config: tests set them in the driver's environment, per engine entry of the config,
#   RLHF_ORCH_TEST_HOOKS='{"engines.1": {"decode_delay_s": 0.02, "sync_delay_s": 1.0, "unchecked_broadcast": true}}'
HOOKS_ENV = "RLHF_ORCH_TEST_HOOKS"
HF_HOOKS = {"decode_delay_s": float, "unchecked_broadcast": bool, "sync_delay_s": float, "start_delay_s": float}


def hooks_from_env(entry: int) -> dict:
    """The test hooks $RLHF_ORCH_TEST_HOOKS gives the config's engine entry `entry` ({} for none)."""
    text = os.environ.get(HOOKS_ENV, "")
    if not text:
        return {}
    try:
        hooks = json.loads(text).get(f"engines.{entry}", {})
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"{HOOKS_ENV}: not a JSON object of engine entries ({e}); e.g. "
                          '\'{"engines.0": {"decode_delay_s": 0.02}}\'') from e
    unknown = sorted(set(hooks) - set(HF_HOOKS))
    if unknown:
        raise ConfigError(f"{HOOKS_ENV}: unknown test hook(s) {unknown} for engines.{entry}; use {sorted(HF_HOOKS)}")
    return {k: HF_HOOKS[k](v) for k, v in hooks.items()}


def engine_options(ecfg, model_path: str, dtype: str, seed: int, hooks: dict | None = None) -> tuple[str, dict]:
    """(registry kind, keyword arguments) of the engine an engine section describes, made where it is built (the
    rollout actor receives the typed section): the section's own fields, and what its kind needs besides.
    `hooks`: test hooks (hooks_from_env), for hf engines only."""
    kwargs = {"model_path": model_path, "dtype": dtype, "seed": seed, **ecfg.model_dump(exclude=_NOT_ENGINE_ARGS)}
    if hooks and ecfg.kind != "hf":
        raise ConfigError(f"{HOOKS_ENV}: test hooks {sorted(hooks)} apply to hf engines only, not {ecfg.kind}")
    if ecfg.kind == "hf":
        kwargs.pop("tensor_parallel_size")
        kwargs.update(hooks or {})
    if ecfg.kind == "sglang":   # SGLang must know at start whether it will release memory
        kwargs.update(enable_memory_saver=ecfg.sleep_level > 0, enable_weights_cpu_backup=ecfg.sleep_level == 1)
    return (f"{ecfg.kind}-streaming" if getattr(ecfg, "streaming", False) else ecfg.kind), kwargs   # vllm-/sglang-streaming


__all__ = ["RolloutEngine", "SamplingParams", "engine_class", "engine_options", "hooks_from_env"]
