"""Move a DeepSpeed engine's training state off the GPU while colocated engines generate, and back.

What moves: the optimizer state (Adam moments), the fp32 master partitions, the bf16/fp32 model
partitions and the gradient buffers — everything ZeRO keeps per rank — to (pinned) CPU memory, via
DeepSpeed's own `offload_states`/`reload_states`. ZeRO-3 in DeepSpeed 0.19.8 refuses to move the Adam
moments and master weights unless the optimizer is its FusedAdam (an exact class check, stage3.py:3869),
although torch's AdamW keeps the same `exp_avg`/`exp_avg_sq` state; FusedAdam would need a CUDA build at
start-up, so for ZeRO-3 those two parts are moved here with DeepSpeed's own helpers instead.

Each call returns flat metrics: seconds, and for an offload the GiB of this process's torch allocation it
freed (whole-device readings, which also count a vLLM engine on the same GPU, are taken by
driver/colocation.py for every GPU at once). On CPU the "offload" is a CPU-to-CPU move: it exercises the bookkeeping (tests prove
training after a round trip is unchanged) and frees nothing.

`Offloadable` is the bookkeeping every colocated DeepSpeed role shares (the policy rank, the critic inside it):
whether its states are on the GPU, refusing work while they are not, and putting them back around a checkpoint.

It does not offload ZeRO stage 0 (no ZeRO optimizer to hand the state to: the config rejects it), and
does not overlap the copies with other work.
"""
from __future__ import annotations

import contextlib
import time

import torch

from rlhf_orch.errors import TrainerError
from rlhf_orch.gpu_memory import process_memory as gpu_memory

_OURS = "rlhf_orch_offloaded"    # ZeRO-3 parts this module moved itself (hp params, Adam moments)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def offload(engine, zero_stage: int, device: torch.device) -> dict[str, float]:
    from deepspeed.runtime.utils import offload_adam_states
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum as S

    if zero_stage < 1:
        raise ValueError("offload needs a ZeRO optimizer (zero_stage >= 1)")
    before = gpu_memory(device)
    t0 = time.perf_counter()
    pin = device.type == "cuda"
    opt = engine.optimizer
    if zero_stage == 3:
        engine.offload_states(include=[S.lp_params, S.lp_grads, S.contiguous_grad_buffer],
                              device=OffloadDeviceEnum.cpu, pin_memory=pin)
        if not getattr(opt, _OURS, False):
            # Same moves DeepSpeed makes for FusedAdam (stage3.py:3871-3884, utils.py:1158).
            if not hasattr(opt, "_rlhf_hp_pin"):
                opt._rlhf_hp_pin = [torch.empty_like(b, device="cpu", pin_memory=pin)
                                    for b in opt.fp32_partitioned_groups_flat]
            for buf, host in zip(opt.fp32_partitioned_groups_flat, opt._rlhf_hp_pin):
                host.copy_(buf)
                buf.data = host
            offload_adam_states(opt.optimizer, "cpu", pin_memory=pin)
            setattr(opt, _OURS, True)
    else:
        engine.offload_states(device=OffloadDeviceEnum.cpu, pin_memory=pin)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _sync(device)
    secs = time.perf_counter() - t0
    after = gpu_memory(device)
    out = {"offload_s": secs}
    if before:
        out["freed_gb"] = before["allocated_gb"] - after["allocated_gb"]
    return out


def reload(engine, zero_stage: int, device: torch.device) -> dict[str, float]:
    from deepspeed.runtime.utils import reload_adam_states

    t0 = time.perf_counter()
    opt = engine.optimizer
    engine.reload_states()
    if zero_stage == 3 and getattr(opt, _OURS, False):
        for buf, host in zip(opt.fp32_partitioned_groups_flat, opt._rlhf_hp_pin):
            buf.data = host.to(device)
        reload_adam_states(opt.optimizer, device)
        setattr(opt, _OURS, False)
    _sync(device)
    return {"reload_s": time.perf_counter() - t0}


class Offloadable:
    """Mixin over a host's `engine`, `zero_stage`, `device`, `rank` and `offloaded` (False at start). Offload and
    reload are no-ops when already done and return `offload/` metrics; `_before_offload` / `_after_reload` let a
    host move more than the engine (the policy's frozen reference)."""
    engine: object
    zero_stage: int
    device: torch.device
    rank: int
    offloaded: bool
    role = "trainer"        # names the host in errors

    def offload_states(self) -> dict[str, float]:
        if self.offloaded:
            return {}
        self._before_offload()
        m = offload(self.engine, self.zero_stage, self.device)
        self.offloaded = True
        return {f"offload/{k}": v for k, v in m.items()}

    def reload_states(self) -> dict[str, float]:
        if not self.offloaded:
            return {}
        m = reload(self.engine, self.zero_stage, self.device)
        self._after_reload()
        self.offloaded = False
        return {f"offload/{k}": v for k, v in m.items()}

    def _before_offload(self) -> None:
        pass

    def _after_reload(self) -> None:
        pass

    @contextlib.contextmanager
    def _states_loaded(self):
        """Checkpoints may come while offloaded (a run failing mid-generate): reload for them, then put back."""
        was = self.offloaded
        if was:
            self.reload_states()
        try:
            yield
        finally:
            if was:
                self.offload_states()

    def _need_states(self, what: str) -> None:
        if self.offloaded:
            raise TrainerError(f"{self.role} rank {self.rank}: {what} while the training state is offloaded; "
                               "reload_states() first")
