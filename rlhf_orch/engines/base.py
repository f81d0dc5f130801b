"""The rollout-engine Protocol every engine kind implements, and the shared request/response types.

An engine generates batches of responses with per-token logprobs, and takes new weights through a
`WeightReceiver` (one per worker) that calls the engine's `load_weights` and `checksums`. Engines
track the weight version they hold and stamp it on every sample, so the driver can refuse stale
rollouts. `pause()`/`resume()` bracket a sync: a paused engine refuses to generate.

This module defines the contract only; it imports no engine library.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from rlhf_orch.types import Sample


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    n: int = 1        # samples per prompt
    ignore_eos: bool = False   # generate max_new_tokens whatever is sampled (benchmarks)


@runtime_checkable
class RolloutEngine(Protocol):
    name: str
    weight_version: int

    def device_ids(self) -> list[str]:
        """One id per worker: GPU UUID on CUDA, placement slot on CPU (see weight_sync/plan.py)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Sample]:
        """`params.n` samples per prompt, grouped by prompt (prompt_index = position in `prompts`)."""

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy (hf_name, tensor) pairs into the model; tensors are views into a transport buffer."""

    def checksums(self, names: list[str]) -> list[int]:
        """Checksums (weight_sync.buckets.checksums) of the engine's own copy of `names`."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def finish_sync(self, version: int) -> None:
        """New weights are loaded and verified: drop caches, record `version`."""
