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
(trainer ranks first). `step_metrics()` sums a step's hand-overs: `colocate/handover_s` (seconds of the
transitions) and `colocate/moved_gb` (GPU memory freed and taken back, both directions, where known: the
trainer's offload as its allocator saw it, the engines' sleep as measured in the first step; 0 on CPU).
Without sleeping engines or offload the transitions are no-ops.

`trainer.offload: auto` moves only what must move. On CUDA the first step runs the configured hand-overs
(offload, and sleep where `sleep_level` > 0) and reads each trainer's GPU at three points: engines awake (end
of generate), engines asleep (after the hand-over to train), and after the train step (the trainer's peak, and
its footprint at rest). `rlhf_orch.colocation_plan.choose` then picks, once, the least movement that fits:
nothing, engines sleep only, or everything as configured; the hand-overs the plan does not need are skipped from
then on. What each engine and the trainers actually hold (asleep tags, offloaded) is tracked, so a switch to a
plan that moves less first wakes what is asleep (at the step's sync) and never leaves a trainer offloaded. A
later train step whose peak no longer fits the plan's margin moves the plan towards more movement (never back).
On CPU, auto means nothing moves (no GPU memory to share).

It does not decide placement (placement.py does) and does not move data between trainer and engines.
"""
from __future__ import annotations

import logging
import time

from actors.common import get
from rlhf_orch.colocation_plan import GiB, Plan, choose, measured_gpus, with_peak
from rlhf_orch.errors import EngineError, TrainerError

logger = logging.getLogger(__name__)
TAGS = ("weights", "kv_cache")
PEAK_KEY = "mem/trainer_peak_gb_max"   # TrainerActor.train_step's reading, max over ranks


class Colocation:
    def __init__(self, trainers, engines: dict, sleep_levels: dict[str, int], offload: bool | str, device: str,
                 timeout_s: float):
        self.trainers, self.engines = trainers, engines
        self.sleep_levels = {n: lvl for n, lvl in sleep_levels.items() if lvl}
        self.auto = offload == "auto"
        self.offload = bool(offload)      # configured: True for true and for auto (its safe first step)
        self.cuda, self.timeout = device == "cuda", timeout_s
        self.phase = "generate"          # engines start awake, trainers loaded
        self.labels: dict[str, str] = {}  # device id -> gpuK
        self.active = self.offload or bool(self.sleep_levels)   # anything configured to move
        self.plan: Plan | None = None     # None: the configured hand-overs (auto before it decides, true, false)
        self.asleep: set[str] = set()     # tags the sleeping engines have released ("weights", "kv_cache")
        self.offloaded = False            # trainers' states in CPU memory
        self._readings: dict[str, list[dict]] = {}   # first step (CUDA): "awake" and "asleep" trainer readings
        self._measured_engines: list[str] = []       # the engines those readings saw
        self._gpus = []                   # what the plan was chosen on (GpuMemory per trainer GPU)
        self._engine_gb: float | None = None   # GiB the engines' sleep frees (measured in the first step)
        self._trainer_gb = 0.0            # GiB the last offload freed (a reload takes them back)
        self._step_s, self._step_gb = 0.0, 0.0
        self._report = False              # plan metrics not yet in a step's metrics
        if self.auto and not self.cuda:
            self._set_plan(Plan(False, False, "trainer.device is cpu: there is no GPU memory to share"))

    @property
    def do_offload(self) -> bool:
        return self.offload and (self.plan is None or self.plan.offload)

    @property
    def do_sleep(self) -> bool:
        return bool(self.sleep_levels) and (self.plan is None or self.plan.sleep)

    def _asleep(self, tag: str) -> bool:
        return tag in self.asleep and bool(self.sleep_levels)

    def _engines(self, method: str, *args) -> list:
        names = list(self.sleep_levels)
        return get([getattr(self.engines[n], method).remote(*args) for n in names], self.timeout,
                   f"engines {names} to {method}", EngineError)

    def _trainers(self, method: str, *args) -> list:
        return self.trainers.call(method, *args)

    def _sleep(self) -> float:
        names = list(self.sleep_levels)
        secs = get([self.engines[n].sleep.remote(self.sleep_levels[n]) for n in names], self.timeout,
                   f"engines {names} to sleep", EngineError)
        self.asleep = set(TAGS)
        return max(secs)

    def _count(self, secs: float, gb: float = 0.0) -> None:
        self._step_s += secs
        self._step_gb += gb

    # ---- transitions ------------------------------------------------------------------------------
    def to_train(self) -> dict[str, float]:
        if self.phase == "train":
            return {}
        measure = self.cuda and not self._gpus and "asleep" not in self._readings and self.active
        if measure and "awake" in self._readings:   # a retry after an engine fault: the engines were half asleep
            self._readings["asleep"], measure = [], False   # no plan from these readings (auto keeps the configured)
        if measure:   # the first hand-over to train: the engines' memory awake, then asleep
            self._readings["awake"] = self._stats()
            self._measured_engines = sorted(self.engines)
        m: dict[str, float] = {}
        gb = 0.0
        t0 = time.perf_counter()
        slept = self.do_sleep
        if slept:
            m["colocate/sleep_s"] = self._sleep()
        if self.do_offload or self.offloaded:   # a trainer that is offloaded always comes back before training
            parts = self._trainers("reload_states")
            m["colocate/reload_s"] = max(p.get("offload/reload_s", 0.0) for p in parts)
            self.offloaded = False
            gb += self._trainer_gb
        self.phase = "train"
        m["colocate/to_train_s"] = time.perf_counter() - t0
        if measure:
            self._readings["asleep"] = self._stats()
            self._measure_engines()
        self._count(m["colocate/to_train_s"], gb + ((self._engine_gb or 0.0) if slept else 0.0))
        if len(m) > 1 or self.plan is None:   # nothing moved under a plan: the readings would repeat the last ones
            m.update(self.memory("train"))
        return m

    def make_room(self) -> bool:
        """Before a colocated replacement engine starts while the trainers hold the GPU (its engine died in the train
        phase: in a sync, or in the hand-over to train). The engine sizes itself from the GPU's free memory, and with
        the trainers' states and their step's cache there it refuses to start (seen on an H100, 2026-11-27: 18.5 of
        79 GiB free, after a mid-sync kill). Offload the trainers (or give back their cache where nothing is
        offloaded). Returns True where `take_back` must follow once the engine is up. Not exercised on CPU."""
        if not self.cuda or self.phase != "train":
            return False
        if self.do_offload and not self.offloaded:
            self._trainers("offload_states")
            self.offloaded = True
            return True
        self._trainers("release_cache")
        return False

    def take_back(self) -> None:
        """The trainers' states back on the GPU after `make_room` (the re-sync reads their weights)."""
        self._trainers("reload_states")
        self.offloaded = False

    def wake_weights(self) -> dict[str, float]:
        """Before a sync: sleeping engines need their weight memory back (the KV cache stays freed). Under a plan
        without sleep (auto), the KV cache comes back now too, so the next hand-over to generate has nothing to do."""
        tags = [t for t in TAGS if self._asleep(t) and (t == "weights" or not self.do_sleep)]
        if not tags:
            return {}
        secs = max(self._engines("wake_up", tags))
        self.asleep -= set(tags)
        self._count(secs, (self._engine_gb or 0.0) if "kv_cache" in tags else 0.0)
        return {"colocate/wake_weights_s": secs}

    def to_generate(self) -> dict[str, float]:
        if self.phase == "generate":
            return {}
        m: dict[str, float] = {}
        gb = 0.0
        t0 = time.perf_counter()
        if self.do_offload:
            parts = self._trainers("offload_states")
            m["colocate/offload_s"] = max(p.get("offload/offload_s", 0.0) for p in parts)
            freed = [p["offload/freed_gb"] for p in parts if "offload/freed_gb" in p]
            if freed:
                m["colocate/offload_freed_gb"] = sum(freed)
            self.offloaded = True
            self._trainer_gb = sum(freed)
            gb += self._trainer_gb
        elif self.plan is not None and self.plan.sleep and self.cuda:
            # The trainer stays but gives back the cache of its step, where the engines' KV cache goes now.
            m["colocate/release_s"] = max(self._trainers("release_cache"))
        # The phase follows the trainers: if an engine dies while waking, to_train() must reload them.
        self.phase = "generate"
        if self._asleep("kv_cache"):
            m["colocate/wake_kv_s"] = max(self._engines("wake_up", ["kv_cache"]))
            self.asleep.discard("kv_cache")
            gb += self._engine_gb or 0.0
        m["colocate/to_generate_s"] = time.perf_counter() - t0
        self._count(m["colocate/to_generate_s"], gb)
        if len(m) > 1 or self.plan is None:
            m.update(self.memory("generate"))
        return m

    def start(self) -> None:
        """Right after the engines are up, before the trainers initialise (nothing to reload yet): the
        engines sleep so the trainer's start and warm start have the GPU."""
        if self.do_sleep:
            self._sleep()
        self.phase = "train"

    # ---- the plan (trainer.offload: auto) -------------------------------------------------------------
    def after_train(self, train_metrics: dict) -> dict[str, float]:
        """After a train step (the train phase, before the step's sync). Under auto on CUDA: the first call chooses
        the plan from the first step's readings; later ones check the step's peak still fits it (else more moves).
        Returns `colocate/plan_offload` and `colocate/plan_sleep` (0/1) once per plan chosen."""
        if self.auto and self.cuda:
            if self.plan is None:
                after = self._stats(release=True)
                if sorted(self.engines) != self._measured_engines:   # an engine died or was replaced meanwhile
                    after = []
                self._gpus = measured_gpus(self._readings.get("awake"), self._readings.get("asleep"), after)
                self._set_plan(choose(self._gpus, can_offload=True, can_sleep=bool(self.sleep_levels)))
            elif self._gpus and PEAK_KEY in train_metrics:
                gpus = with_peak(self._gpus, train_metrics[PEAK_KEY] * GiB)
                plan = choose(gpus, can_offload=True, can_sleep=bool(self.sleep_levels))
                if plan.moves > self.plan.moves:
                    logger.warning("colocation plan changed: the trainer's peak grew to %.1f GiB",
                                   train_metrics[PEAK_KEY])
                    self._gpus = gpus
                    self._set_plan(plan)
        if not self._report or self.plan is None:
            return {}
        self._report = False
        return {"colocate/plan_offload": float(self.plan.offload), "colocate/plan_sleep": float(self.plan.sleep)}

    def _set_plan(self, plan: Plan) -> None:
        self.plan, self._report = plan, True
        logger.info("colocation plan (trainer.offload: auto): %s; %s", plan.name, plan.reason)

    def step_metrics(self) -> dict[str, float]:
        """`colocate/handover_s` and `colocate/moved_gb` of the hand-overs since the last call (the driver takes
        them once per step, at its sync); {} when nothing is configured to move."""
        if not self.active:
            return {}
        out = {"colocate/handover_s": self._step_s, "colocate/moved_gb": self._step_gb}
        self._step_s, self._step_gb = 0.0, 0.0
        return out

    # ---- readings ---------------------------------------------------------------------------------
    def _stats(self, release: bool = False) -> list[dict]:
        """Every trainer rank's memory_stats (bytes); [] if they fail (the plan then keeps the configured moves)."""
        try:
            return self._trainers("memory_stats", release)
        except TrainerError as e:
            logger.warning("trainer memory readings failed: %s", str(e).splitlines()[0])
            return []

    def _measure_engines(self) -> None:
        """GiB the engines' configured sleep frees on the trainers' GPUs (for colocate/moved_gb)."""
        gpus = measured_gpus(self._readings.get("awake"), self._readings.get("asleep"),
                             [{**s, "peak_reserved": 0} for s in self._readings.get("asleep") or []])
        if gpus and self.do_sleep:
            self._engine_gb = sum(g.sleep_frees for g in gpus) / GiB

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
