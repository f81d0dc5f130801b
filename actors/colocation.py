"""Colocation: who holds a shared GPU when, for trainer ranks and the engines that share their devices.

The run alternates two phases. In `generate` the engines hold the GPU: trainer ranks have offloaded
their optimizer state, master weights and gradients to CPU (`trainer.offload`). In `train` the trainer
holds it: colocated engines with `sleep_level > 0` have released their KV cache and weights.
The transitions, in the order that keeps peak memory at one tenant plus the weights:

    to_train:     engines sleep (KV cache and weights freed) -> trainers reload their states
    wake_weights: engines re-allocate their weights only (the sync then fills them)
    to_generate:  trainers offload -> engines re-allocate their KV cache

so a step is to_generate -> generate -> to_train -> train -> wake_weights -> sync (-> checkpoint, still
in the train phase). Every transition returns flat `colocate/` metrics (seconds, GiB freed) and, on
GPUs, `mem/` readings of every device in the run, labelled gpu0..gpuN in order of first appearance
(trainer ranks first). Without sleeping engines or offload the transitions are no-ops.

It does not decide placement (placement.py does) and does not move data between trainer and engines.
"""
from __future__ import annotations

import logging
import time

from actors.common import get
from rlhf_orch.errors import EngineError, TrainerError

logger = logging.getLogger(__name__)


class Colocation:
    def __init__(self, trainers, engines: dict, sleep_levels: dict[str, int], offload: bool, device: str,
                 timeout_s: float):
        self.trainers, self.engines = trainers, engines
        self.sleep_levels = {n: lvl for n, lvl in sleep_levels.items() if lvl}
        self.offload, self.cuda, self.timeout = offload, device == "cuda", timeout_s
        self.phase = "generate"          # engines start awake, trainers loaded
        self.labels: dict[str, str] = {}  # device id -> gpuK

    def _engines(self, method: str, *args) -> list:
        names = list(self.sleep_levels)
        return get([getattr(self.engines[n], method).remote(*args) for n in names], self.timeout,
                   f"engines {names} to {method}", EngineError)

    def _trainers(self, method: str) -> list[dict]:
        return self.trainers.call(method)

    def _sleep(self) -> float:
        names = list(self.sleep_levels)
        secs = get([self.engines[n].sleep.remote(self.sleep_levels[n]) for n in names], self.timeout,
                   f"engines {names} to sleep", EngineError)
        return max(secs)

    # ---- transitions ------------------------------------------------------------------------------
    def to_train(self) -> dict[str, float]:
        if self.phase == "train":
            return {}
        m: dict[str, float] = {}
        t0 = time.perf_counter()
        if self.sleep_levels:
            m["colocate/sleep_s"] = self._sleep()
        if self.offload:
            parts = self._trainers("reload_states")
            m["colocate/reload_s"] = max(p.get("offload/reload_s", 0.0) for p in parts)
        self.phase = "train"
        m["colocate/to_train_s"] = time.perf_counter() - t0
        m.update(self.memory("train"))
        return m

    def wake_weights(self) -> dict[str, float]:
        """Before a sync: sleeping engines need their weight memory back (the KV cache stays freed)."""
        if not self.sleep_levels:
            return {}
        return {"colocate/wake_weights_s": max(self._engines("wake_up", ["weights"]))}

    def to_generate(self) -> dict[str, float]:
        if self.phase == "generate":
            return {}
        m: dict[str, float] = {}
        t0 = time.perf_counter()
        if self.offload:
            parts = self._trainers("offload_states")
            m["colocate/offload_s"] = max(p.get("offload/offload_s", 0.0) for p in parts)
            freed = [p["offload/freed_gb"] for p in parts if "offload/freed_gb" in p]
            if freed:
                m["colocate/offload_freed_gb"] = sum(freed)
        # The phase follows the trainers: if an engine dies while waking, to_train() must reload them.
        self.phase = "generate"
        if self.sleep_levels:
            m["colocate/wake_kv_s"] = max(self._engines("wake_up", ["kv_cache"]))
        m["colocate/to_generate_s"] = time.perf_counter() - t0
        m.update(self.memory("generate"))
        return m

    def start(self) -> None:
        """Right after the engines are up, before the trainers initialise (nothing to reload yet): the
        engines sleep so the trainer's start and warm start have the GPU."""
        if self.sleep_levels:
            self._sleep()
        self.phase = "train"

    # ---- readings ---------------------------------------------------------------------------------
    def memory(self, phase: str) -> dict[str, float]:
        """`mem/<phase>/gpuK_used_gb` for every GPU of the run (whole-device figures); {} on CPU."""
        if not self.cuda:
            return {}
        readings: dict[str, float] = {}
        try:
            for part in self._trainers("device_memory"):
                readings.update(part)
            for part in get([e.device_memory.remote() for e in self.engines.values()], self.timeout,
                            "engine memory readings", EngineError):
                readings.update(part)
        except (TrainerError, EngineError) as e:   # readings are diagnostics; never fail a step on them
            logger.warning("GPU memory readings failed: %s", str(e).splitlines()[0])
            return {}
        for dev in readings:
            if dev not in self.labels:
                self.labels[dev] = f"gpu{len(self.labels)}"
                logger.info("metrics label %s = %s", self.labels[dev], dev)
        return {f"mem/{phase}/{self.labels[d]}_used_gb": v for d, v in readings.items()}
