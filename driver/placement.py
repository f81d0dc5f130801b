"""Place trainer ranks and engines on devices with one Ray placement group.

One bundle per device slot: a GPU (with a CPU) on CUDA, a small CPU share on CPU. Trainer rank r
takes bundle r; a colocated engine shares a trainer rank's bundle (and so its GPU); a dedicated
engine takes one bundle of its own holding `tensor_parallel_size` GPUs, so its actor sees exactly those
GPUs (Ray sets CUDA_VISIBLE_DEVICES to them) and the engine starts its TP workers as its own
subprocesses. Actors sharing a bundle split its resources, which is what makes Ray put them on the
same GPU. On CPU a bundle stands in for a device: its index is the device id the weight-sync plan
compares.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rlhf_orch.config import ExperimentConfig, engine_names
from rlhf_orch.config.nodes import bundle_selectors, unmatched
from rlhf_orch.errors import ConfigError, EngineError

from rlhf_orch.resources import CPU_SLOT, bundle_resources, fit_problem   # CPU_SLOT: 0.25 logical CPUs per CPU slot

logger = logging.getLogger(__name__)


@dataclass
class Placement:
    pg: object
    device: str
    trainer_bundles: list[int]
    engine_bundles: dict[str, list[int]]
    sharing: dict[int, int] = field(default_factory=dict)    # bundle -> number of actors in it
    gpus: dict[int, int] = field(default_factory=dict)       # bundle -> GPUs in it (1 unless a TP engine's)

    def options(self, bundle: int, name: str, env: dict) -> dict:
        share = 1.0 / self.sharing.get(bundle, 1)
        opts = {
            "name": name,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
            "runtime_env": {"env_vars": env},
        }
        if self.device == "cuda":
            opts.update(num_gpus=self.gpus.get(bundle, 1) * share, num_cpus=share)
        else:
            opts.update(num_cpus=CPU_SLOT * share)
        return opts

    def device_id(self, bundle: int) -> str:
        """The CPU stand-in for a device id (GPU actors report their GPU's UUID instead)."""
        return f"{self.pg.id.hex()[:8]}/cpu-slot{bundle}"

    def release(self) -> None:
        remove_placement_group(self.pg)

    def bundle_node(self, bundle: int) -> str:
        """The node Ray has bundle `bundle` on now ('' while it is being placed again after its node died)."""
        return placement_group_table(self.pg).get("bundles_to_node_id", {}).get(bundle, "")

    def wait_moved(self, bundle: int, lost_node: str, timeout_s: float, what: str) -> str:
        """After `lost_node` died: wait until Ray has placed `bundle` again on a live node (it does so by itself on a
        node whose labels and free resources fit), and return that node. Raises EngineError naming the node and the
        fix when no node takes it within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            node = self.bundle_node(bundle)
            if node and node != lost_node:
                return node
            time.sleep(0.2)
        raise EngineError(f"{what}: its node {lost_node[:12]} is gone and no other node with the labels and free "
                          f"resources of its slot took it within {timeout_s:.0f}s; add a node (`ray start --address ... "
                          "--labels`) or widen the nodes section's selector")


@ray.remote(num_cpus=0)
def _probe() -> int:
    return 1


def node_alive(node_id: str, timeout_s: float = 10.0) -> bool:
    """Whether `node_id`'s raylet still runs work: a tiny task pinned to it. Ray's own view of a node (ray.nodes())
    lags its death by seconds, in which a replacement put on it would die again; a node that fails the probe is dead
    (or too far gone to host anything)."""
    if not node_id:
        return False
    try:
        return ray.get(_probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(),
                       timeout=timeout_s) == 1
    except Exception:
        return False


def allocate(cfg: ExperimentConfig, timeout_s: float, wait_for_nodes: bool = False) -> Placement:
    """The run's placement group, ready. `wait_for_nodes` (a restart after a fault, which may have taken a node with
    it): a cluster that lacks the nodes or resources the run needs is waited on for up to `timeout_s`, as a replacement
    node may be joining, instead of refused at once."""
    n = cfg.trainer.num_ranks
    trainer_bundles = list(range(n))
    engine_bundles: dict[str, list[int]] = {}
    gpus = [1] * n                     # GPUs per bundle (CUDA runs)
    next_colocated = 0
    names = iter(engine_names(cfg))
    for e in cfg.engines:
        for _ in range(e.count):
            name = next(names)
            if e.placement == "colocated":
                engine_bundles[name] = [next_colocated]
                next_colocated += 1
            else:
                engine_bundles[name] = [len(gpus)]
                gpus.append(e.tensor_parallel_size)
    cuda = cfg.trainer.device == "cuda"
    bundles = bundle_resources(cfg)   # the same slots as above, in the same order
    problem = cluster_fit_problem(cfg)
    deadline, said = time.monotonic() + timeout_s, 0.0
    while problem and wait_for_nodes and time.monotonic() < deadline:
        if time.monotonic() - said > 30:
            logger.warning("restart waits for the cluster (up to %.0fs, fault_tolerance.node_wait_s): %s", timeout_s,
                           problem)
            said = time.monotonic()
        time.sleep(1.0)
        problem = cluster_fit_problem(cfg)
    if problem:   # at once: a placement group that can never fit would only time out after timeout_s
        raise ConfigError(problem)
    selectors = bundle_selectors(cfg)   # node labels per bundle (the nodes section); none on one machine
    pg = placement_group(bundles, strategy=cfg.nodes.strategy, name=f"{cfg.experiment.name}-pg",
                         bundle_label_selector=selectors if any(selectors) else None)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        problem = cluster_fit_problem(cfg)   # again: a node lost meanwhile (Ray's view lags a death by seconds)
        if problem:
            raise ConfigError(problem)
        need = sum(gpus) if cuda else len(gpus) * CPU_SLOT
        key = "GPU" if cfg.trainer.device == "cuda" else "CPU"
        raise ConfigError(f"placement: the run needs {need:g} {key}s ({n} trainer ranks + dedicated engines); the "
                          f"cluster has {ray.cluster_resources().get(key, 0):g} but only "
                          f"{ray.available_resources().get(key, 0):g} were free within {timeout_s:.0f}s (other jobs or "
                          "a run left running hold the rest); stop them, or lower trainer.num_ranks or the engines' count")
    sharing: dict[int, int] = {}
    for b in trainer_bundles + [b for bs in engine_bundles.values() for b in bs]:
        sharing[b] = sharing.get(b, 0) + 1
    return Placement(pg, cfg.trainer.device, trainer_bundles, engine_bundles, sharing, dict(enumerate(gpus)))


def cluster_fit_problem(cfg: ExperimentConfig) -> str | None:
    """Whether the Ray this driver is connected to (local or a cluster) has the CPUs and GPUs the run's bundles
    need in total, and a node wide enough for its widest bundle. Resources other jobs hold are not counted against
    it: those free up, so allocate() waits for them."""
    total = ray.cluster_resources()
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    widest = max((r.get("GPU", 0.0) for r in nodes), default=0.0)
    where = f"the Ray cluster ({len(nodes)} node{'s' * (len(nodes) != 1)}: {total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs)"
    problem = fit_problem(cfg, total.get("CPU", 0.0), total.get("GPU", 0.0), where, widest if nodes else None)
    labels = [n.get("Labels", {}) for n in ray.nodes() if n.get("Alive")]
    lines = ([problem] if problem else []) + unmatched(cfg, labels)
    slots = len(bundle_resources(cfg))
    if cfg.nodes.strategy == "STRICT_SPREAD" and slots > len(nodes):
        lines.append(f"nodes.strategy: STRICT_SPREAD puts each of the run's {slots} device slots on its own node but "
                     f"{where} has {len(nodes)}; use SPREAD or PACK, or add nodes")
    return "\n".join(lines) or None
