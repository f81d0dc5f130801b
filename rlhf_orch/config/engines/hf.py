"""The built-in transformers engine's plug-in (rlhf_orch/engines/hf.py): CPU or one GPU, pauses between decode steps."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_orch.config.engines.base import EngineKind, EngineSection


class HFEngineConfig(EngineSection):
    kind: Literal["hf"] = Field(description="Built-in transformers engine (CPU or one GPU).")
    max_batch_size: int = Field(256, ge=1, description="Sequences per generate call.")


KIND = EngineKind("hf", HFEngineConfig, "rlhf_orch.engines.hf:HFEngine", order=0, parks_mid_request=True,
                  not_engine_args=frozenset({"tensor_parallel_size"}))
