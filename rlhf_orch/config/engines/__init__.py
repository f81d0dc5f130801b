"""Engine kinds as plug-ins: every module of this package (but base.py) declares one kind of rollout engine in a `KIND`
(base.EngineKind: its config class, its checks, where its engine classes are, its extra), and this registry builds
from them what the rest of the code reads: the `engines` entry union (`EngineConfig`, chosen by `kind`), the kinds'
names (`ENGINE_KINDS`) and `kind_of(entry)`. A new engine kind is its engine module under rlhf_orch/engines/, one
module here, and an extra in pyproject.toml; nothing else names it.
Pure: imports no engine library and no torch.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Annotated, Union

from pydantic import Field

from rlhf_orch.config.engines.base import DRIVER_FIELDS, EngineKind, EngineSection, SamplingSection


def discover(package: str, path) -> dict[str, EngineKind]:
    """{kind name: its plug-in} of every module of `package` (at `path`) but base, in their declared order."""
    kinds = []
    for info in pkgutil.iter_modules(path):
        if info.name != "base":
            kind = getattr(importlib.import_module(f"{package}.{info.name}"), "KIND", None)
            if not isinstance(kind, EngineKind):
                raise TypeError(f"{package}.{info.name} declares no KIND = EngineKind(...)")
            kinds.append(kind)
    return {k.name: k for k in sorted(kinds, key=lambda k: (k.order, k.name))}


def config_union(kinds: dict[str, EngineKind]):
    """The `engines` entry type: one of the kinds' config classes, chosen by its `kind`."""
    return Annotated[Union[tuple(k.config for k in kinds.values())], Field(discriminator="kind")]


KINDS: dict[str, EngineKind] = discover(__name__, __path__)
ENGINE_KINDS: tuple[str, ...] = tuple(KINDS)
EngineConfig = config_union(KINDS)


def kind_of(entry) -> EngineKind:
    """The plug-in of an `engines` entry (its `kind`)."""
    return KINDS[entry.kind]


def kind_problems(i: int, entry, cfg) -> list[str]:
    """What entry `engines.i` asks of its kind that the kind cannot do, then the kind's own checks (its `checks`)."""
    kind, p = kind_of(entry), []
    if not kind.tensor_parallel and entry.tensor_parallel_size > 1:
        p.append(f"engines.{i}.tensor_parallel_size: the {kind.name} engine has no tensor parallelism; set it to 1 or use "
                 f"kind: {next(k.name for k in KINDS.values() if k.tensor_parallel)}")
    if kind.needs_cuda and cfg.trainer.device != "cuda":
        p.append(f"engines.{i}.kind: {kind.name} needs GPUs; set trainer.device: cuda or use kind: "
                 f"{next(k.name for k in KINDS.values() if not k.needs_cuda)}")
    return p + kind.checks(i, entry, cfg)


__all__ = ["DRIVER_FIELDS", "ENGINE_KINDS", "EngineConfig", "EngineKind", "EngineSection", "KINDS", "SamplingSection",
           "kind_of", "kind_problems"]
