"""The weight transports by name, and the setup specs of a plan: the one table that names every transport.

`TRANSPORTS` maps a transport's name (what weight_sync/plan.py puts in a route) to its two sides. `setup_specs` turns a
plan's routes into what each member opens its side with (transport.py: the three-round handshake): a spec per
transport for every sending trainer rank and one (transport, spec) per engine, each made by its transport's
`SendSide.specs`. A new transport adds its line to `TRANSPORTS`; nothing else here names one.
This module starts nothing and does no I/O itself: `address_of` (the caller's) asks a rank for a rendezvous address.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from rlhf_orch.weight_sync.broadcast import BroadcastReceive, BroadcastSend
from rlhf_orch.weight_sync.ipc_stream import StreamReceive, StreamSend
from rlhf_orch.weight_sync.plan import EngineRoute
from rlhf_orch.weight_sync.transport import PlanFacts, ReceiveSide, SendSide

TRANSPORTS: dict[str, tuple[type[SendSide], type[ReceiveSide]]] = {
    send.name: (send, receive) for send, receive in ((StreamSend, StreamReceive), (BroadcastSend, BroadcastReceive))}


def sides(name: str) -> tuple[type[SendSide], type[ReceiveSide]]:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown weight transport {name!r}; known: {sorted(TRANSPORTS)}") from None


@dataclass
class SetupSpecs:
    senders: dict[int, dict[str, dict]] = field(default_factory=dict)      # trainer rank -> {transport: its spec}
    receivers: dict[str, tuple[str, dict]] = field(default_factory=dict)   # engine -> (transport, its spec)

    @property
    def held(self) -> set[str]:
        """Engines whose loads the coordinator checks, then resumes (`hold` in their spec)."""
        return {e for e, (_, spec) in self.receivers.items() if spec.get("hold")}


def setup_specs(routes: dict[str, EngineRoute], backend: str, verify: bool, checks: dict[str, bool],
                address_of: Callable[[int], tuple[str, int]]) -> SetupSpecs:
    """Every transport in the plan makes its members' specs from its routes. `checks[engine]`: whether the engine
    compares what it loads over its transport with the trainer's checksums itself; `address_of(rank)`: a
    (host, free port) on that trainer rank's node, asked only by transports with a rendezvous."""
    by_name: dict[str, list[EngineRoute]] = {}
    for route in routes.values():
        by_name.setdefault(route.transport, []).append(route)
    out = SetupSpecs()
    for name, rs in by_name.items():
        send = sides(name)[0]
        senders = {r.sender_rank for r in rs}
        if send.rendezvous and len(senders) != 1:
            raise ValueError(f"transport {name}: a rendezvous needs one sending rank, got {sorted(senders)}")
        address = address_of(next(iter(senders))) if send.rendezvous else None
        by_rank, by_engine = send.specs(rs, PlanFacts(backend, verify, dict(checks), address))
        for rank, spec in by_rank.items():
            out.senders.setdefault(rank, {})[name] = spec
        out.receivers.update({e: (name, spec) for e, spec in by_engine.items()})
    return out
