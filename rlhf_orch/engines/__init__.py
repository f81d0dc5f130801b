"""Rollout engines behind one Protocol, created by `kind` through a lazy registry.

The registry is the engine kinds' plug-ins (rlhf_orch/config/engines/: each names its engine classes, its extra and
what its engine needs besides its entry's fields). Importing rlhf_orch.engines imports no engine library:
`engine_class("vllm")` imports vLLM only when a vLLM engine is actually built.
"""
from __future__ import annotations

import importlib
import json
import os

from rlhf_orch.config.engines import DRIVER_FIELDS, ENGINE_KINDS, KINDS, kind_of
from rlhf_orch.engines.base import RolloutEngine, SamplingParams
from rlhf_orch.errors import ConfigError

# registry key -> (its kind, "module:Class"); `<kind>-streaming` for entries with streaming: true
_REGISTRY = {key: (k, target) for k in KINDS.values()
             for key, target in ((k.name, k.engine), (f"{k.name}-streaming", k.streaming_engine)) if target}


def engine_class(key: str):
    """The engine class of registry key `key` (`engine_options` gives it), imported now."""
    if key not in _REGISTRY:
        raise ConfigError(f"engines.kind: unknown engine kind {key!r}; use one of: {', '.join(ENGINE_KINDS)}")
    kind, target = _REGISTRY[key]
    mod, _, cls = target.partition(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except ImportError as e:
        raise ConfigError(f"engines.kind: {kind.name} needs its extra installed (pip install "
                          f"'rlhf_orch[{kind.extra or kind.name}]'): {e}") from e


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
    kind = kind_of(ecfg)
    kwargs = {"model_path": model_path, "dtype": dtype, "seed": seed,
              **ecfg.model_dump(exclude=DRIVER_FIELDS | kind.not_engine_args), **kind.engine_kwargs(ecfg)}
    if hooks and ecfg.kind != "hf":
        raise ConfigError(f"{HOOKS_ENV}: test hooks {sorted(hooks)} apply to hf engines only, not {ecfg.kind}")
    kwargs.update(hooks or {})
    return kind.engine_key(ecfg), kwargs


__all__ = ["RolloutEngine", "SamplingParams", "engine_class", "engine_options", "hooks_from_env"]
