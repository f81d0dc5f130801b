"""Which nodes of a Ray cluster each role runs on: the `nodes` section, its checks, and label matching.

A run places its trainer ranks and engines through one placement group (driver/placement.py). On one machine
nothing here matters: every selector is empty and the strategy is PACK, exactly as before this section existed. On
a cluster, nodes carry labels (`ray start --labels=rlhf-role=trainer`, a KubeRay group's `labels`) and
the section names, per role, the labels a node must have:

  nodes:
    strategy: PACK                         # the placement group's: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
    trainer: {rlhf-role: trainer}          # every trainer rank's bundle (and so its colocated engines)
    engines: {rlhf-role: rollout}          # every dedicated engine, unless per_engine names it
    per_engine: {gen-b: {rlhf-node: b}}    # by engine entry name (engines[i].name, or <kind><i>)
    critic: {rlhf-role: trainer}           # separate critic ranks
    reference: {}                          # separate reference workers

Selector values follow Ray's label selectors: `v` (equal), `!v` (not equal), `in(a,b)`, `!in(a,b)`. A colocated
engine shares a trainer rank's device, so it runs on that rank's node: giving it labels of its own is refused, as
is giving labels to a colocated critic or reference. Whether some node of the cluster matches each selector is
checked once Ray is up (driver/placement.py, `unmatched`), before the placement group waits.

Pure: no Ray import. The weight-sync plan's locality rule (IPC only inside a node) is in weight_sync/plan.py.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from rlhf_orch.config.base import _Section

Selector = dict[str, str]
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_VALUE = r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"
_SELECTOR_VALUE = re.compile(rf"^!?({_VALUE}|in\(\s*{_VALUE}(\s*,\s*{_VALUE})*\s*\))$")
_KEY = re.compile(rf"^([A-Za-z0-9.-]+/)?{_VALUE}$")


def selector_problem(selector: Selector) -> str | None:
    for key, value in selector.items():
        if not _KEY.match(key):
            return f"label key {key!r} is not a Ray label name (letters, digits, '-', '_', '.'; an optional 'prefix/')"
        if not isinstance(value, str) or not _SELECTOR_VALUE.match(value):
            return (f"label {key}: {value!r} is not a Ray label selector value; use v, !v, in(a,b) or !in(a,b) "
                    "(quote it in YAML)")
    return None


class NodesSection(_Section):
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="The placement group's strategy: PACK (as few nodes as fit), SPREAD (across nodes, best "
        "effort), STRICT_PACK (one node), STRICT_SPREAD (every device slot on its own node).")
    trainer: Selector = Field(default_factory=dict, description="Node labels the trainer ranks' nodes must have "
                              "(Ray label selector; colocated engines follow their rank).")
    engines: Selector = Field(default_factory=dict, description="Node labels for every dedicated engine not in "
                              "per_engine.")
    per_engine: dict[str, Selector] = Field(default_factory=dict, description="Node labels by engine entry name "
                                            "(engines[i].name, or <kind><i>), for dedicated engines.")
    critic: Selector = Field(default_factory=dict, description="Node labels for separate critic ranks.")
    reference: Selector = Field(default_factory=dict, description="Node labels for separate reference workers.")

    @field_validator("trainer", "engines", "critic", "reference")
    @classmethod
    def _valid(cls, v: Selector) -> Selector:
        problem = selector_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("per_engine")
    @classmethod
    def _valid_each(cls, v: dict[str, Selector]) -> dict[str, Selector]:
        for name, sel in v.items():
            problem = selector_problem(sel)
            if problem:
                raise ValueError(f"{name}: {problem}")
        return v


def entry_name(i: int, e) -> str:
    """An engine entry's name as `per_engine` keys it (config.engine_names expands `count` below it)."""
    return e.name or f"{e.kind}{i}"


def engine_selector(cfg, i: int) -> Selector:
    e = cfg.engines[i]
    if e.placement == "colocated":
        return dict(cfg.nodes.trainer)
    return dict(cfg.nodes.per_engine.get(entry_name(i, e), cfg.nodes.engines))


def node_problems(cfg) -> list[str]:
    """Rules of the nodes section that need other sections; each names the field and the fix."""
    n, p = cfg.nodes, []
    names = {entry_name(i, e): e for i, e in enumerate(cfg.engines)}
    for key in n.per_engine:
        e = names.get(key)
        if e is None:
            p.append(f"nodes.per_engine.{key}: no engine entry has that name; use one of {sorted(names)}")
        elif e.placement == "colocated" and n.per_engine[key]:
            p.append(f"nodes.per_engine.{key}: engine {key!r} is colocated, so it shares a trainer rank's device and "
                     "runs on that rank's node (nodes.trainer); colocation across nodes is impossible: remove the "
                     "entry or set its placement: dedicated")
    for role in ("critic", "reference"):
        section = getattr(cfg, role)
        if getattr(n, role) and section.placement != "separate":
            p.append(f"nodes.{role}: the {role} is colocated (inside every trainer rank), so it runs on the trainer's "
                     f"nodes; remove nodes.{role} or set {role}.placement: separate")
    return p


def bundle_selectors(cfg) -> list[Selector]:
    """The label selector of every placement-group bundle, in resources.slot_gpus order: trainer ranks, then one per
    dedicated engine instance."""
    out = [dict(cfg.nodes.trainer) for _ in range(cfg.trainer.num_ranks)]
    for i, e in enumerate(cfg.engines):
        if e.placement == "dedicated":
            out.extend(engine_selector(cfg, i) for _ in range(e.count))
    return out


def matches(selector: Selector, labels: dict[str, str]) -> bool:
    """Whether a node with `labels` satisfies `selector` (Ray's semantics: every key's condition holds)."""
    for key, cond in selector.items():
        neg = cond.startswith("!")
        body = cond[1:] if neg else cond
        allowed = ([v.strip() for v in body[3:-1].split(",")] if body.startswith("in(") else [body])
        if (labels.get(key) in allowed) == neg:
            return False
    return True


def unmatched(cfg, node_labels: list[dict[str, str]]) -> list[str]:
    """One line per role whose selector no alive node satisfies (`node_labels`: each alive node's labels)."""
    roles = [("nodes.trainer", cfg.nodes.trainer)]
    for i, e in enumerate(cfg.engines):
        if e.placement == "dedicated":
            name = entry_name(i, e)
            field = f"nodes.per_engine.{name}" if name in cfg.nodes.per_engine else "nodes.engines"
            roles.append((field, engine_selector(cfg, i)))
    for role in ("critic", "reference"):
        if getattr(cfg, role).placement == "separate":
            roles.append((f"nodes.{role}", getattr(cfg.nodes, role)))
    seen = sorted({f"{k}={v}" for labels in node_labels for k, v in labels.items() if not k.startswith("ray.io/")})
    out = []
    for field, sel in roles:
        if sel and not any(matches(sel, labels) for labels in node_labels):
            out.append(f"{field}: no node of the Ray cluster has labels {sel} (the nodes' labels: "
                       f"{', '.join(seen) or 'none'}); start nodes with `ray start --labels` to match, or change {field}")
    return list(dict.fromkeys(out))
