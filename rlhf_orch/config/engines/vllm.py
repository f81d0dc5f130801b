"""vLLM's plug-in (rlhf_orch/engines/vllm.py; `streaming: true`: vllm_async.py). Its options are validated here without
importing vLLM."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_orch.config.engines.base import EngineKind, EngineSection


class VLLMEngineConfig(EngineSection):
    kind: Literal["vllm"] = Field(description="vLLM engine (needs the 'vllm' extra and CUDA).")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="Fraction of each GPU vLLM may use.")
    enable_sleep_mode: bool = Field(True, description="Release KV cache and weights while the trainer trains (colocated).")
    enforce_eager: bool = Field(False, description="Skip CUDA graphs (faster start, slower decode).")
    kv_cache_memory_gb: float | None = Field(None, gt=0, description="Fixed KV-cache size per GPU in GiB (overrides "
                                             "gpu_memory_utilization for the cache; keeps prefix-cache resets cheap on small models).")
    max_model_len: int | None = Field(None, ge=1, description="Longest prompt + response vLLM schedules (default: the model's).")
    load_format: str = Field("auto", description="How vLLM reads the weights at start; dummy: random (benchmarks).")
    max_num_seqs: int | None = Field(None, ge=1, description="Most sequences vLLM decodes at once (default: vLLM's "
                                     "offline default for the GPU, 1024 on 70 GB+ cards other than A100, else 256).")
    streaming: bool = Field(False, description="Run vLLM's AsyncLLM: many generate calls in flight at once, and pauses "
                            "that keep or abort running requests (needed for rollout.partial_rollouts).")


def _checks(i: int, e: VLLMEngineConfig, cfg) -> list[str]:
    p = []
    if e.streaming and e.sleep_level:
        p.append(f"engines.{i}.streaming: a streaming vLLM engine does not sleep here yet; set sleep_level: 0 or streaming: false")
    if e.sleep_level and not e.enable_sleep_mode:
        p.append(f"engines.{i}.sleep_level: vLLM sleeps only with enable_sleep_mode: true; set it or sleep_level: 0")
    return p


KIND = EngineKind("vllm", VLLMEngineConfig, "rlhf_orch.engines.vllm:VLLMEngine", order=1,
                  streaming_engine="rlhf_orch.engines.vllm_async:StreamingVLLMEngine", extra="vllm", needs_cuda=True,
                  tensor_parallel=True, checks=_checks)
