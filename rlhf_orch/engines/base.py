"""The rollout-engine Protocol every engine kind implements, and the shared request/response types.

An engine generates batches of responses with per-token logprobs, and takes new weights through a
`WeightReceiver` (one per worker) that calls the engine's `load_weights` and `checksums`. Engines
track the weight version they hold and stamp it on every sample, so the driver can refuse stale
rollouts. `pause()`/`resume()` bracket a sync: a paused engine refuses to generate.

`EngineLifecycle` is the pause/sleep bookkeeping every engine kind shares (what an engine in each state
refuses, and the tag checks of `wake_up`), and the three ways to pause around a weight sync:
  wait   let running requests finish, then pause (the default; the synchronous loop);
  keep   park running requests between two decode steps, keeping their tokens and KV cache; after the
         sync they continue with the new weights, and their later tokens carry the new version
         (`rollout.partial_rollouts`);
  abort  stop running requests now; they return with finish_reason "abort" and the caller re-queues them.
This module defines the contract only; it imports no engine library.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from rlhf_orch.errors import EngineError
from rlhf_orch.types import Sample

WAKE_TAGS = ("weights", "kv_cache")
PAUSE_MODES = ("wait", "keep", "abort")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    n: int = 1        # samples per prompt
    ignore_eos: bool = False   # generate max_new_tokens whatever is sampled (benchmarks)
    # A request's own seed (evaluation): sample j of the prompt draws from a generator seeded seed + j (vLLM's
    # convention for n > 1), leaving the engine's own sampling RNG, and so the training stream, untouched.
    # None (training): the engine's RNG. temperature 0 is greedy (argmax) and needs no seed.
    seed: int | None = None
    # A "keep" pause may come while a request runs (partial rollouts): a streaming engine must then stamp each token
    # with the weight version it was sampled under, as it arrives. False (no keep pause can come): it may hand back
    # each request only when it ends (vLLM: FINAL_ONLY outputs, no per-token work on its front end's loop).
    per_token_versions: bool = True


TRANSPORTS = frozenset({"ipc", "broadcast"})


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, declared by its class (`capabilities`) and read by the rollout actor, the coordinator
    and the benchmarks, which never probe an engine for methods. Where it depends on the engine's own settings
    (SGLang: tensor parallelism) the class makes `capabilities` a property."""
    partial_rollouts: bool = False       # keep/abort pauses act between two decode steps (else only "wait")
    concurrent_generate: bool = False    # generate calls may run at once (streaming engines batch them together)
    reports_decode_steps: bool = False   # progress_steps moves every decode step (the hang watchdog's sign of life)
    own_receivers: bool = False          # setup_receiver runs receivers in the engine's own processes (vLLM, SGLang);
                                         # else the rollout actor's WeightReceiver calls its load_weights, checksums
                                         # and replay_params, on its `device`
    checks_loads: frozenset = TRANSPORTS   # transports over which its receivers compare what they load with the
                                           # trainer's checksums themselves; over the others (tensor-parallel SGLang's
                                           # own broadcast) the engine reports its checksums and stays paused until the
                                           # coordinator has compared them (actors/coordinator.py)
    aborts_syncs: bool = False           # its own receivers poll the rollout actor's abort flag (weight_sync/abort.py)
    saves_rng: bool = False              # rng_state / set_rng_state: a resumed or repaired run samples bit-exactly


def checks_over(engine, transport: str) -> bool:
    """Whether `engine` checks what it loads over `transport` ("ipc" or "broadcast") itself (its declared
    `capabilities.checks_loads`)."""
    return transport in engine.capabilities.checks_loads


def per_prompt_params(params: "SamplingParams | Sequence[SamplingParams]", count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: `params` itself for all, or a list with one per prompt (rows may bound their
    own response length). n, temperature and top_p must agree: groups have n samples and the trainer scores with
    one temperature."""
    if isinstance(params, SamplingParams):
        return [params] * count
    out = list(params)
    if len(out) != count:
        raise EngineError(f"{len(out)} sampling parameters for {count} prompts; give one per prompt or one for all")
    if len({(p.n, p.temperature, p.top_p, p.seed is None) for p in out}) > 1:
        raise EngineError("per-prompt sampling parameters may differ in max_new_tokens and ignore_eos only (and in "
                          "seed, given for every prompt or for none)")
    return out


@runtime_checkable
class RolloutEngine(Protocol):
    name: str
    weight_version: int
    last_pause: dict   # where the last pause() spent its time, seconds by part ({} where it cannot tell), and counts

    def device_ids(self) -> list[str]:
        """One id per worker: GPU UUID on CUDA, placement slot on CPU (see weight_sync/plan.py)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[Sample]:
        """`params.n` samples per prompt, grouped by prompt (prompt_index = position in `prompts`); `params` may be
        a list with one entry per prompt (see per_prompt_params)."""

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy (hf_name, tensor) pairs into the model; tensors are views into a transport buffer."""

    def checksums(self, names: list[str]) -> list[int]:
        """Checksums (weight_sync.buckets.checksums) of the engine's own copy of `names`."""

    def pause(self, mode: str = "wait") -> None:
        """Stop generating for a sync (see PAUSE_MODES); returns once running requests are done/parked/aborted."""

    def resume(self) -> None: ...

    def finish_sync(self, version: int) -> None:
        """New weights are loaded and verified: drop caches, record `version`."""


class EngineLifecycle:
    """Pause and sleep state of an engine: paused (a sync is running) or asleep (memory released for a
    colocated trainer, per tag). Engines call `_init_lifecycle()` in __init__, `_check_can_generate()` first
    in generate, hold `_lock` around a batch (so a "wait" pause waits for it), wrap their decode loop in
    `_decoding()` and call `_between_steps()` before every decode forward (so "keep" and "abort" pauses act
    between two steps)."""

    name: str
    capabilities = Capabilities()   # each engine kind declares its own
    # Where the last pause() spent its time, seconds by part (engines that can tell: the streaming vLLM engine's
    # loop lag and engine-core pause, and the requests it stopped); the coordinator reports them per sync as
    # sync/pause_<part>.
    last_pause: dict = {}

    def _init_lifecycle(self) -> None:
        self._paused = False
        self._asleep: set[str] = set()
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._pause_mode: str | None = None
        self._running = 0      # decode loops in progress
        self._parked = 0       # of which parked by a "keep" pause
        self.progress_steps = 0   # decode steps taken: the health check's sign of life

    def _check_can_generate(self) -> None:
        with self._cond:
            # A call made during a keep or abort pause waits for resume, as a request sent to a streaming engine does:
            # a multi-turn trajectory's next turn, asked for inside a generate call the rollout actor admitted before
            # the sync (tests/integration/test_multiturn_run.py's killed-engine run failed on it once in CI).
            while self._paused and self._pause_mode is not None:
                self._cond.wait()
        if self._paused:
            raise EngineError(f"engine {self.name}: generate called while paused for a weight sync")
        if self._asleep:
            raise EngineError(f"engine {self.name}: generate called while asleep ({sorted(self._asleep)}); call wake_up() first")

    def _need_weights_awake(self, what: str) -> None:
        if "weights" in self._asleep:
            raise EngineError(f"engine {self.name}: {what} while the weights are asleep; call wake_up(['weights']) first")

    def _tags_to_wake(self, tags: list[str] | None) -> list[str]:
        """Validate `tags` (None: all) and return those actually asleep."""
        tags = list(WAKE_TAGS) if tags is None else list(tags)
        bad = [t for t in tags if t not in WAKE_TAGS]
        if bad:
            raise EngineError(f"engine {self.name}: unknown wake_up tags {bad}; use {list(WAKE_TAGS)}")
        return [t for t in tags if t in self._asleep]

    @contextlib.contextmanager
    def _decoding(self):
        with self._cond:
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def _between_steps(self) -> bool:
        """Called by a decode loop before each forward. Parks while a "keep" pause lasts; False: abort now."""
        self.progress_steps += 1
        with self._cond:
            if self._pause_mode == "keep":
                self._parked += 1
                self._cond.notify_all()
                while self._pause_mode == "keep":
                    self._cond.wait()
                self._parked -= 1
            return self._pause_mode != "abort"

    def pause(self, mode: str = "wait") -> None:
        if mode not in PAUSE_MODES:
            raise EngineError(f"engine {self.name}: unknown pause mode {mode!r}; use one of {PAUSE_MODES}")
        if mode != "wait" and not self.capabilities.partial_rollouts:
            raise EngineError(f"engine {self.name}: pause mode {mode!r} is not supported by this engine kind; use 'wait'")
        if mode == "wait":
            with self._lock:   # waits for an in-flight generate to finish
                self._paused = True
            return
        with self._cond:
            self._paused, self._pause_mode = True, mode
            # keep: every running loop parked; abort: every running loop gone
            while self._running and (self._parked < self._running if mode == "keep" else True):
                self._cond.wait()

    def resume(self) -> None:
        with self._cond:
            self._paused, self._pause_mode = False, None
            self._cond.notify_all()

    def is_asleep(self) -> bool:
        return bool(self._asleep)

    def shutdown(self) -> None:
        """Stop the engine's own processes (none here)."""
