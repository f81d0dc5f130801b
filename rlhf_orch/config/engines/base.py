"""What every engine kind's plug-in declares (`EngineKind`), and the config fields every engine entry shares.

An engine kind's plug-in (a module of this package, e.g. hf.py) declares its config class (the `engines` entry with
`kind: <name>`), what the checks before Ray must know of it (CUDA, tensor parallelism, pauses between decode steps),
its own cross-field checks, where its engine classes are, and the extra that installs its library. Pure: imports no
engine library and no torch, so `rlhf-orch check` stays fast.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

from pydantic import Field

from rlhf_orch.config.base import _Section


class SamplingSection(_Section):
    temperature: float = Field(1.0, gt=0, description="Softmax temperature (the trainer uses the same one).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(5, ge=1, description="Longest response in tokens.")


class EngineSection(_Section):
    """The fields of every `engines` entry; each kind's config class adds `kind` and its own options."""
    name: str | None = Field(None, description="Label on the dashboard and in metrics (default: <kind><index>).")
    count: int = Field(1, ge=1, description="Identical engines of this entry.")
    placement: Literal["colocated", "dedicated"] = Field("dedicated", description="colocated: share trainer ranks' devices; dedicated: own devices.")
    tensor_parallel_size: int = Field(1, ge=1, description="Devices per engine (dedicated engines).")
    sampling: SamplingSection = Field(default_factory=SamplingSection, description="Sampling parameters.")
    sleep_level: Literal[0, 1, 2] = Field(0, description="Colocated engines: free GPU memory while the trainer trains "
                                          "(1: weights kept in CPU memory, 2: weights dropped, the sync refills them; 0: stay resident).")


# Fields of every entry that are the driver's, not the engine's arguments (placement, sampling, sleep level).
DRIVER_FIELDS = frozenset({"name", "count", "placement", "sampling", "kind", "sleep_level"})


def _no_checks(i: int, entry, cfg) -> list[str]:
    return []


def _no_kwargs(entry) -> dict:
    return {}


@dataclass(frozen=True)
class EngineKind:
    name: str                         # the `kind` value
    config: type[EngineSection]       # its `engines` entry
    engine: str                       # "module:Class" of its engine, imported only when one is built
    order: int = 100                  # where it appears in lists and messages (built-ins first)
    streaming_engine: str | None = None   # the class of `streaming: true` entries (an event loop of its own)
    extra: str | None = None          # the pyproject extra that installs its library
    needs_cuda: bool = False
    tensor_parallel: bool = False     # tensor_parallel_size > 1 possible
    parks_mid_request: bool = False   # its plain engine pauses between decode steps (else only its streaming one)
    not_engine_args: frozenset = frozenset()   # its own fields that are the driver's (SGLang's python_path)
    driver_env: dict = field(default_factory=dict)   # set in the driver before any actor starts, if absent
    checks: Callable[[int, object, object], list[str]] = _no_checks   # (index, entry, run config) -> problems
    engine_kwargs: Callable[[object], dict] = _no_kwargs   # what its engine needs besides the entry's own fields

    def streams(self, entry) -> bool:
        """Whether this entry builds the kind's streaming engine (`streaming: true` where the kind has one)."""
        return self.streaming_engine is not None and bool(getattr(entry, "streaming", False))

    def can_stop_mid_request(self, entry) -> bool:
        """Whether this entry's engine pauses between two decode steps (keep/abort pauses, partial rollouts)."""
        return self.parks_mid_request or self.streams(entry)

    def engine_key(self, entry) -> str:
        """The registry key of the engine this entry builds: `<kind>` or `<kind>-streaming`."""
        return f"{self.name}-streaming" if self.streams(entry) else self.name
