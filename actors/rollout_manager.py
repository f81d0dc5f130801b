"""RolloutManager: the actor that owns the rollouts of a run.

It holds the prompt stream, admits prompt groups as the staleness bound allows, dispatches whole groups to
the engine with the least outstanding work, sends each finished chunk to the least-busy reward worker as soon
as it returns (not at the end of the step), and keeps scored groups until a step takes them. The driver asks
`next_batch(step)` and gets metadata plus one object reference per trainer rank: the token tensors go from
here to the ranks through the object store, never through the driver.

The decisions (admission, deadlines, dispatch, batch choice, ledger) are rlhf_orch.rollout.scheduler's; this
shell only awaits engines and reward workers (an asyncio actor: one event loop, no locks).

Deterministic mode (rollout.deterministic): the scheduler fills batches in draw order
and rotates chunks over the engines; here every generate call carries its engine's dispatch number (`ticket`: the
engine serves them in that order) and the weight version it was dispatched under, groups sample from seeds of their own
(experiment seed, gid, attempt) when max_staleness >= 1, new groups are drawn only inside `next_batch` (after every
earlier group has been scored, with filter_groups), and `next_batch` returns only after its calls were sent, so the
sync that follows (running_requests wait) waits for them. Engine faults are not reproduced.

Engine faults: an engine whose actor dies during generate, or that a health check finds hung (no progress
for `engine_stall_s` while it has work, or no answer to the check; rlhf_orch.rollout.health), is declared
dead: its actor is killed (a hung process must not keep its GPU), its running groups go back to the queue
and are dispatched to the live engines. The driver takes the dead list at the next step boundary
(`take_dead`), starts replacements, syncs them and hands them back with `add_engine`. With no live engine
left, `next_batch` returns early ({"need_engines": [...]}) so the driver can replace one right away. An
engine that reports an error while alive (an EngineError) still fails the run: that is a bug to see.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time

import ray
from ray.exceptions import RayActorError

from actors.common import Located, setup_process
from actors.reward import RewardWorkers
from rlhf_orch.algorithms.base import make_algorithm
from rlhf_orch.config.schema import ExperimentConfig, RolloutSection
from rlhf_orch.errors import ACTOR_DIED, EngineError, RewardError, RLHFOrchError, RolloutError
from rlhf_orch.metrics.timeline import Timeline
from rlhf_orch.rewards import with_response_ids
from rlhf_orch.rollout import GroupScheduler
from rlhf_orch.rollout.batching import assemble
from rlhf_orch.rollout.health import HealthTracker, call_deadline_s

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class RolloutManager(Located):
    def __init__(self, engines: dict, rewarders: list, dataset, params: dict, cfg: ExperimentConfig, pad_id: int,
                 t0: float, reward_workers: RewardWorkers | None = None):
        """`cfg`: the run's typed config (its rollout, algorithm, fault_tolerance sections are read here);
        `params`: each engine's sampling parameters; `pad_id`: the tokenizer's."""
        setup_process("cpu")
        self.engines, self.rewarders, self.dataset, self.params = engines, rewarders, dataset, params
        self.cfg, self.rollout, self.pad_id = cfg, cfg.rollout, pad_id   # `start` may take another rollout section
        self.reward_workers = reward_workers   # starts a replacement for a reward worker that dies (None: restart)
        self.reward_restarts = 0
        self.faults: list[dict] = []           # reward workers replaced here, for the driver's summary (next_batch)
        self.algorithm = make_algorithm(cfg.algorithm.model_dump())   # its outcome advantages make each step's batch
        self.sched: GroupScheduler | None = None
        self.error: RLHFOrchError | None = None
        self.timeline = Timeline(t0)
        self._sent_events = 0
        self._reward_load = [0] * len(rewarders)
        self._tasks: set[asyncio.Task] = set()
        self._cond: asyncio.Condition | None = None
        self.health = HealthTracker(cfg.fault_tolerance.engine_stall_s)
        self.dead: dict[str, dict] = {}      # declared dead, not yet taken by the driver
        self._watcher: asyncio.Task | None = None
        self._tickets: dict[str, int] = {}   # deterministic: each engine actor's next dispatch number (kept across start())
        self._in_window = False               # inside next_batch, after set_version: dispatches carry their version

    # ---- control (driver) -------------------------------------------------------------------------
    async def start(self, first_step: int, last_step: int, version: int, pending: list | None = None,
                    rollout: RolloutSection | None = None) -> dict:
        """Set up for steps first_step..last_step with the engines at `version`; `pending` are draws of a
        checkpointed run not yet trained, served first. Nothing is dispatched before `next_batch`. `rollout`: the
        rollout section from here on (a benchmark runs modes, e.g. max_staleness, back to back on one cluster)."""
        led = self.sched.ledger() if self.sched is not None else {}
        if led.get("in_flight") or led.get("buffered"):
            raise RolloutError("rollout manager: start() while groups are still in flight or buffered")
        r = self.rollout = rollout or self.rollout
        self._cond = asyncio.Condition()
        self.sched = GroupScheduler(prompts_per_step=self.cfg.data.prompts_per_step,
                                    group_size=self.cfg.algorithm.group_size, max_staleness=r.max_staleness,
                                    first_step=first_step, last_step=last_step, engines=list(self.engines),
                                    draw=lambda: self.dataset.next_batch(1)[0], dispatch_groups=r.dispatch_groups,
                                    filter_groups=r.filter_groups, filter_max_draws=r.filter_max_draws,
                                    deterministic=r.deterministic,
                                    deadline_slack=r.token_lag_bound() - r.max_staleness)
        self.sched.version = version
        if pending:
            self.sched.requeue([self.dataset.prompt(tuple(src)) for src in pending])
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return {"budget": self.sched.budget()}

    async def next_batch(self, step: int, timeout_s: float):
        """(metadata, [object ref of each rank's TrainBatch]) for `step`, once its groups are ready. The engines
        hold version step-1 on entry: groups that need it are admitted and dispatched first."""
        # Step `step` trains version step-1, which the engines hold now: admit what the bound allows first.
        # (One call, not a separate set_version: Ray does not order an async actor's calls.)
        deadline = time.monotonic() + timeout_s
        det = self.sched.deterministic
        if det and self.sched.filter_groups:   # admission counts filtered groups: all earlier ones scored first
            if await self._wait(step, deadline, lambda: True if self.sched.settled() else None, timeout_s) is None:
                return {"need_engines": sorted(self.dead)}, None
        self.sched.set_version(step - 1)
        self._in_window = True
        try:
            self._pump()
            groups = await self._wait(step, deadline, lambda: self._select(step), timeout_s)
            if det:   # the calls just dispatched are sent before the driver may sync (they must run first)
                await asyncio.sleep(0)
        finally:
            self._in_window = False
        if groups is None:   # nobody left to generate: the driver replaces one now
            return {"need_engines": sorted(self.dead)}, None
        filtered = self.sched.take(groups)
        if self.sched.slack and self.sched.overdue():   # late groups' places back in the budget: fill them now
            self._pump()
        ready, dispatched = max(g.ready_at for g in groups), min(g.dispatched_at for g in groups)
        t = self.cfg.trainer
        sb = assemble(groups, step - 1, self.rollout.token_lag_bound(), self.algorithm, self.pad_id, t.num_ranks,
                      ready - dispatched, balance_tokens=bool(t.max_tokens_per_micro_batch))
        led = self.sched.ledger()
        metrics = {**sb.metrics, "rollout/groups_filtered": float(filtered),
                   # the slowest group's time from its (last) dispatch to scored: what a step waits for at the end
                   "rollout/group_latency_max_s": max(g.ready_at - g.dispatched_at for g in groups),
                   "perf/batch_ready_t": ready - self.timeline.t0,
                   "perf/batch_dispatch_t": dispatched - self.timeline.t0,
                   **{f"ledger/{k}": float(v) for k, v in led.items()}}
        # `state` is what a checkpoint after this step holds (this batch counts as trained once the step completes).
        meta = {"metrics": metrics, "tokens": sb.tokens, "example": sb.example, "sources": sb.sources, "events": self.events(),
                "faults": self.take_faults(),
                "state": self.state()}
        return meta, [ray.put(b) for b in sb.shards]

    def _select(self, step: int):
        groups = self.sched.select_batch(step)
        if groups is None and self.sched.deterministic and self.sched.settled() and self.sched.can_admit():
            self._pump()   # too few live groups for the batch (filtered ones): draw more now that all have settled
        return groups

    async def _wait(self, step: int, deadline: float, ready, timeout_s: float):
        """ready()'s first non-None value, re-checked whenever the manager's state changes; None when every engine is
        dead (the driver replaces one). Raises the run's error, or RolloutError at `deadline`."""
        async with self._cond:
            while True:
                if self.error is not None:
                    raise self.error
                if not self.engines and self.dead:
                    return None
                value = ready()
                if value is not None:
                    return value
                try:
                    await asyncio.wait_for(self._cond.wait(), timeout=max(deadline - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    raise RolloutError(f"rollout manager: no batch for step {step} after {timeout_s:.0f}s; "
                                       f"ledger {self.sched.ledger()}; look at the engines on the Ray dashboard "
                                       "or raise ray.get_timeout_s") from None

    def health(self) -> dict:
        """Its process id (fault tests kill it; the driver restarts the run when it dies)."""
        import os
        return {"pid": os.getpid()}

    def restore_data(self, data_state: dict) -> None:
        """A resumed run: the dataset cursor of its checkpoint (after every draw of the first segment)."""
        self.dataset.restore(data_state)

    def state(self) -> dict:
        """What a checkpoint keeps: the data cursor after every draw, and the draws not yet trained."""
        return {"data": self.dataset.state(), "pending": self.sched.pending_sources() if self.sched else [],
                "ledger": self.sched.ledger() if self.sched else {}}

    def ledger(self) -> dict:
        return self.sched.ledger() if self.sched else {}

    # ---- engine faults (driver) -----------------------------------------------------------------------
    def take_faults(self) -> list[dict]:
        """Reward workers replaced here since the last call (their records for summary.json)."""
        faults, self.faults = self.faults, []
        return faults

    def take_dead(self) -> dict:
        """Engines declared dead since the last call: {name: fault record}. The driver replaces them."""
        dead, self.dead = self.dead, {}
        return dead

    async def engine_died(self, name: str, cause: str, phase: str) -> None:
        """The driver saw an engine die (e.g. during a weight sync): same handling as one found here."""
        await self._engine_failed(name, cause, phase)

    async def add_engine(self, name: str, actor, params) -> None:
        """A replacement (already synced and verified) takes work from now on."""
        self.engines[name] = actor
        self.params[name] = params
        self._tickets[name] = 0   # a new actor: its dispatch numbers start again
        self.sched.add_engine(name)
        self._pump()
        await self._notify()

    def events(self) -> list[dict]:
        """Timeline events not yet handed to the driver."""
        events = self.timeline.events[self._sent_events:]
        self._sent_events += len(events)
        return events

    # ---- the work ---------------------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _pump(self) -> None:
        if self.error is not None:
            return
        self.sched.admit()
        now = time.time()
        det = self.sched.deterministic
        for engine, groups in self.sched.plan_dispatch():
            for g in groups:
                g.dispatched_at = now
            # The engines wait for (at least) the version the groups are admitted under: with weight_sync.overlap
            # its sync may still be under way, and a group must never run on older weights than its admission.
            ticket, version = None, self.sched.version
            if det:
                ticket = self._tickets.get(engine, 0)
                self._tickets[engine] = ticket + 1
                # Outside next_batch (a fault's re-queue) the engines may be past sched.version: no exact check then.
                version = self.sched.version if self._in_window else None
            self._spawn(self._generate(engine, groups, ticket, version))

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def _fail(self, err: RLHFOrchError) -> None:
        if self.error is None:
            self.error = err
            logger.error("%s", err)
        await self._notify()

    async def _generate(self, engine: str, groups, ticket: int | None = None, version: int | None = None) -> None:
        try:
            prompts = [g.prompt.token_ids for g in groups]
            call = self.engines[engine].generate
            rows = [g.prompt.row for g in groups] if self.rollout.agent else None   # an agent function reads its row
            samples, stats = await call.remote(prompts, self._params(engine, groups), ticket, version, rows)
        except Exception as e:
            if engine not in self.engines:   # declared dead already (a health check): its groups were re-queued
                return
            if isinstance(e, RayActorError):  # the process died: re-queue its groups, the driver replaces it
                await self._engine_failed(engine, f"actor died: {str(e).splitlines()[0][:300]}", "generate")
                return
            # an engine error from a live engine: the run stops with the engine's own message
            cause = getattr(e, "cause", None) or e
            await self._fail(cause if isinstance(cause, RLHFOrchError) else
                             EngineError(f"engine {engine}: generate failed: {type(cause).__name__}: {cause}"))
            return
        if engine not in self.engines:   # answered after it was declared hung: its groups were re-queued
            return
        self.timeline.add(f"engine:{engine}", "generate", stats["start"], stats["end"], groups=len(groups))
        per_group = [[] for _ in groups]
        for smp in samples:
            per_group[smp.prompt_index].append(smp)
        to_score = self.sched.on_generated(engine, groups, per_group)
        if len(to_score) < len(groups):   # aborted by a sync: back in the queue, out again now
            self._pump()
        if to_score:
            await self._score(to_score)

    def _params(self, engine: str, groups):
        """The engine's sampling parameters, or one per group where dataset rows bound their own length
        (`max_new_tokens`, `ignore_eos`: e.g. a benchmark's long-tailed lengths) or, deterministic with
        max_staleness >= 1, where each group samples from its own seed (`group_seed`): its samples then depend on
        neither the engine nor what it generated before."""
        base = self.params[engine]
        if self.rollout.final_outputs is not False and not self.rollout.partial_rollouts:
            # only partial rollouts pause ("keep") with weights changing under a running request: without them a
            # streaming engine may hand back each request once it ends (engines/base.SamplingParams.per_token_versions);
            # default (None) on: same speed, shorter pauses (bench/RESULTS.md, twelfth session)
            base = dataclasses.replace(base, per_token_versions=False)
        seeded = self.sched.deterministic and self.rollout.max_staleness >= 1
        if not seeded and not any("max_new_tokens" in g.prompt.row or "ignore_eos" in g.prompt.row for g in groups):
            return base
        out = []
        for g in groups:
            p = dataclasses.replace(base, max_new_tokens=int(g.prompt.row.get("max_new_tokens", base.max_new_tokens)),
                                    ignore_eos=bool(g.prompt.row.get("ignore_eos", base.ignore_eos)))
            if seeded:
                p = dataclasses.replace(p, seed=group_seed(self._seed(), g.gid, g.attempts, base.n))
            out.append(p)
        return out

    def _seed(self) -> int:
        return int(self.cfg.experiment.seed)

    async def _score(self, groups) -> None:
        i = min(range(len(self.rewarders)), key=lambda j: self._reward_load[j])
        worker = self.rewarders[i]
        if self.cfg.reward.dense:   # a dense function finds the token ids in its row (a copy per sample)
            items = [(smp.text, with_response_ids(g.prompt.row, smp.response_ids)) for g in groups for smp in g.samples]
        else:   # an agent's own reward goes in its row's copy (rlhf_orch.rewards.builtin:agent_reward)
            items = [(smp.text, g.prompt.row if smp.agent_reward is None else {**g.prompt.row,
                                                                               "agent_reward": smp.agent_reward})
                     for g in groups for smp in g.samples]
        self._reward_load[i] += len(items)
        t0 = time.time()
        try:
            parts = await worker.score_parts.remote(items)
        except Exception as e:
            if isinstance(e, RayActorError):   # replaced in place, and these groups scored again
                if self._reward_worker_died(i, worker, e):
                    await self._score(groups)
                    return
                # no replacement allowed: launch.py restarts the run from its checkpoint
                await self._fail(RewardError(f"reward worker {i} failed while scoring: {ACTOR_DIED} "
                                             f"({str(e).splitlines()[0][:300]})"))
                return
            cause = getattr(e, "cause", None) or e
            await self._fail(cause if isinstance(cause, RLHFOrchError) else
                             RewardError(f"reward worker {i} failed: {type(cause).__name__}: {cause}"))
            return
        finally:
            self._reward_load[i] -= len(items)
        now = time.time()
        self.timeline.add(f"reward:{i}", "score", t0, now, samples=len(items))
        at, refill = 0, False
        for g in groups:
            n = len(g.samples)
            g.reward_parts = {k: v[at:at + n] for k, v in parts.items() if k not in ("rewards", "token_rewards")}
            if "token_rewards" in parts:
                g.token_rewards = parts["token_rewards"][at:at + n]
            refill |= not self.sched.on_scored(g, parts["rewards"][at:at + n], now)
            at += n
        if refill and not self.sched.deterministic:   # deterministic: drawn inside next_batch, at a fixed point
            self._pump()
        await self._notify()

    def _reward_worker_died(self, i: int, worker, err: Exception) -> bool:
        """Worker `i` died while scoring: start its replacement (once, however many of its calls fail) and say
        whether the caller may score again. False once fault_tolerance.max_engine_restarts replacements are spent."""
        if self.rewarders[i] is not worker:   # replaced already, by another of its calls
            return True
        if self.reward_workers is None or self.reward_restarts >= self.cfg.fault_tolerance.max_engine_restarts:
            return False
        self.reward_restarts += 1
        label = f"{i}.r{self.reward_restarts}"
        self.rewarders[i] = self.reward_workers.start(label)
        cause = f"{ACTOR_DIED}: {str(err).splitlines()[0][:200]}"
        self.faults.append({"engine": None, "victim": f"reward worker {i}", "t": time.time(), "phase": "scoring",
                            "cause": cause, "replacement": f"{self.reward_workers.run_name}-reward-{label}",
                            "recovery": "in place", "steps_redone": 0})
        logger.error("reward worker %d died while scoring (%s): replaced in place by reward-%s; its samples are "
                     "scored again", i, cause, label)
        return True

    # ---- health ----------------------------------------------------------------------------------
    async def _engine_failed(self, name: str, cause: str, phase: str) -> None:
        actor = self.engines.pop(name, None)
        if actor is None:
            return
        now = time.time()
        lost = self.sched.engine_failed(name) if self.sched is not None else []
        self.health.forget(name)
        try:   # a hung engine's own processes first (vLLM's engine core): killing the actor alone leaves them
            await asyncio.wait_for(actor.kill_children.remote(), timeout=1.0)   # answered in ms by a live actor
        except Exception:   # dead already or frozen (its children are beyond reach then)
            pass
        try:
            ray.kill(actor, no_restart=True)   # a hung process must not keep its devices
        except Exception:
            pass
        rec = {"engine": name, "t": now, "phase": phase, "cause": cause, "groups_requeued": len(lost)}
        self.dead[name] = rec
        self.timeline.add(f"engine:{name}", "dead", now, now, cause=cause[:120])
        logger.error("engine %s declared dead during %s (%s); %d groups re-queued on %s", name, phase, cause,
                     len(lost), sorted(self.engines) or "no engine (waiting for a replacement)")
        self._pump()
        await self._notify()

    async def _check(self, name: str, actor) -> None:
        limit = self.cfg.fault_tolerance.engine_stall_s
        try:
            h = await asyncio.wait_for(actor.health.remote(), timeout=limit)
        except asyncio.TimeoutError:
            if name in self.engines:
                await self._engine_failed(name, f"no answer to a health check within {limit:.0f}s (process frozen?)",
                                          "health check")
            return
        except RayActorError as e:
            if name in self.engines:
                await self._engine_failed(name, f"actor died: {str(e).splitlines()[0][:300]}", "health check")
            return
        if name not in self.engines or self.sched is None:
            return
        if not h["reports_steps"]:   # judged on finished calls: allow its longest call
            limit = call_deadline_s(limit, self.params[name].max_new_tokens, False)
        stalled = self.health.observe(name, h["progress"], self.sched.busy(name), h["paused"], time.monotonic(), limit)
        if stalled is not None:
            await self._engine_failed(name, f"hung: work outstanding and no progress for {stalled:.0f}s "
                                            f"(fault_tolerance.engine_stall_s={self.cfg.fault_tolerance.engine_stall_s})",
                                      "generate")

    async def _watch(self) -> None:
        """Health checks of every live engine, every `health_interval_s`, concurrently."""
        while True:
            await asyncio.sleep(self.cfg.fault_tolerance.health_interval_s)
            try:
                await asyncio.gather(*(self._check(n, a) for n, a in list(self.engines.items())))
            except Exception:   # a health check must never take the manager down
                logger.exception("health check failed")


_SEED_SPACE = 2**31 - 1   # vLLM and SGLang take 32-bit seeds


def group_seed(seed: int, gid: int, attempt: int, n: int) -> int:
    """The sampling seed of one dispatch of group `gid` (sample j uses this + j): a hash of (seed, gid, attempt), so a
    group generated again (after an engine fault) samples afresh, and reruns sample the same."""
    return random.Random(f"rlhf_orch-group/{seed}/{gid}/{attempt}").randrange(_SEED_SPACE - n)
