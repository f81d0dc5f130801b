"""The `engines` entries of the experiment config: one class per engine kind, chosen by `kind` (a discriminated
union, `EngineConfig`), and the sampling section they share. Options of vLLM and SGLang are validated here without
importing either package. Re-exported by schema.py; cross-field rules about engines live in checks.py.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from rlhf_orch.config.base import _Section


class SamplingSection(_Section):
    temperature: float = Field(1.0, gt=0, description="Softmax temperature (the trainer uses the same one).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(5, ge=1, description="Longest response in tokens.")


class _EngineBase(_Section):
    name: str | None = Field(None, description="Label on the dashboard and in metrics (default: <kind><index>).")
    count: int = Field(1, ge=1, description="Identical engines of this entry.")
    placement: Literal["colocated", "dedicated"] = Field("dedicated", description="colocated: share trainer ranks' devices; dedicated: own devices.")
    tensor_parallel_size: int = Field(1, ge=1, description="Devices per engine (dedicated engines).")
    sampling: SamplingSection = Field(default_factory=SamplingSection, description="Sampling parameters.")
    sleep_level: Literal[0, 1, 2] = Field(0, description="Colocated engines: free GPU memory while the trainer trains "
                                          "(1: weights kept in CPU memory, 2: weights dropped, the sync refills them; 0: stay resident).")


class HFEngineConfig(_EngineBase):
    kind: Literal["hf"] = Field(description="Built-in transformers engine (CPU or one GPU).")
    max_batch_size: int = Field(256, ge=1, description="Sequences per generate call.")


class VLLMEngineConfig(_EngineBase):
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


class SGLangEngineConfig(_EngineBase):
    kind: Literal["sglang"] = Field(description="SGLang engine (needs the 'sglang' extra and CUDA).")
    mem_fraction_static: float = Field(0.5, gt=0, le=1, description="Fraction of each GPU SGLang may use.")
    python_path: str | None = Field(None, description="Folder(s) put first on the SGLang actor's PYTHONPATH: SGLang's own "
                                    "environment (its exact pins clash with vLLM's), e.g. /tmp/site-sglang.")
    disable_cuda_graph: bool = Field(False, description="Skip CUDA graphs (faster start, slower decode).")
    context_length: int | None = Field(None, ge=1, description="Longest prompt + response SGLang schedules (default: the model's).")
    load_format: str = Field("auto", description="How SGLang reads the weights at start; dummy: random (benchmarks).")
    streaming: bool = Field(False, description="Drive SGLang from its own event-loop thread: many generate calls in flight "
                            "at once, and pauses that keep (retract) or abort running requests (needed for rollout.partial_rollouts).")


EngineConfig = Annotated[Union[HFEngineConfig, VLLMEngineConfig, SGLangEngineConfig], Field(discriminator="kind")]
ENGINE_KINDS = ("hf", "vllm", "sglang")
