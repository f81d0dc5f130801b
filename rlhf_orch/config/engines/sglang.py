"""SGLang's plug-in (rlhf_orch/engines/sglang.py; `streaming: true`: sglang_async.py). Its options are validated here
without importing SGLang."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_orch.config.engines.base import EngineKind, EngineSection


class SGLangEngineConfig(EngineSection):
    kind: Literal["sglang"] = Field(description="SGLang engine (needs the 'sglang' extra and CUDA).")
    mem_fraction_static: float = Field(0.5, gt=0, le=1, description="Fraction of each GPU SGLang may use.")
    python_path: str | None = Field(None, description="Folder(s) put first on the SGLang actor's PYTHONPATH: SGLang's own "
                                    "environment (its exact pins clash with vLLM's), e.g. /tmp/site-sglang.")
    disable_cuda_graph: bool = Field(False, description="Skip CUDA graphs (faster start, slower decode).")
    context_length: int | None = Field(None, ge=1, description="Longest prompt + response SGLang schedules (default: the model's).")
    load_format: str = Field("auto", description="How SGLang reads the weights at start; dummy: random (benchmarks).")
    streaming: bool = Field(False, description="Drive SGLang from its own event-loop thread: many generate calls in flight "
                            "at once, and pauses that keep (retract) or abort running requests (needed for rollout.partial_rollouts).")


def _engine_kwargs(e: SGLangEngineConfig) -> dict:
    # SGLang must know at start whether it will release memory (sleep), and whether to keep the weights on the CPU.
    return {"enable_memory_saver": e.sleep_level > 0, "enable_weights_cpu_backup": e.sleep_level == 1}


KIND = EngineKind("sglang", SGLangEngineConfig, "rlhf_orch.engines.sglang:SGLangEngine", order=2,
                  streaming_engine="rlhf_orch.engines.sglang_async:StreamingSGLangEngine", extra="sglang",
                  needs_cuda=True, tensor_parallel=True, not_engine_args=frozenset({"python_path"}),
                  # SGLang turns NCCL's cuMem allocator off in its processes (engine.py:1583); a trainer-side end of
                  # the same communicator with it on fails its first broadcast ("unhandled cuda error").
                  driver_env={"NCCL_CUMEM_ENABLE": "0"}, engine_kwargs=_engine_kwargs)
