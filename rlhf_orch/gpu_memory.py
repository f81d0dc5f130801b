"""GPU memory readings for the colocation metrics: this process's torch allocator, and whole devices.

`process_memory(device)` reads torch's counters and the device's free/total (a CUDA context must exist:
trainer ranks). `devices_used_gb(device_ids)` reads whole devices by UUID through NVML, so an actor
without a CUDA context of its own (a vLLM engine's shell, whose workers are subprocesses) can report
its GPUs without creating one (a context alone costs ~500 MB). Both return {} on CPU or when NVML is
missing; readings are GiB. `stats(device)` and `reset_peak(device)` give the colocation plan its numbers
(`trainer.offload: auto`): bytes, and this process's peak since the last reset. It does not attribute memory to
processes.
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


def reset_peak(device: torch.device) -> None:
    """Start a new peak (before a train step); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_reserved_gb(device: torch.device) -> float | None:
    """GiB: the most this process's allocator held from the device since the last reset (None on CPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_reserved(device) / 2**30


def with_peak(device: torch.device, key: str, fn, *args) -> dict:
    """`fn(*args)`'s metrics, plus on CUDA `key`: the most this process's allocator held from the device during
    the call (a train step's peak, GiB)."""
    reset_peak(device)
    m = fn(*args)
    peak = peak_reserved_gb(device)
    return m if peak is None else {**m, key: peak}


def stats(device: torch.device, release: bool = False) -> dict[str, int]:
    """Bytes: the device's total and used (all processes), this process's allocated/reserved and their peaks since
    the last reset. `release` first returns the allocator's free cached blocks to the device (a process at rest then
    shows what it really keeps). {} on CPU."""
    if device.type != "cuda":
        return {}
    if release:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return {"total": total, "used": total - free,
            "allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "peak_reserved": torch.cuda.max_memory_reserved(device)}


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
