"""Build and tear down everything a run needs: Ray, placement, trainer group, engines, reward
workers, the RolloutManager, the WeightSyncCoordinator and the metric sinks. `Cluster` is the driver's
single handle on the running system; launch.py calls its few verbs (start_rollouts, next_batch,
train, sync, checkpoint, close). The driver holds metadata and object references, never a step's tokens.
Its parts live beside it in driver/: checkpoints (find, write, restore, the engines' RNGs at step boundaries, the
reference snapshot), outputs (metric sinks, rollouts.jsonl, timeline, plots), recovery (a mixin: dead engines,
coordinator and manager replaced in place), the overlapped sync, colocation hand-overs, placement, evaluation.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import ray

from actors.common import actor_env, get
from actors.reward import start_reward_workers
from actors.roles import start_role_groups
from actors.rollout import RolloutActor
from actors.trainer import TrainerGroup
from driver.checkpoints import Checkpoints
from driver.colocation import Colocation
from driver.evaluation import run_eval
from driver.outputs import RunOutputs
from driver.overlap import OverlappedSync
from driver.placement import allocate
from driver.ray_session import init_ray
from driver.recovery import EngineRecovery
from rlhf_orch.config import engine_names
from rlhf_orch.config.checks import pause_mode
from rlhf_orch.config.engines import kind_of
from rlhf_orch.engines import hooks_from_env
from rlhf_orch.errors import EngineError, RewardError, RolloutError, WeightSyncError
from rlhf_orch.metrics.timeline import Timeline

logger = logging.getLogger(__name__)


def engine_env(env: dict, ecfg) -> dict:
    """An engine's own environment: `python_path` (SGLang's separate install, say) goes first on PYTHONPATH."""
    extra = getattr(ecfg, "python_path", None)
    if not extra:
        return env
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [extra, env.get("PYTHONPATH")]))}


class Cluster(EngineRecovery):
    @classmethod
    def start(cls, cfg, run_dir: Path, model_path: str, dataset, pad_id: int, restarting: bool = False) -> "Cluster":
        """Everything up and the sync plan made; on any failure, what was started is torn down first. `restarting`:
        after a fault, so placement waits for nodes that may be joining (driver/placement.allocate)."""
        self = cls()
        self.restarting = restarting
        self.cfg, self.run_dir, self.timeout = cfg, Path(run_dir), cfg.ray.get_timeout_s
        self.placement = None
        self.trainers, self.coordinator, self.engines, self.rewarders = None, None, {}, []
        self.coordinator_restarts = self.manager_restarts = 0   # replaced in place (driver/recovery.py)
        self.served_step, self.boundary_state = 0, {}   # the manager's last batch, and its state after it
        self.ledger_base: dict = {}         # the ledger of earlier segments and of dead managers (whole_run_ledger)
        self.references = self.critics = None   # separate role groups (actors/roles.py), when configured
        self.rollouts, self.final_ledger = None, {}
        self.faults: list[dict] = []        # engine faults and what was done about them (summary.json)
        self.starting: dict = {}            # replacements not up yet: name -> (actor, its device_ids ref)
        self.unadmitted: list[str] = []     # replacements up, waiting for their first verified sync
        self.ready: list[str] = []          # replacements synced and verified, to be given work at the next batch
        self._eval_handover: dict = {}      # an evaluation's hand-over to generate: reported with the next step's
        self.engine_restarts = 0
        self.nodes: dict = {}               # actor -> {"node_id", "ip"} at start (locate)
        self.timeline = Timeline()
        self.checkpoints = Checkpoints(cfg, self.run_dir, model_path, self.timeline)   # find, write, restore
        self.outputs = RunOutputs(cfg, self.run_dir, self.timeline)   # sinks, rollouts.jsonl, timeline, plots
        r = cfg.rollout
        self.pause_mode = pause_mode(cfg, r)
        self.max_staleness = r.max_staleness   # of the steps being served (a benchmark changes it per segment)
        self.overlap = OverlappedSync(self)    # weight_sync.overlap (driver/overlap.py)
        self.colocation: Colocation | None = None
        try:
            self._build(model_path, dataset, pad_id)
        except BaseException:
            self.close([], {})
            raise
        return self

    def _build(self, model_path: str, dataset, pad_id: int) -> None:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
        init_ray(cfg)   # or join the cluster / the Ray already up; launch.py stops a Ray started here
        for e in cfg.engines:   # what an engine kind needs of every process, before any starts (SGLang: NCCL's cuMem)
            for k, v in kind_of(e).driver_env.items():
                os.environ.setdefault(k, v)
        if not cfg.resume:
            self.checkpoints.clear_snapshots()   # an earlier run's step snapshots: stale for this one
        state = self.checkpoints.find() if cfg.resume else None   # read once
        if state is not None:
            self.ledger_base = state.get("rollout", {}).get("ledger", {})
        self.outputs.open(None if state is None else state["step"])   # records after the checkpoint dropped
        name, device = cfg.experiment.name, cfg.trainer.device
        wait = (cfg.fault_tolerance.node_wait_s or self.timeout) if self.restarting else self.timeout
        self.placement = allocate(cfg, wait, wait_for_nodes=self.restarting)
        self.trainers = TrainerGroup(self.placement, device, name, self.timeout)
        env = actor_env(device)
        self.sampling, sleep_levels = {}, {}
        self.env, self.model_path, self.slots = env, model_path, {}
        names = iter(engine_names(cfg))
        for entry, ecfg in enumerate(cfg.engines):
            for _ in range(ecfg.count):
                ename = next(names)
                self.slots[ename] = {"ecfg": ecfg, "bundle": self.placement.engine_bundles[ename][0],
                                     "index": len(self.slots), "base": ename, "entry": entry}
                self.engines[ename] = self._make_engine(ename)
                self.sampling[ename] = ecfg.sampling
                sleep_levels[ename] = ecfg.sleep_level
        # builds builtin:tiny-rm first; a GPU only for reward.device cuda; the manager replaces one that dies
        self.rewarders, reward_workers = start_reward_workers(cfg, name, env)
        # The coordinator's and the manager's processes start now, beside the others (their constructors call no
        # actor), not after the engines and ranks are up: a 2-step tiny_cpu run 29.6 -> 28.1 s (median of 6) on 2 cores.
        self._manager_args = (dataset, pad_id, reward_workers)   # the manager reads its sections of cfg
        self._start_manager(f"{name}-rollouts")
        self.coordinator = self._new_coordinator(f"{name}-weight-sync")   # close() kills it if the start fails
        # Engines first where they share GPUs with trainer ranks: vLLM sizes its memory from what is free when it
        # starts, and a colocated trainer allocating meanwhile would skew that; then colocated engines sleep while
        # the trainer starts. Elsewhere (CPU, or dedicated engines only) the ranks start beside the engines.
        t0 = time.perf_counter()
        together = device == "cpu" or all(e.placement == "dedicated" for e in cfg.engines)
        trainers_starting = self.trainers.init_async(model_path, cfg) if together else None

        def stage(what: str) -> None:   # the minutes of a cluster's start are not silent
            logger.info("%s (%.0f s since Ray was up)", what, time.perf_counter() - t0)
        get([e.device_ids.remote() for e in self.engines.values()], self.timeout, "engines to start", EngineError)
        stage(f"engines up: {', '.join(self.engines)}")
        if cfg.rollout.openai_endpoint:
            self.write_endpoints()
        self.colocation = Colocation(self.trainers, self.engines, sleep_levels, cfg.trainer.offload, device, self.timeout)
        self.colocation.start()
        self.trainers.init(model_path, cfg, trainers_starting)   # each rank builds its model from the typed config
        stage(f"{cfg.trainer.num_ranks} trainer rank(s) up (DeepSpeed ZeRO-{cfg.trainer.zero_stage})")
        # A separate reference loads at snapshot_reference; a separate critic now.
        self.references, self.critics = start_role_groups(cfg, name, env, self.timeout, model_path)
        self.colocation.wake_weights()      # receivers are built into awake weights; the KV cache stays freed
        get([r.score.remote([]) for r in self.rewarders], self.timeout, "reward workers to start", RewardError)
        self._start_coordinator(f"{name}-weight-sync", self.coordinator)
        stage("reward workers up, weight-sync groups made")
        logger.info("cluster up: %d trainer ranks, engines %s, sync plan %s", cfg.trainer.num_ranks, list(self.engines), self.plan)
        self.nodes = self.locate()              # kept current: a replacement's node replaces its slot's
        self.nodes_at_start = dict(self.nodes)
        # One trainer (or separate critic) rank per node other than the driver's uploads and fetches that node's
        # checkpoint files (storage_uri).
        here, seen = ray.get_runtime_context().get_node_id(), set()
        ranks = [(f"trainer-{r}", a) for r, a in enumerate(self.trainers.actors)]
        ranks += [(f"critic-{i}", a) for i, a in enumerate(self.critics.actors if self.critics else [])]
        for who, actor in ranks:
            node = (self.nodes.get(who) or {}).get("node_id")
            if node and node != here and node not in seen:
                seen.add(node)
                self.checkpoints.remote_nodes.append(actor)
        by_node: dict = {}
        for who, where in self.nodes.items():
            by_node.setdefault(f"{where['node_id'][:8]} ({where['ip']})" if where else "unknown", []).append(who)
        logger.info("placement by node: %s", "; ".join(f"{n}: {', '.join(w)}" for n, w in by_node.items()))

    def locate(self) -> dict:
        """{actor: {"node_id", "ip"}} of every actor of the run that answers within 10 s (None for one that does
        not): summary.json's `nodes`, and where a fault happened."""
        actors = {f"trainer-{r}": a for r, a in enumerate(self.trainers.actors if self.trainers else [])}
        actors.update({f"engine-{self.slots.get(n, {}).get('base', n)}": a for n, a in self.engines.items()})
        for group in (self.references, self.critics):
            actors.update({f"{group.role}-{i}": a for i, a in enumerate(group.actors)} if group else {})
        actors.update({f"reward-{i}": a for i, a in enumerate(self.rewarders)})
        actors.update({"weight-sync": self.coordinator, "rollout-manager": self.rollouts})
        refs = {who: a.node.remote() for who, a in actors.items() if a is not None}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=10.0)
        out = {}
        for who, ref in refs.items():
            try:
                out[who] = ray.get(ref, timeout=0) if ref in ready else None
            except Exception:   # died meanwhile
                out[who] = None
        return out

    def _make_engine(self, ename: str, restart: int = 0):
        """The rollout actor of slot `ename` on its placement bundle. A replacement (restart >= 1) gets a sampling
        seed derived from its slot and restart count, so a rerun of the same faults samples the same."""
        cfg, slot = self.cfg, self.slots[ename]
        ecfg, bundle = slot["ecfg"], slot["bundle"]
        seed = cfg.experiment.seed + 1000 * (slot["index"] + 1) + 7919 * restart
        opts = self.placement.options(bundle, f"{cfg.experiment.name}-engine-{ename}", engine_env(self.env, ecfg))
        return RolloutActor.options(**opts).remote(ename, ecfg, cfg.trainer.device, self.placement.device_id(bundle),
                                                   self.model_path, cfg.model.dtype, seed, hooks_from_env(slot["entry"]),
                                                   cfg.rollout, cfg.data.agent_key)

    def write_endpoints(self) -> None:
        """rollout.openai_endpoint: each engine's OpenAI-compatible endpoint, logged and in openai_endpoints.json
        (agents reach theirs through client.base_url; the file is for people and tools that watch the run)."""
        urls = dict(zip(self.engines, get([e.endpoint_url.remote() for e in self.engines.values()], self.timeout,
                                          "engines' endpoints", EngineError)))
        (self.run_dir / "openai_endpoints.json").write_text(json.dumps(urls, indent=2))
        for name, url in urls.items():
            logger.info("engine %s: OpenAI-compatible endpoint %s (per sample: %s/s/<key>/v1)", name, url, url)

    # ---- rollouts (the manager owns them; the driver holds metadata and object refs) -----------------
    def _rget(self, ref, what: str, timeout: float | None = None):
        return get(ref, timeout or self.timeout, what, RolloutError)

    def start_rollouts(self, first_step: int, version: int, resumed: dict | None, last_step: int | None = None,
                       **overrides) -> None:
        """The manager serves steps first_step..last_step (default: the run's last) with engines at `version`; a
        resumed run's untrained draws first. `overrides`: rollout fields for these steps (benchmarks)."""
        pending = (resumed or {}).get("rollout", {}).get("pending")
        if resumed:
            self._manager("restore_data", resumed["data"])
        rollout = None
        if overrides:   # the rollout section for these steps
            r = self.cfg.rollout   # a running_requests the user did not set is "auto" again, for these steps
            auto = {} if "running_requests" in r.model_fields_set else {"running_requests": "auto"}
            rollout = r.model_copy(update={**auto, **overrides})
            self.max_staleness = rollout.max_staleness
            self.pause_mode = pause_mode(self.cfg, rollout)
        self._manager_plan = (last_step or self.cfg.experiment.steps, rollout)
        self._rget(self.rollouts.start.remote(first_step, self._manager_plan[0], version, pending, rollout),
                   "rollout manager to start")
        self.served_step = first_step - 1   # the manager's state from here, for a replacement (driver/recovery.py)
        self.boundary_state = self._manager("state")
        self.step_boundary()

    def next_batch(self, step: int):
        """(metadata, per-rank object refs) of step `step`; tells the manager the engines hold version step-1 (it
        may start groups that need it: with max_staleness 0, this step's) and waits for the step's groups. If every
        engine died meanwhile, replacements get the trainer's weights (still version step-1) and the wait goes on."""
        while True:
            self.admit_ready()                # replacements verified since the last batch, now awake
            ref = self.rollouts.next_batch.remote(step, self.timeout)
            self.overlap.wait_for(ref)        # a failed overlapped sync holds its engines paused: recover it now
            try:
                meta, refs = self._rget(ref, f"the batch of step {step}", self.timeout + 30)
            except RolloutError as err:       # a dead manager is replaced in place, and asked again
                if not self._manager_died(err, mid_batch=True):
                    raise
                continue
            if "need_engines" not in meta:
                self.served_step, self.boundary_state = step, meta["state"]
                break
            logger.warning("no live engine for step %d (dead: %s): replacing now", step, meta["need_engines"])
            self.replace_dead_engines(wait=True)   # before any hand-over: the dead one must not be asked to sleep
            self.colocation.to_train()        # colocated: the trainer's weights must be on its device to send
            self.sync(step - 1, resync=True)
            self.colocation.to_generate()
        self.timeline.extend(meta.pop("events"))
        self.faults.extend(meta.pop("faults", []))   # reward workers the manager replaced in place
        return meta, refs

    def train(self, meta: dict, refs: list) -> dict:
        extra = None
        # A critic group's values are computed while the reference group computes its logprobs.
        values = self.critics.values_refs(refs) if self.critics is not None else None
        if self.references is not None:   # the separate reference group first: the ranks wait for its logprobs
            with self.timeline.span("reference", "logprobs"):
                extra = self.references.logprobs_refs(refs)
        with self.timeline.span("trainer", "train"):
            if values is None:
                out = self.trainers.step_shards("train_step", refs, meta["tokens"], extra)
            else:
                out = self.trainers.step_with_critic(refs, meta["tokens"], extra, self.critics, values,
                                                     self.cfg.critic.warmup_steps)
        return {**out, **self.colocation.after_train(out)}   # trainer.offload auto: the plan, chosen after step 1

    def log_rollouts(self, step: int, meta: dict) -> None:
        self.outputs.log_rollouts(step, meta)

    def to_generate(self, version: int) -> dict:
        """Colocation: trainers offload, sleeping engines take their KV cache back (no-op otherwise). An engine
        found dead here is replaced and given `version` (the trainer's current weights) before generation."""
        early, self._eval_handover = self._eval_handover, {}   # done before an evaluation (evaluate): this step's
        try:
            return {**early, **self.colocation.to_generate()}
        except EngineError as err:
            if not self._engines_died(err, "the hand-over to generate"):
                raise
            self.colocation.to_train()
            self.sync(version, resync=True)
            return self.colocation.to_generate()

    def evaluate(self, eval_set, step: int) -> dict:
        """`eval/` metrics of the engines' weights (version `step`, after the step's sync) on `eval_set`
        (driver/evaluation.py). Colocated engines get their GPU first (the next step's hand-over, done early; with
        max_staleness 0 the manager generates nothing until the next step asks for its batch)."""
        self.overlap.finish_early()   # the engines must hold version `step` (weight_sync.overlap)
        self._eval_handover.update(self.to_generate(step))
        with self.timeline.span("driver", "eval", step=step):
            return run_eval(self, eval_set, step)

    def to_train(self) -> dict:
        """Colocation: engines sleep, trainers reload (no-op otherwise). A dead engine is replaced (its replacement
        gets weights at the step's sync)."""
        try:
            return self.colocation.to_train()
        except EngineError as err:
            if not self._engines_died(err, "the hand-over to train"):
                raise
            return self.colocation.to_train()

    def sync(self, version: int, resync: bool = False) -> dict:
        """Push the trainer's weights into every engine as `version` (in the train phase). Dead engines are
        replaced first (the replacements' first sync is this one, verified like every other); an engine that
        dies during the sync is found, replaced, and the sync is done again once."""
        self.overlap.finish_early()   # an overlapped one first (a re-sync for replacements may come during one)
        self.replace_dead_engines()
        try:
            wake = self.colocation.wake_weights()
        except EngineError as err:
            if not self._engines_died(err, f"waking weights for sync v{version}"):
                raise
            wake = self.colocation.wake_weights()
        with self.timeline.span("weight-sync", "sync", version=version):
            try:
                out = self._sync_once(version, resync)
            except WeightSyncError as err:
                self._sync_aborted(err)
                if not (self._coordinator_died(err, version) or self._engines_died(err, f"weight sync v{version}")):
                    raise
                out = self._sync_once(version, True)   # once more, with the replacements
        recovered = self._synced_replacements(out)
        coloc = {} if resync else self.colocation.step_metrics()   # the step's hand-overs: seconds and GiB moved
        return {**out, **wake, **recovered, **coloc, "fault/engines_live": float(len(self.engines)),
                "fault/engine_restarts": float(self.engine_restarts)}

    def _sync_once(self, version: int, resync: bool, staged: bool = False) -> dict:
        return get(self.coordinator.sync.remote(version, self.pause_mode, resync, staged), self.sync_timeout,
                   f"weight sync v{version}", WeightSyncError)

    def sync_step(self, version: int) -> dict:
        """The sync after step `version`'s update: whole, or overlapping the next step (driver/overlap.py)."""
        return self.overlap.step(version) if self.overlap.wanted() else self.sync(version)

    def checkpoint(self, step: int, rollout_state: dict, snapshot: bool = False) -> dict:
        """Checkpoint `step` (driver/checkpoints.py; `snapshot`: a step snapshot); `rollout_state` is the manager's
        state after it. Returns its seconds and gigabytes."""
        self.to_train()   # after an evaluation colocated engines hold the GPU: the trainers' states come back first
        return self.checkpoints.write(step, rollout_state, self._whole_ledger(rollout_state["ledger"]), self.trainers,
                                      self.critics, self.engines, self.slots, self.timeout, snapshot)

    def step_boundary(self) -> None:
        """The engines' sampling RNGs as this step leaves them (what its checkpoint holds; driver/checkpoints.py)."""
        self.checkpoints.step_boundary(self.engines, self.slots, self.timeout)

    def restore(self) -> dict | None:
        """Load the checkpoint found at start into the trainers and engines' RNGs; None if there was none."""
        return self.checkpoints.restore(self.trainers, self.critics, self.engines, self.timeout)

    def snapshot_reference(self, resumed: bool) -> None:
        self.checkpoints.snapshot_reference(resumed, self.trainers, self.references)

    def _shutdown_actors(self) -> None:
        """Engines leave the broadcast group, then trainers (and a critic group) leave theirs together, then all are
        killed."""
        trainers = self.trainers.actors if self.trainers is not None else []
        critics = self.critics.actors if self.critics is not None else []
        for what, actors in (("engines", list(self.engines.values())), ("trainers", trainers), ("critics", critics)):
            try:
                ray.get([a.shutdown.remote() for a in actors], timeout=30)
            except Exception as e:   # a dead actor cannot shut down cleanly; killing it below is enough
                logger.warning("clean shutdown of %s failed: %s", what, e)
        references = self.references.actors if self.references is not None else []
        starting = [a for a, _ in self.starting.values()]   # replacements still starting
        for a in [*self.engines.values(), *starting, *trainers, *critics, *references, *self.rewarders,
                  *([self.coordinator] if self.coordinator else [])]:
            ray.kill(a)

    def _trainers_alive(self) -> bool:
        """A checkpoint needs every rank (a critic group's too): with one dead the others would wait in a collective
        until its timeout."""
        critics = self.critics.actors if self.critics is not None else []
        try:
            ray.get([t.health.remote() for t in [*self.trainers.actors, *critics]], timeout=15)
            return True
        except Exception as e:
            logger.warning("no final checkpoint: a trainer rank does not answer (%s); the latest one stays in charge",
                           str(e).splitlines()[0][:200])
            return False

    def close(self, records: list[dict], rollout_state: dict | None) -> None:
        """Always runs: final checkpoint if the trainers are alive, plots, sinks closed, placement released.
        `rollout_state` is the manager's state after the last completed step (what a resume needs); None writes no
        final checkpoint (launch.run: the trainers may already hold a later, unfinished step)."""
        self.overlap.abandon()   # a transfer under way ends before its members are shut down
        try:
            if records and self.colocation is not None:
                self.colocation.to_train()   # a run failing mid-generate: give the trainer its GPU back first
        except Exception as e:
            logger.warning("could not put engines to sleep before the final checkpoint: %s", str(e).splitlines()[0])
        try:
            if records and rollout_state and self._trainers_alive():
                self.checkpoint(int(records[-1]["step"]), rollout_state)
        except Exception as e:  # a dead trainer must not hide the metrics already written
            logger.warning("final checkpoint failed: %s", e)
        self._stop_rollouts()
        self._shutdown_actors()
        self.outputs.close(records)
        try:
            if self.placement is not None:
                self.placement.release()
        except Exception:
            pass
        # Ray itself stays up: launch.py writes summary.json first, then calls stop_ray (see driver/ray_session.py).
