"""The hf engine's test hooks for a whole run: $RLHF_ORCH_TEST_HOOKS (rlhf_orch.engines.hooks_from_env), which the
driver reads when it starts each engine. They are not config keys: a user's config cannot set them."""
import json

from rlhf_orch.engines import HOOKS_ENV


def engine_hooks(*per_entry: dict) -> dict[str, str]:
    """{HOOKS_ENV: json} with one dict of hooks per engine entry of the config (engines.0, engines.1, ...; {} for
    none), to put in a run's environment (monkeypatch.setenv(*...items()), a subprocess env, a job's env_vars)."""
    return {HOOKS_ENV: json.dumps({f"engines.{i}": h for i, h in enumerate(per_entry) if h})}


def set_engine_hooks(monkeypatch, *per_entry: dict) -> None:
    """The hooks for every run this test starts in its own process."""
    for k, v in engine_hooks(*per_entry).items():
        monkeypatch.setenv(k, v)
