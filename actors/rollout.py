"""Rollout actors: one Ray actor per engine, wrapping an engine of any kind and its weight receiver.

The actor builds the engine by `kind` through the lazy registry, forwards generate/pause/resume,
and owns the engine's `WeightReceiver` (ipc or broadcast end). Engines whose workers live in other
processes (vLLM, SGLang) run their receivers inside those workers; the hf engine runs it here.

The actor is threaded: the rollout manager keeps generate calls in flight while the coordinator pauses,
syncs and resumes the engine from other threads. A gate makes generate calls that arrive during a sync
wait for its end (instead of failing), and serialises them for engines that take one batch at a time.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import ray

from actors.common import Located, kill_descendants, setup_process

from rlhf_orch.config.schema import EngineConfig, RolloutSection
from rlhf_orch.engines import SamplingParams, engine_class, engine_options
from rlhf_orch.engines.base import checks_over
from rlhf_orch.errors import EngineError
from rlhf_orch.gpu_memory import devices_used_gb
from rlhf_orch.rollout.agent import AgentRunner
from rlhf_orch.rollout.agent_specs import agent_table, resolve_agent
from rlhf_orch.rollout.multiturn import TOOLS, MultiTurn
from rlhf_orch.weight_sync import WeightReceiver
from rlhf_orch.weight_sync.abort import AbortFlag
from rlhf_orch.weight_sync.replay import LoadReplay


@ray.remote(max_concurrency=64)
class RolloutActor(Located):
    def __init__(self, name: str, ecfg: EngineConfig, device: str, device_id: str, model_path: str, dtype: str,
                 seed: int, hooks: dict | None = None, rollout: RolloutSection | None = None,
                 agent_key: str = "agent_name"):
        """The engine its typed section describes (rlhf_orch/engines.engine_options), on `device_id`; `hooks`: test
        hooks (rlhf_orch.engines.hooks_from_env, read by the driver); `rollout`: the run's section, whose multi_turn
        trajectories (rlhf_orch/rollout/multiturn.py) or agent functions (rlhf_orch/rollout/agent.py, routed by the
        row's name at `agent_key`, data.agent_key) each generate call then returns; with openai_endpoint this
        process serves the agents an OpenAI-compatible endpoint (rlhf_orch/rollout/openai_server.py)."""
        setup_process(device)
        self.name = name
        kind, kwargs = engine_options(ecfg, model_path, dtype, seed, hooks)
        self.engine = engine_class(kind)(name=name, device=device, device_id=device_id, **kwargs)
        self.turns = self.agent = self.endpoint = None
        mt = rollout.multi_turn if rollout is not None else None
        if mt is not None:
            # Here, not at the top: every process that holds a handle to this actor (the coordinator, the rollout
            # manager) imports this module when Ray loads the handle's class, and transformers and the endpoint's
            # aiohttp cost them ~0.9 s of CPU each at every run's start (py-spy, bench/RESULTS.md, twentieth session).
            from transformers import AutoTokenizer
            from rlhf_orch.rollout.openai_server import OpenAIEndpoint
            tok = AutoTokenizer.from_pretrained(model_path)
            total = mt.total_tokens(ecfg.sampling.max_new_tokens)
        if mt is not None and rollout.agent is not None:
            if rollout.openai_endpoint:
                for name in ("httpx", "httpx2"):   # an OpenAI client's HTTP layer logs every call at INFO
                    logging.getLogger(name).setLevel(logging.WARNING)
                self.endpoint = OpenAIEndpoint()
                self.endpoint.start()
            table = agent_table(rollout.agent, rollout.agents)
            self.agent = AgentRunner(self.engine.generate, resolve_agent(table.pop(None)), tok,
                                     {tool: make() for tool, make in TOOLS.items()}, mt.max_turns, total,
                                     mt.max_observation_tokens, mt.tool_timeout_s, self.endpoint,
                                     {n: resolve_agent(spec) for n, spec in table.items()}, agent_key)
        elif mt is not None:
            self.turns = MultiTurn(self.engine.generate, TOOLS[mt.tool](),
                                   lambda text: tok.encode(text, add_special_tokens=False),
                                   lambda ids: tok.decode(ids, skip_special_tokens=True), mt.max_turns, total,
                                   mt.max_observation_tokens, mt.tool_timeout_s, mt.tool)
        self.receiver = None
        self.verify = True
        self._answered = False
        self._gate = threading.Condition()
        self._syncing = False
        self._receiving = False   # inside a sync's receive (health: a fault benchmark kills inside the transfer)
        self.last_pause: dict[str, float] = {}   # the last pause's parts: seconds, and the engine's counts (see pause)
        self._active = 0   # generate calls past the sync gate (inside the engine, or queued for their turn: "wait" waits)
        self._inside = 0   # generate calls inside the engine
        self._next_ticket = 0    # rollout.deterministic: the dispatch number of the next call to serve
        self._max_admitted = -1  # the highest ticket past the sync gate
        self._awaiting = 0     # generate calls waiting for the weights they were dispatched under (a sync under way)
        self._calls = 0        # generate calls here, from arrival to return (wait_idle)
        self._calls_done = 0   # finished generate calls: with the engine's decode steps, the health check's progress
        self.caps = self.engine.capabilities   # declared by the engine kind (engines/base.Capabilities)
        self._concurrent = self.caps.concurrent_generate
        self.abort_flag: AbortFlag | None = None   # made at setup_receiver: the coordinator's abort_sync ends a sync

    def endpoint_url(self) -> str | None:
        """The OpenAI-compatible endpoint's base (rollout.openai_endpoint), or None."""
        return None if self.endpoint is None else self.endpoint.base

    def device_ids(self) -> list[str]:
        return self.engine.device_ids()

    def weight_version(self) -> int:
        return self.engine.weight_version

    def health(self) -> dict:
        """Answered from its own thread while generate runs: progress (finished calls + decode steps), whether
        the engine is paused or asleep on purpose, and whether it reports every decode step."""
        return {"pid": os.getpid(), "progress": self._calls_done + int(self.engine.progress_steps),
                "paused": self._syncing or self.engine.is_asleep() or self._awaiting > 0, "syncing": self._syncing,
                "receiving": self._receiving, "reports_steps": self.caps.reports_decode_steps}

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no generate call is here, running or queued (a replaced rollout manager's orphaned calls end
        before the engine's sampling RNG is set back); False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._gate:
            while self._calls and time.monotonic() < deadline:
                self._gate.wait(0.05)
            return not self._calls

    def generate(self, prompts: list[list[int]], params: SamplingParams, ticket: int | None = None,
                 version: int | None = None, rows: list[dict] | None = None):
        """Samples and timing of one call (`_generate`), counted while it is here (`wait_idle`); `rows`: the prompts'
        dataset rows, which an agent function reads."""
        with self._gate:
            self._calls += 1
        try:
            return self._generate(prompts, params, ticket, version, rows)
        finally:
            with self._gate:
                self._calls -= 1
                self._gate.notify_all()

    def _generate(self, prompts: list[list[int]], params: SamplingParams, ticket: int | None, version: int | None,
                  rows: list[dict] | None = None):
        """Samples and timing of one call. Calls arriving during a sync wait for its end. `ticket` (the manager's
        dispatch number for this engine, rollout.deterministic) makes calls enter in dispatch order, and a ticketed
        call counts for a "wait" pause from its arrival, queued or not: a sync then waits for every call dispatched
        before it, so each runs with the weights it was dispatched under. `version`: those weights, at least; a call
        that arrives before them (their sync overlaps the next train step, weight_sync.overlap) waits for them. A
        ticketed call that finds newer ones (it reached the engine after the sync began) fails rather than silently
        make the run irreproducible."""
        with self._gate:
            # Dispatched for weights still on their way (weight_sync.overlap: the manager counts a sync from its
            # start): wait for them, as a paused engine (health), before counting for any pause.
            self._awaiting += 1
            try:
                while version is not None and self.engine.weight_version < version:
                    self._gate.wait()
            finally:
                self._awaiting -= 1
            if ticket is None:
                while self._syncing or (self._inside and not self._concurrent):
                    self._gate.wait()
            else:
                # A call behind an admitted later ticket goes too (it was dispatched before it, so before the sync).
                while self._syncing and ticket > self._max_admitted:
                    self._gate.wait()
                self._max_admitted = max(self._max_admitted, ticket)
                self._active += 1   # from here a "wait" pause waits for this call
                try:
                    while ticket != self._next_ticket or (self._inside and not self._concurrent):
                        self._gate.wait()
                except BaseException:
                    self._active -= 1
                    raise
            if ticket is None:
                self._active += 1
            self._inside += 1
        try:
            if ticket is not None and version is not None and self.engine.weight_version != version:
                raise EngineError(f"engine {self.name}: rollout.deterministic: a generate call dispatched for weight "
                                  f"version {version} reached the engine at version {self.engine.weight_version} (it "
                                  "arrived after a sync began), so this run would not be reproducible; please report it")
            start, t0 = time.time(), time.perf_counter()
            if self.agent is not None:
                samples = self.agent.generate(prompts, params, rows if rows is not None else [{}] * len(prompts))
            else:
                samples = (self.turns or self.engine).generate(prompts, params)
            secs = time.perf_counter() - t0
        finally:
            with self._gate:
                self._active -= 1
                self._inside -= 1
                self._calls_done += 1
                if ticket is not None:
                    self._next_ticket = ticket + 1
                self._gate.notify_all()
        tokens = sum(len(s.response_ids) for s in samples)
        return samples, {"tokens": tokens, "seconds": secs, "start": start, "end": start + secs}

    # ---- weight sync ----------------------------------------------------------------------------
    def setup_receiver(self, layouts, transport: str, spec: dict, verify: bool, timeout_s: float,
                       replay: bool = True) -> float:
        """Setup's first round (weight_sync/transport.py): open this engine's side of `transport` from its spec (a
        broadcast group blocks until every member joined). Returns seconds."""
        self.verify = verify
        self._answered = False   # until `connect` answers: the sender then waits on us, and is told when we fail
        self.close_receiver()   # a re-plan after an engine fault: leave the old broadcast group first
        if self.abort_flag is None:
            self.abort_flag = AbortFlag.create()   # its file goes once the receiving process mapped it (below)
        if self.caps.own_receivers:
            # Engines with their own worker processes (vLLM) run a receiver in every worker; those that declare
            # `aborts_syncs` map this actor's abort flag there (then the file is no longer needed).
            self.receiver = self.engine
            flag = self.abort_flag.handle() if self.caps.aborts_syncs else None
            try:
                return self.engine.setup_receiver(layouts, transport, spec, verify, timeout_s, replay, abort_flag=flag)
            finally:
                self.abort_flag.unlink()   # mapped where it is read, or read nowhere
        # hf: the actor's receiver loads into the engine; replay_params gives its parameters, checked awake
        self.receiver = WeightReceiver(layouts, self.engine.device, self.engine.load_weights, self.engine.checksums,
                                       LoadReplay(self.engine.replay_params, replay))
        self.receiver.abort_flag = self.abort_flag
        self.abort_flag.unlink()   # this process holds the only mapping it needs
        # where a gloo group's sockets bind in this process (the group's store may sit on another node)
        return self.receiver.open(transport, {**spec, "local_host": ray.util.get_node_ip_address()}, timeout_s)

    def connect(self, offer):
        """Setup's second round: the trainer rank's offer -> this engine's answer (ipc: it opens the rank's ring
        buffers once and answers with its mailbox)."""
        answer = self.receiver.connect(offer)
        self._answered = answer is not None
        return answer

    def checks_loads(self, transport: str) -> bool:
        """Whether this engine's receivers compare what they load over `transport` with the trainer's checksums
        themselves: ours (hf here, vLLM in its workers, single-GPU SGLang in its scheduler) over both transports;
        tensor-parallel SGLang, fed through its own API, reports its checksums for the coordinator to compare
        (engines/base.checks_over)."""
        return checks_over(self.engine, transport)

    def sync_weights(self, version: int, sync_id: int, pause_mode: str, hold: bool = False) -> dict:
        """A whole sync in one call: pause -> take every bucket over this engine's transport (checking each tensor's
        checksum against the trainer's where the transport carries them) -> record the version -> resume. `hold`: the
        coordinator compares the checksums returned, so the engine stays paused until its `commit`. On failure the
        engine stays paused and a colocated sender is told at once (the coordinator resumes or replaces the engine)."""
        t0 = time.perf_counter()
        try:
            self.pause(pause_mode)
            t1 = time.perf_counter()
            with self._receiving_now():
                sums, m = self.receiver.receive(sync_id, self.verify)
        except BaseException:
            if self._answered:   # the sender waits on what we answered (ipc: our mailbox): it stops waiting now. A
                self.receiver.abort_stream()   # broadcast sender hears of it from the coordinator instead.
            raise
        t2 = time.perf_counter()
        if not hold:
            self.commit(version)
        return {"sums": sums, "pause_s": t1 - t0, "pause_parts": dict(self.last_pause), "receive_s": t2 - t1,
                "load_s": float(m.get("load_s", 0.0)),
                "on_device": float(m.get("on_device", 0.0)),   # the GPU hand-over (weight_sync/mailbox.py)
                "finish_s": time.perf_counter() - t2, "total_s": time.perf_counter() - t0}

    def commit(self, version: int) -> float:
        """The weights just received are checked: record `version`, then resume generating. Returns seconds."""
        t0 = time.perf_counter()
        self.finish_sync(version)
        self.resume()
        return time.perf_counter() - t0

    def abort_sync(self, sync_id: int) -> float:
        """The coordinator's word that sync `sync_id` failed elsewhere: this side's waits raise SyncAborted at once
        (weight_sync/abort.py), also if the sync has not reached this engine yet. The engine stays paused."""
        if self.abort_flag is not None:   # None: no receiver yet, so no sync to end
            self.abort_flag.abort(int(sync_id))
        return time.time()

    def close_receiver(self) -> None:
        close = getattr(self.receiver, "close", None)
        if callable(close):
            close()
        self.receiver = None

    @contextlib.contextmanager
    def _receiving_now(self):
        """health()'s `receiving` while a sync's transfer runs here (a fault benchmark kills inside it)."""
        self._receiving = True
        try:
            yield
        finally:
            self._receiving = False

    def rng_state(self):
        """None for engines whose sampling state cannot be saved (vLLM): their resume is not bit-exact."""
        return self.engine.rng_state() if self.caps.saves_rng else None

    def set_rng_state(self, state) -> None:
        if self.caps.saves_rng and state is not None:
            self.engine.set_rng_state(state)

    def pause(self, mode: str = "wait") -> float:
        """Close the gate, then pause the engine: "wait" lets running calls finish first, "keep" parks them
        between decode steps, "abort" ends them (they return their groups as aborted). Returns seconds."""
        t0 = time.perf_counter()
        with self._gate:
            self._syncing = True
            if mode == "wait":
                while self._active:
                    self._gate.wait()
        t1 = time.perf_counter()
        self.engine.pause(mode)
        t2 = time.perf_counter()
        # in-run diagnosis of a long pause (issue #27): running calls waited out, then the engine's own parts
        self.last_pause = {"gate_s": t1 - t0, "engine_s": t2 - t1,
                           **{k: float(v) for k, v in self.engine.last_pause.items()}}
        return t2 - t0

    def resume(self) -> None:
        self.engine.resume()
        with self._gate:
            self._syncing = False
            self._gate.notify_all()

    def finish_sync(self, version: int) -> None:
        self.engine.finish_sync(version)

    # ---- colocation -----------------------------------------------------------------------------
    def sleep(self, level: int) -> float:
        t0 = time.perf_counter()
        self.engine.sleep(level)
        return time.perf_counter() - t0

    def wake_up(self, tags: list[str]) -> float:
        t0 = time.perf_counter()
        self.engine.wake_up(tags)
        return time.perf_counter() - t0

    def device_memory(self) -> dict[str, float]:
        """{device id: used GiB} of this engine's GPUs (whole devices, via NVML; {} on CPU)."""
        return devices_used_gb(self.engine.device_ids())

    def kill_children(self) -> list[int]:
        """SIGKILL the engine's own processes (vLLM's engine core, SGLang's scheduler), answered on another thread
        while a call hangs: the driver's last word to a hung engine before it kills this actor, so that nothing of
        it keeps the GPU or sits in a dead weight-sync group (actors/common.kill_descendants)."""
        return kill_descendants()

    def shutdown(self) -> None:
        """Leave the weight-sync group, then stop the engine's own processes (vLLM/SGLang workers)."""
        if self.receiver is not self.engine:
            self.close_receiver()
        self.engine.shutdown()


def sampling_params(cfg_sampling, n: int) -> SamplingParams:
    return SamplingParams(temperature=cfg_sampling.temperature, top_p=cfg_sampling.top_p,
                          max_new_tokens=cfg_sampling.max_new_tokens, n=n)
