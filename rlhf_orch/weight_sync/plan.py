"""Choose, once per run, how each engine receives weights, from where the processes actually sit.

Every trainer rank and every engine worker reports a device id: a GPU's UUID on CUDA, or on CPU the
placement slot it was given ("<node>/cpu-slot<k>", the stand-in for a device). A single-worker engine
that sits on a trainer rank's device gets `ipc` from that rank (a tensor-parallel engine spans devices
that no one rank holds, so it is fed by broadcast); any other engine
gets `broadcast` through the one group of trainer rank 0 plus all broadcast-engine workers. IPC (CUDA IPC, or
shared memory on CPU) works only between processes of one node, so where the actors report their Ray nodes an
engine gets `ipc` only from a rank on its own node, whatever the device ids say (on a multi-node cluster a config
that forces ipc across nodes is refused, naming both nodes).
`transport` in the config may force one (with checks). This module is pure: no processes, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from rlhf_orch.errors import ConfigError


@dataclass(frozen=True)
class EngineRoute:
    engine: str
    transport: str                 # "ipc" or "broadcast"
    sender_rank: int               # trainer rank that sends to this engine
    group_ranks: tuple[int, ...] = ()   # broadcast: this engine's workers' ranks in the group


def feeds(routes: Iterable[EngineRoute]) -> dict[int, list[str]]:
    """Trainer rank -> the engines it sends to, over these routes."""
    out: dict[int, list[str]] = {}
    for r in routes:
        out.setdefault(r.sender_rank, []).append(r.engine)
    return out


def group_size(routes: Iterable[EngineRoute]) -> int:
    """Members of one group over these routes: rank 0 and every engine worker (0 when there are none)."""
    workers = sum(len(r.group_ranks) for r in routes)
    return workers + 1 if workers else 0


@dataclass
class SyncPlan:
    routes: dict[str, EngineRoute]

    @property
    def broadcast_engines(self) -> list[str]:
        return [r.engine for r in self.routes.values() if r.transport == "broadcast"]

    @property
    def group_world_size(self) -> int:
        """The broadcast group's size; 0 when no engine uses broadcast."""
        return group_size(r for r in self.routes.values() if r.transport == "broadcast")

    @property
    def ipc_targets(self) -> dict[int, list[str]]:
        """Trainer rank -> the engines it feeds over ipc."""
        return feeds(r for r in self.routes.values() if r.transport == "ipc")

    def summary(self) -> dict[str, str]:
        return {name: f"{r.transport} from trainer rank {r.sender_rank}" for name, r in self.routes.items()}


def make_plan(trainer_devices: list[str], engine_devices: dict[str, list[str]], transport: str = "auto",
              trainer_nodes: list[str] | None = None, engine_nodes: dict[str, str] | None = None) -> SyncPlan:
    """`trainer_devices[r]` is rank r's device id; `engine_devices[name]` lists that engine's workers' ids.
    `trainer_nodes[r]` / `engine_nodes[name]`: the Ray node ids they run on (None: not known, one node assumed)."""
    if transport not in ("auto", "ipc", "broadcast"):
        raise ConfigError(f"weight_sync.transport: unknown value {transport!r}; use auto, ipc or broadcast")
    where = {dev: rank for rank, dev in enumerate(trainer_devices)}
    routes: dict[str, EngineRoute] = {}
    next_rank = 1
    problems = []
    for name, devs in engine_devices.items():
        colocated = len(devs) == 1 and devs[0] in where
        if colocated and trainer_nodes and engine_nodes and engine_nodes.get(name) != trainer_nodes[where[devs[0]]]:
            if transport == "ipc":
                problems.append(f"weight_sync.transport: ipc forced, but engine {name!r} runs on node "
                                f"{str(engine_nodes.get(name))[:12]} and its trainer rank {where[devs[0]]} on node "
                                f"{trainer_nodes[where[devs[0]]][:12]}; IPC works inside one node only: use auto or "
                                "broadcast")
                continue
            colocated = False
        if transport == "ipc" and not colocated:
            problems.append(f"weight_sync.transport: ipc forced, but engine {name!r} does not share a trainer "
                            "device; use auto or broadcast")
            continue
        if colocated and transport != "broadcast":
            routes[name] = EngineRoute(name, "ipc", where[devs[0]])
        else:
            ranks = tuple(range(next_rank, next_rank + len(devs)))
            next_rank += len(devs)
            routes[name] = EngineRoute(name, "broadcast", 0, ranks)
    if problems:
        raise ConfigError(problems)
    return SyncPlan(routes)


def sync_deadline_s(nbytes: int, configured: float | None) -> float:
    """weight_sync.timeout_s, or a deadline that fits the work: 60 s of fixed costs plus 10 s per GB (a sync slower
    than 0.1 GB/s, ~100x below any link we run on, is a hang)."""
    return float(configured) if configured else 60.0 + 10.0 * nbytes / 1e9
