"""EngineRecovery: how the driver's Cluster replaces dead rollout engines (a mixin of driver/cluster.py's Cluster).

The rollout manager declares an engine dead (its process died during generate, or a health check found it hung);
the driver meets other deaths itself (a colocation hand-over, a weight sync). Either way the driver here: tells
the manager (its running groups go back to the queue), starts a replacement on the same placement bundle (while
fault_tolerance.max_engine_restarts lasts), re-plans the weight sync with every live engine (a new broadcast
group; CUDA IPC for a colocated one), and admits the replacement to the manager only after its first sync is
verified by checksum. Fault records (what died, when, why, the replacement, seconds to serving) end up in
summary.json.

The weight-sync coordinator holds nothing that cannot be rebuilt (the plan, the bucket layouts, the sync count): when
it dies, a replacement is started in place, makes the plan and the groups again with the live trainer ranks and
engines, and re-runs the sync that failed (issue #34). The rollout manager too: every batch it hands over carries its
state after that batch (data cursor, draws not trained yet, ledger), so a replacement continues from the last one, its
lost generations drawn again (`_manager_died`; the engines' sampling RNGs set back where they can be, so an on-policy
run samples as it would have). Reward workers are replaced by the manager itself (actors/rollout_manager.py). Trainer
ranks are not replaced here: launch.py restarts the whole run from its latest checkpoint for those.
"""
from __future__ import annotations

import logging
import time

import ray

from actors.common import beside, get
from actors.coordinator import WeightSyncCoordinator
from actors.rollout import sampling_params
from actors.rollout_manager import RolloutManager
from driver.placement import node_alive
from rlhf_orch.errors import EngineError, RolloutError, WeightSyncError, is_actor_death
from rlhf_orch.rollout.scheduler import whole_run_ledger

logger = logging.getLogger(__name__)


def hung_after_abort(abort: dict | None, engines) -> dict[str, str]:
    """{engine: cause} for the live engines still inside an aborted sync when the coordinator's grace ran out (its
    record's `still_waiting`): they answer health checks, but their receive cannot be interrupted (SGLang's own
    tensor-parallel broadcast receive reads no abort flag; before f7e3d14 a vLLM worker's NCCL receive did not
    either), and the re-plan's calls on them would wait for that receive, which only the group's timeout ends (NCCL's
    watchdog then takes the engine's process down anyway). So they are replaced like a hung engine. Trainer ranks still
    in it are not engines: the run restarts for those."""
    if not abort:
        return {}
    return {n: f"hung: still inside the aborted weight sync v{abort['version']} after the abort's grace (its receive "
               f"could not be interrupted)" for n in abort.get("still_waiting", []) if n in engines}


class EngineRecovery:
    """Needs from the Cluster: cfg, env, trainers, engines, starting, rewarders, slots, sampling, colocation,
    coordinator, rollouts, timeout, sync_timeout, plan, timeline, faults, unadmitted, ready, engine_restarts,
    coordinator_restarts, manager_restarts, served_step, boundary_state, checkpoints, ledger_base, final_ledger,
    _manager_args, _manager_plan, _rget, _make_engine and write_endpoints."""

    def _engines_died(self, err: Exception, phase: str) -> bool:
        """After a failed hand-over or sync: find the dead engines (a short health check each), tell the manager (it
        re-queues their groups) and start replacements. False if no engine is dead (the error is someone else's).
        The probe, not the error's text, decides: a sync with a dead peer fails with a transport error."""
        dead = self._probe_engines(phase)
        abort = getattr(err, "abort", None)   # a sync ended by one member's failure (the coordinator's record)
        for name, cause in hung_after_abort(abort, self.engines).items():
            dead.setdefault(name, cause)
        mid_sync = {} if not abort else {
            "phase": "mid-sync", "sync_version": abort["version"], "t_failure_seen": abort["t_failure_seen"],
            "failed_first": abort["culprit"], "survivors": abort["survivors"], "survivors_let_go_s": abort["abort_s"]}
        if not dead:
            if abort:   # not an engine (a trainer rank): the run restarts; the record says how the engines let go
                self.faults.append({"engine": None, "victim": abort["culprit"], "cause": abort["cause"],
                                    "t": abort["t_failure_seen"], "replacement": None, "recovery": "run restart",
                                    **mid_sync})
            return False
        for name, cause in dead.items():
            self._manager("engine_died", name, cause, phase)
        logger.error("engine(s) %s died (seen in %s: %s); replacing", sorted(dead), phase, str(err).splitlines()[0][:200])
        n = len(self.faults)
        self.replace_dead_engines()
        for f in self.faults[n:]:
            f.update(mid_sync)
        return True

    def _new_coordinator(self, name: str):
        """The weight-sync coordinator's actor over the current trainer ranks and engines; no call made to it yet."""
        cfg = self.cfg
        return WeightSyncCoordinator.options(name=name, runtime_env={"env_vars": self.env}, **beside()).remote(
            self.trainers.actors, self.engines, cfg.trainer.device, cfg.model.dtype, cfg.weight_sync)

    def _start_coordinator(self, name: str, actor=None) -> None:
        """The weight-sync coordinator (`actor`: one made earlier by _new_coordinator), its plan made and its groups
        created (and warmed up)."""
        ws = self.cfg.weight_sync
        self.coordinator = actor if actor is not None else self._new_coordinator(name)
        # Parameter specs and group creation: the configured deadline, else the model's (known only after the specs).
        info = get(self.coordinator.setup.remote(), ws.timeout_s or self.timeout, "weight-sync setup", WeightSyncError)
        self.sync_timeout, self.plan = info["timeout_s"], info["plan"]

    def _gone(self, err: Exception, actor) -> bool:
        """Whether `err` says an actor died and `actor` indeed answers no health check (its process is gone)."""
        if not is_actor_death(err):
            return False
        try:
            ray.get(actor.health.remote(), timeout=min(10.0, self.cfg.fault_tolerance.engine_stall_s))
            return False
        except Exception:
            return True

    # ---- the rollout manager, replaced in place ------------------------------------------------------------
    def _start_manager(self, name: str) -> None:
        """The rollout manager over the live engines and reward workers (its settings made once, in Cluster._build)."""
        dataset, pad_id, reward_workers = self._manager_args
        params = {n: sampling_params(self.sampling[n], self.cfg.algorithm.group_size) for n in self.engines}
        self.rollouts = RolloutManager.options(name=name, runtime_env={"env_vars": self.env}, **beside()).remote(
            self.engines, self.rewarders, dataset, params, self.cfg, pad_id, self.timeline.t0, reward_workers)

    def _manager(self, method: str, *args):
        """A call to the rollout manager; if it died, it is replaced in place and the call made again."""
        try:
            return self._rget(getattr(self.rollouts, method).remote(*args), f"rollout manager ({method})")
        except RolloutError as err:
            if not self._manager_died(err):
                raise
            return self._rget(getattr(self.rollouts, method).remote(*args), f"rollout manager ({method})")

    def _manager_died(self, err: Exception, mid_batch: bool = False) -> bool:
        """After a failed call to the rollout manager: if its process is gone, start a replacement that continues from
        the state the dead one handed over with its last batch (data cursor, the draws not trained yet, the ledger).
        Its generations under way are dropped: their prompts are drawn again. `mid_batch`: it died while serving a
        batch; where the engines can save their sampling RNG (max_staleness 0), they are set back to the step's start
        once its orphaned calls ended, so the step samples as it would have. True if replaced."""
        if not self._gone(err, self.rollouts):
            return False
        t0 = time.time()
        self.manager_restarts += 1
        name = f"{self.cfg.experiment.name}-rollouts.r{self.manager_restarts}"
        logger.error("the rollout manager died (%s); starting %s in place from the state after step %d",
                     str(err).splitlines()[0][:200], name, self.served_step)
        exact = False
        if mid_batch and self.checkpoints.boundary_rngs:
            idle = get([e.wait_idle.remote(self.timeout) for e in self.engines.values()], self.timeout + 10,
                       "engines to end the dead manager's calls", EngineError)
            rngs = {n: self.checkpoints.boundary_rngs.get(self.slots[n]["base"]) for n in self.engines}
            get([e.set_rng_state.remote(rngs[n]) for n, e in self.engines.items()], self.timeout,
                "engine RNGs set back", EngineError)
            exact = all(idle) and all(v is not None for v in rngs.values())
        state = self.boundary_state
        self.ledger_base = whole_run_ledger(self.ledger_base, state.get("ledger", {}))   # the dead one's, once
        self._start_manager(name)
        self._rget(self.rollouts.restore_data.remote(state["data"]), "rollout manager (restore)")
        last, rollout = self._manager_plan
        first = self.served_step + 1
        self._rget(self.rollouts.start.remote(first, last, first - 1, state["pending"], rollout),
                   "rollout manager to start")
        self.faults.append({"engine": None, "victim": "rollout manager", "phase": "batch" if mid_batch else "step",
                            "t": t0, "cause": str(err).splitlines()[0][:300], "replacement": name,
                            "recovery": "in place", "replaced_s": round(time.time() - t0, 3), "steps_redone": 0,
                            "draws_requeued": len(state["pending"]), "engine_rngs_set_back": exact})
        return True

    def _whole_ledger(self, ledger: dict) -> dict:
        """This manager's ledger over the one its checkpoint saved (and dead managers'): one ledger for the run."""
        return whole_run_ledger(self.ledger_base, ledger)

    def _stop_rollouts(self) -> None:
        """Collect the manager's last timeline events and ledger, then stop it (before the engines go)."""
        self.final_ledger = {}
        if self.rollouts is None:
            return
        try:
            self.timeline.extend(ray.get(self.rollouts.events.remote(), timeout=30))
            self.final_ledger = self._whole_ledger(ray.get(self.rollouts.ledger.remote(), timeout=30))
            # engines declared dead after the last step boundary: recorded, never replaced
            self.faults.extend({**rec, "replacement": None} for rec in
                               ray.get(self.rollouts.take_dead.remote(), timeout=30).values())
            self.faults.extend(ray.get(self.rollouts.take_faults.remote(), timeout=30))   # reward workers replaced
        except Exception as e:
            logger.warning("rollout manager did not report its ledger: %s", str(e).splitlines()[0])
        ray.kill(self.rollouts)

    def _coordinator_died(self, err: Exception, version: int) -> bool:
        """After a failed sync: if the coordinator itself is dead, start a replacement in place (its plan and groups
        made again with the live members) and record the fault; True if so (the caller re-runs the sync)."""
        if not self._gone(err, self.coordinator):
            return False
        t0 = time.time()
        self.coordinator_restarts += 1
        name = f"{self.cfg.experiment.name}-weight-sync.r{self.coordinator_restarts}"
        logger.error("the weight-sync coordinator died (seen in weight sync v%d: %s); starting %s in place", version,
                     str(err).splitlines()[0][:200], name)
        self._start_coordinator(name)
        self.faults.append({"engine": None, "victim": "weight-sync coordinator", "phase": "weight sync", "t": t0,
                            "cause": str(err).splitlines()[0][:300], "replacement": name, "recovery": "in place",
                            "replaced_s": round(time.time() - t0, 3), "sync_version": version, "steps_redone": 0})
        return True

    def _sync_aborted(self, err: Exception) -> None:
        """A sync that one member's failure ended (actors/coordinator.py `_gather`) goes on the timeline; the fault
        records name it (`_engines_died`)."""
        rec = getattr(err, "abort", None)
        if rec:
            t = rec["t_failure_seen"]
            self.timeline.add("weight-sync", "aborted", t, t + rec["abort_s"], culprit=rec["culprit"],
                              survivors=sorted(rec["survivors"]), still_waiting=rec["still_waiting"])

    def _probe_engines(self, phase: str) -> dict[str, str]:
        """{name: cause} of engines that do not answer a short health check (dead or frozen)."""
        dead = {}
        refs = {n: e.health.remote() for n, e in self.engines.items()}
        for n, ref in refs.items():
            try:
                ray.get(ref, timeout=min(10.0, self.cfg.fault_tolerance.engine_stall_s))
            except Exception as e:
                dead[n] = f"no answer to a health check after {phase} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return dead

    def replace_dead_engines(self, wait: bool = False) -> list[str]:
        """Start a replacement on the same placement bundle for every engine the manager declared dead (while
        fault_tolerance.max_engine_restarts lasts), and re-plan the weight sync with every live engine. Returns the
        names of the replacements that joined; they take work only after a verified sync (`_synced_replacements`,
        `admit_ready`).

        A dedicated replacement starts beside the engines still serving: the run goes on with them (the sync re-planned
        without the dead one) and the replacement joins at the first sync after it is up (vLLM takes ~50 s to
        start). The driver waits for it with `wait`, when no engine is left, for a colocated one (it needs the GPU
        memory the trainers give up for its start), or with fault_tolerance.replacement_start "wait"."""
        dead = self._manager("take_dead")
        ft, replan = self.cfg.fault_tolerance, bool(dead)
        # A colocated replacement needs the GPU memory the trainers hold in the train phase (colocation.make_room).
        coloc = any(self.slots[n]["ecfg"].placement == "colocated" for n in dead if n in self.slots)
        moved = self.colocation.make_room() if coloc and ft.max_engine_restarts > self.engine_restarts else False
        for name, rec in dead.items():
            self.engines.pop(name, None)
            self.colocation.sleep_levels.pop(name, None)
            entry = {**rec, "replacement": None,   # the node it ran on (self.nodes: at start, or its replacement's)
                     "node": (self.nodes.get(f"engine-{self.slots.get(name, {}).get('base', name)}") or {}).get("node_id")}
            self.faults.append(entry)
            if self.engine_restarts >= ft.max_engine_restarts:
                logger.error("engine %s is dead and fault_tolerance.max_engine_restarts=%d is spent: going on with %s",
                             name, ft.max_engine_restarts, sorted(self.engines) or "no engine")
                continue
            self.engine_restarts += 1
            slot = self.slots[name]
            self._wait_for_slot(name, slot, entry)
            new_name = f"{slot['base']}.r{self.engine_restarts}"
            self.slots[new_name] = slot
            self.sampling[new_name] = self.sampling[name]
            entry["replacement_t"] = time.time()   # when the replacement was asked for
            actor = self._make_engine(new_name, self.engine_restarts)
            self.starting[new_name] = (actor, actor.device_ids.remote())
            entry["replacement"] = new_name
        if not self.engines and not self.starting:
            raise EngineError(f"every engine is dead and fault_tolerance.max_engine_restarts="
                              f"{ft.max_engine_restarts} is spent; last fault: {self.faults[-1]['engine']} "
                              f"({self.faults[-1]['cause']})")
        new = self._started(wait or coloc or not self.engines or ft.replacement_start == "wait")
        if moved:
            self.colocation.take_back()
        if not (replan or new):
            return []
        for n in new:
            self.nodes[f"engine-{self.slots[n]['base']}"] = get(self.engines[n].node.remote(), self.timeout, f"engine {n}'s node")
        info = get(self.coordinator.reconfigure.remote(self.engines), self.sync_timeout,
                   "weight-sync re-plan with the replacement engines", WeightSyncError)
        self.plan = info["plan"]
        logger.info("weight sync re-planned: %s%s%s", self.plan, f"; replacement engine(s) {new} up" if new else "",
                    f"; still starting: {sorted(self.starting)}" if self.starting else "")
        if self.cfg.rollout.openai_endpoint:   # the dead engine's endpoint is gone, a replacement serves its own
            self.write_endpoints()
        return new

    def _wait_for_slot(self, name: str, slot: dict, entry: dict) -> None:
        """On a multi-node cluster an engine may have died with its node: then Ray moves its placement slot to a live
        node that fits (nodes section), and the replacement must wait for that, or it would be put on the dead node
        and die at once. On one node there is nothing to wait for (a dead node would be the driver's own)."""
        node = entry.get("node")
        if not node or sum(1 for n in ray.nodes() if n.get("Alive")) < 2 or node_alive(node):
            return
        logger.warning("engine %s died with its node %s: waiting for Ray to place its slot on another node", name,
                       node[:12])
        entry["node_lost"] = True
        entry["moved_to"] = self.placement.wait_moved(slot["bundle"], node, self.timeout, f"engine {name}")

    def _started(self, wait: bool) -> list[str]:
        """Replacements that are up (all of them, waiting, with `wait`) move from `starting` to the live engines."""
        if not self.starting:
            return []
        refs = {ref: name for name, (_, ref) in self.starting.items()}
        up = list(refs) if wait else ray.wait(list(refs), num_returns=len(refs), timeout=0)[0]
        if not up:
            return []
        new = [refs[r] for r in up]
        get(up, self.timeout, f"replacement engines {new} to start", EngineError)
        for name in new:
            self.engines[name] = self.starting.pop(name)[0]
            self.unadmitted.append(name)
            if self.slots[name]["ecfg"].sleep_level:
                self.colocation.sleep_levels[name] = self.slots[name]["ecfg"].sleep_level
        return new

    def _synced_replacements(self, sync_out: dict) -> dict[str, float]:
        """After a sync: replacements whose first sync was verified become ready to take work (`admit_ready`, at
        the next batch: a colocated replacement must first get its KV cache in the hand-over to generate).
        Returns `fault/recovery_s` (seconds from the fault to this verified sync, the longest) when there were any."""
        names, self.unadmitted = [n for n in self.unadmitted if n in self.engines], []
        if names and sync_out.get("sync/checksum_ok") != 1.0 and self.cfg.weight_sync.verify:
            raise WeightSyncError(f"replacement engines {names}: first sync not verified")
        now, done = time.time(), []
        for f in self.faults:
            if f.get("replacement") in names:
                f.update(recovery_s=round(now - f["t"], 3), first_sync_verified=bool(sync_out.get("sync/checksum_ok") == 1.0),
                         first_sync_version=int(sync_out["sync/version"]))
                done.append(f["recovery_s"])
                logger.info("engine %s replaced by %s: synced and verified (v%d) %.1fs after the fault",
                            f["engine"], f["replacement"], f["first_sync_version"], f["recovery_s"])
        self.ready.extend(names)
        return {"fault/recovery_s": max(done)} if done else {}

    def admit_ready(self) -> None:
        """Verified replacements take work from the rollout manager (called before asking for a batch)."""
        names, self.ready = [n for n in self.ready if n in self.engines], []
        for n in names:
            params = sampling_params(self.sampling[n], self.cfg.algorithm.group_size)
            self._manager("add_engine", n, self.engines[n], params)
            for f in self.faults:
                if f.get("replacement") == n:
                    f["serving_t"] = time.time()
                    if "t_failure_seen" in f:   # a mid-sync death: from the failure to the replacement taking work
                        f["to_serving_s"] = round(f["serving_t"] - f["t_failure_seen"], 3)
