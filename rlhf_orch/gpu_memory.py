"""GPU memory readings for the colocation metrics: this process's torch allocator, and whole devices.

`process_memory(device)` reads torch's counters and the device's free/total (a CUDA context must exist:
trainer ranks). `devices_used_gb(device_ids)` reads whole devices by UUID through NVML, so an actor
without a CUDA context of its own (a vLLM engine's shell, whose workers are subprocesses) can report
its GPUs without creating one (a context alone costs ~500 MB). Both return {} on CPU or when NVML is
missing; readings are GiB. It does not attribute memory to processes.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def process_memory(device: torch.device) -> dict[str, float]:
    """GiB: this process's allocated/reserved, and the whole device's used (all processes)."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated_gb": torch.cuda.memory_allocated(device) / 2**30,
            "reserved_gb": torch.cuda.memory_reserved(device) / 2**30,
            "device_used_gb": (total - free) / 2**30}


def _nvml_uuid(device_id: str) -> str | None:
    if not device_id.startswith("gpu-"):
        return None                      # a CPU placement slot
    uuid = device_id[len("gpu-"):]
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def devices_used_gb(device_ids: list[str]) -> dict[str, float]:
    """{device_id: used GiB} for the GPUs among `device_ids` (NVML; {} if unavailable)."""
    uuids = {d: _nvml_uuid(d) for d in device_ids}
    if not any(uuids.values()):
        return {}
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as e:   # no NVML (CPU machine, or nvidia-ml-py missing): metrics are optional
        logger.debug("NVML unavailable: %s", e)
        return {}
    out = {}
    try:
        for dev, uuid in uuids.items():
            if uuid:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                out[dev] = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
    except Exception as e:
        logger.debug("NVML reading failed: %s", e)
    finally:
        pynvml.nvmlShutdown()
    return out
