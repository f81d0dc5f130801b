"""Which prompt group runs where and when, under a staleness bound; and the ledger of every draw.

A *group* is one prompt and its `group_size` samples. It is drawn once, dispatched whole to one engine
(so the engine's prefix cache serves the group), scored, and then either trained on exactly once,
filtered (dynamic sampling: all rewards equal), or still queued/running/buffered when the run ends. Once the
draws allowed by `filter_max_draws` are spent, equal-reward groups are kept (and counted as `kept_over_cap`)
rather than leaving a step without a batch.

Versions. Step s trains policy version s-1 (the weights synced after step s-1). A group admitted while the
engines hold version u may be trained by steps s with (s-1) - u <= max_staleness, so its *deadline* is
u + max_staleness + 1. Admission keeps the number of live (not filtered) groups since the first step at most
(min(u + k + 1, last_step) - first_step + 1) * prompts_per_step; so no step ever has more than a batch of
groups whose deadline is due. The batch for step s holds every group due by s (it waits for them) and is
filled up to prompts_per_step with the oldest finished groups. With max_staleness 0 every group of step s is
admitted after sync s-1 and is due at s: exactly the synchronous loop, in draw order.

Partial rollouts (`deadline_slack`, rollout.partial_extra_lag): a group's requests run on through the syncs, so a
group may be trained up to `deadline_slack` steps after its deadline: a step no longer waits for a long group
(at max_staleness k a group otherwise has about k train steps to finish, so no step is shorter than its longest
group's latency / k; bench/RESULTS.md, ninth and twelfth sessions). The tokens such a group sampled before the
syncs it ran through lag up to k + slack versions; batching checks that bound on every token. A step that trained
without a late group took one of the next step's early, so the late group's place goes back to the admission
budget (`overdue`) until the horizon reaches the last step. No deadline passes the run's (or segment's) last step: it
trains every group admitted for it.

Dispatch is load-aware: queued groups go out in draw order, in chunks of `dispatch_groups`, each chunk to the
engine with the fewest outstanding samples.

Deterministic mode (rollout.deterministic, for max_staleness >= 1 runs reproducible from a seed): nothing here may
depend on which call returned first. A step's batch is the oldest live groups in draw (gid) order, at least
prompts_per_step and every due one, and it waits until all of them are scored (`select_batch`); chunks go to the
engines in a fixed rotation, not to the least loaded (`plan_dispatch`); and the manager admits only at points where
every earlier group has settled (`settled`), so draws, versions and deadlines are the same in every run. The
manager's part (calls served in dispatch order, seeds per group, syncs after the calls before them) is in
actors/rollout_manager.py.

Engine faults: `engine_failed(e)` puts the groups running on a dead engine back in the queue (they keep their
admission version and deadline, so a regenerated group is never staler than the bound) and stops dispatching to
it; `add_engine(e)` brings a replacement in. A dead engine's late answers are ignored by the caller.

This module is pure bookkeeping: no Ray, no asyncio, no tensors. actors/rollout_manager.py drives it.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

from rlhf_orch.errors import RolloutError
from rlhf_orch.types import Prompt, Sample

logger = logging.getLogger(__name__)

QUEUED, RUNNING, SCORING, READY, TRAINED, FILTERED = "queued", "running", "scoring", "ready", "trained", "filtered"


@dataclass
class Group:
    gid: int                       # draw order since this (re)start; batches list groups by gid
    prompt: Prompt
    admitted_version: int
    deadline: int                  # the last step allowed to train it
    state: str = QUEUED
    engine: str | None = None
    samples: list[Sample] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    reward_parts: dict[str, list[float]] = field(default_factory=dict)   # per source ("function", "model")
    token_rewards: list[list[float]] | None = None   # a dense reward's values per response token, per sample
    attempts: int = 0              # dispatches (more than one after an abort or an engine failure)
    dispatched_at: float = 0.0
    ready_at: float = 0.0


class GroupScheduler:
    def __init__(self, *, prompts_per_step: int, group_size: int, max_staleness: int, first_step: int,
                 last_step: int, engines: list[str], draw: Callable[[], Prompt], dispatch_groups: int = 0,
                 filter_groups: bool = False, filter_max_draws: float = 3.0, deterministic: bool = False,
                 deadline_slack: int = 0):
        self.B, self.n, self.k = prompts_per_step, group_size, max_staleness
        self.slack = deadline_slack   # steps a group may be trained after its deadline (partial rollouts)
        self.first_step, self.last_step = first_step, last_step
        self.engines = list(engines)
        self.draw = draw
        self.dispatch_groups = dispatch_groups or math.ceil(prompts_per_step / max(1, len(self.engines)))
        self.filter_groups, self.filter_max_draws = filter_groups, filter_max_draws
        self.deterministic = deterministic
        self._rotation = 0     # deterministic: chunks dispatched so far (the next one goes to engines[_rotation % n])
        self.version = first_step - 1
        self.trained_through = first_step - 1   # the last step `take` served
        self.groups: dict[int, Group] = {}
        self.requeue_first: list[Prompt] = []     # draws of an earlier run segment, served before new ones
        self.outstanding = {e: 0 for e in self.engines}   # samples dispatched and not yet returned
        self.counts = {"drawn": 0, "dispatched": 0, "trained": 0, "filtered": 0, "aborted": 0, "requeued_on_resume": 0,
                       "kept_over_cap": 0, "requeued_on_failure": 0,
                       # finished samples (filtered or trained later) whose tokens came from two or more weight
                       # versions: partial rollouts at work, whichever groups dynamic sampling keeps
                       "spanning_samples": 0}
        self._next_gid = 0
        self._filtered_since_batch = 0
        self._filtered_gids: list[int] = []   # deterministic: filtered groups not yet reported by a batch

    # ---- admission --------------------------------------------------------------------------------
    def budget(self) -> int:
        """Live groups allowed since the first step while the engines hold `self.version` (plus the late ones)."""
        horizon = min(self.version + self.k + 1, self.last_step)
        late = self.overdue() if self.slack and horizon < self.last_step else 0
        return max(0, horizon - self.first_step + 1) * self.B + late

    def overdue(self) -> int:
        """Live groups a step already trained without (partial rollouts' late groups, `deadline_slack`). They do not
        hold a place: otherwise the step after them, short of the groups its predecessor took early, waits for
        groups admitted only at the last sync. The places come back to the budget when the horizon reaches the
        last step, so the run draws no group it cannot train."""
        return sum(g.admitted_version + self.k + 1 <= self.trained_through for g in self.groups.values())

    def can_admit(self) -> bool:
        budget, drawn = self.budget(), self.counts["drawn"]
        return drawn - self.counts["filtered"] < budget and drawn < self.filter_max_draws * budget

    def set_version(self, version: int) -> None:
        self.version = max(self.version, version)

    def admit(self) -> list[Group]:
        """Draw (or re-queue) as many groups as the budget allows at the current version."""
        new = []
        while self.can_admit():
            prompt = self.requeue_first.pop(0) if self.requeue_first else self.draw()
            due = self.version + self.k + 1   # the last step may not leave a late group behind
            g = Group(self._next_gid, prompt, self.version, due + min(self.slack, max(0, self.last_step - due)))
            self.groups[g.gid] = g
            self._next_gid += 1
            self.counts["drawn"] += 1
            new.append(g)
        return new

    # ---- dispatch ---------------------------------------------------------------------------------
    def plan_dispatch(self) -> list[tuple[str, list[Group]]]:
        """Every queued group, in draw order and chunks, each chunk to the least-loaded engine."""
        queued = sorted((g for g in self.groups.values() if g.state == QUEUED), key=lambda g: g.gid)
        plan = []
        if not self.engines:   # every engine dead: the groups wait for a replacement
            return plan
        for i in range(0, len(queued), self.dispatch_groups):
            chunk = queued[i:i + self.dispatch_groups]
            if self.deterministic:   # a fixed rotation: which engine got a chunk must not depend on which returned first
                engine = self.engines[self._rotation % len(self.engines)]
                self._rotation += 1
            else:
                engine = min(self.engines, key=lambda e: (self.outstanding[e], self.engines.index(e)))
            for g in chunk:
                g.state, g.engine = RUNNING, engine
                g.attempts += 1
            self.outstanding[engine] += len(chunk) * self.n
            self.counts["dispatched"] += len(chunk)
            plan.append((engine, chunk))
        return plan

    def on_generated(self, engine: str, groups: list[Group], samples: list[list[Sample]]) -> list[Group]:
        """A chunk came back (samples per group). Aborted groups go back to the queue; returns those to score.
        A late answer of an engine already declared dead is ignored: its groups were re-queued."""
        if engine not in self.outstanding:
            return []
        self.outstanding[engine] -= len(groups) * self.n
        to_score = []
        for g, ss in zip(groups, samples):
            if any(s.finish_reason == "abort" for s in ss):
                g.state, g.engine = QUEUED, None
                self.counts["aborted"] += 1
                continue
            g.state, g.samples = SCORING, ss
            self.counts["spanning_samples"] += sum(s.min_version != s.max_version for s in ss)
            to_score.append(g)
        return to_score

    def engine_failed(self, engine: str) -> list[Group]:
        """A dead engine: its running groups go back to the queue (in draw order); no more work goes to it."""
        if engine in self.engines:
            self.engines.remove(engine)
        self.outstanding.pop(engine, None)
        lost = sorted((g for g in self.groups.values() if g.state == RUNNING and g.engine == engine), key=lambda g: g.gid)
        for g in lost:
            g.state, g.engine, g.samples = QUEUED, None, []
        self.counts["requeued_on_failure"] += len(lost)
        return lost

    def add_engine(self, engine: str) -> None:
        if engine not in self.engines:
            self.engines.append(engine)
            self.outstanding[engine] = 0

    def settled(self) -> bool:
        """No group is being generated or scored: every draw so far is ready, filtered or trained."""
        return not any(g.state in (RUNNING, SCORING) for g in self.groups.values())

    def busy(self, engine: str) -> bool:
        return self.outstanding.get(engine, 0) > 0

    def on_scored(self, g: Group, rewards: list[float], now: float) -> bool:
        """Rewards arrived; returns False if dynamic sampling filtered the group (all rewards equal)."""
        g.rewards, g.ready_at = list(rewards), now
        if self.filter_groups and len(rewards) > 1 and max(rewards) == min(rewards):
            if self.counts["drawn"] >= self.filter_max_draws * self.budget():
                # No replacement may be drawn: keep it (no GRPO signal, but the batch fills and the run goes on).
                self.counts["kept_over_cap"] += 1
                g.state = READY
                return True
            g.state, g.samples = FILTERED, []
            del self.groups[g.gid]      # kept only as a count: the ledger must not grow with the run
            self.counts["filtered"] += 1
            self._filtered_since_batch += 1
            if self.deterministic:
                self._filtered_gids.append(g.gid)
            return False
        g.state = READY
        return True

    # ---- batches ----------------------------------------------------------------------------------
    def select_batch(self, step: int) -> list[Group] | None:
        """The groups step `step` trains on, or None while it must wait. Raises if it can never be filled."""
        if self.deterministic:
            return self._select_in_order(step)
        unconsumed = list(self.groups.values())
        due = [g for g in unconsumed if g.deadline <= step]
        if any(g.state != READY for g in due):
            return None
        chosen = sorted(due, key=lambda g: g.gid)
        if len(chosen) < self.B:
            extra = sorted((g for g in unconsumed if g.state == READY and g.deadline > step),
                           key=lambda g: (g.admitted_version, g.gid))
            chosen = sorted(chosen + extra[:self.B - len(chosen)], key=lambda g: g.gid)
        if len(chosen) >= self.B:
            return chosen
        if any(g.state != READY for g in unconsumed) or self.can_admit():
            return None
        return self._short_batch(step, chosen)

    def _select_in_order(self, step: int) -> list[Group] | None:
        """Deterministic mode: the oldest live groups by gid, prompts_per_step of them or every due one if more (due
        groups are the oldest: deadlines never decrease with gid), once all of them are scored. Later groups that
        finished first wait. Fewer live groups than a batch: None while more may be drawn (the manager draws them once
        everything has settled), else the short batch."""
        live = sorted(self.groups.values(), key=lambda g: g.gid)
        need = max(self.B, sum(g.deadline <= step for g in live))
        chosen = live[:need]
        if any(g.state != READY for g in chosen):
            return None
        if len(chosen) >= self.B:
            return chosen
        if self.can_admit():
            return None
        return self._short_batch(step, chosen)

    def _short_batch(self, step: int, chosen: list[Group]) -> list[Group]:
        # Defensive: with equal-reward groups kept once the draw cap is spent, a step always gets its groups.
        if not chosen:
            if self.filter_groups:
                raise RolloutError(f"rollout.filter_groups: no group left to train step {step}: every group drawn had "
                                   f"equal rewards and the draw cap (rollout.filter_max_draws={self.filter_max_draws}) "
                                   "is spent; raise filter_max_draws or set filter_groups: false")
            raise RolloutError(f"rollout manager: no group can reach step {step} (engines at version {self.version}, "
                               f"ledger {self.ledger()}); this is a bug, please report it with the run's rollouts.jsonl")
        logger.warning("step %d trains on %d groups instead of %d (filtered groups and the draw cap)", step,
                       len(chosen), self.B)
        return chosen

    def take(self, groups: list[Group]) -> int:
        """Mark a batch as trained; returns how many groups were filtered since the previous batch."""
        self.trained_through += 1
        for g in groups:
            g.state = TRAINED
            self.counts["trained"] += 1
        filtered, self._filtered_since_batch = self._filtered_since_batch, 0
        if self.deterministic and groups:   # those older than the batch's newest: all settled, whatever the timing
            last = max(g.gid for g in groups)
            filtered = sum(gid <= last for gid in self._filtered_gids)
            self._filtered_gids = [gid for gid in self._filtered_gids if gid > last]
        for g in groups:   # kept only as counts from here on
            self.groups.pop(g.gid, None)
        return filtered

    # ---- ledger and checkpoints -------------------------------------------------------------------
    def ledger(self) -> dict[str, int]:
        by_state = {s: 0 for s in (QUEUED, RUNNING, SCORING, READY)}
        for g in self.groups.values():
            if g.state in by_state:
                by_state[g.state] += 1
        led = dict(self.counts)
        led.update(queued=by_state[QUEUED], in_flight=by_state[RUNNING] + by_state[SCORING], buffered=by_state[READY])
        led["balanced"] = int(led["drawn"] == led["trained"] + led["filtered"] + led["queued"] + led["in_flight"]
                              + led["buffered"])
        return led

    def pending_sources(self) -> list[list[int]]:
        """Draws not yet trained nor filtered, in draw order: a checkpoint re-queues them on resume."""
        return [list(g.prompt.source) for g in sorted(self.groups.values(), key=lambda g: g.gid)] + \
            [list(p.source) for p in self.requeue_first]

    def requeue(self, prompts: list[Prompt]) -> None:
        self.requeue_first.extend(prompts)
        self.counts["requeued_on_resume"] += len(prompts)


def whole_run_ledger(before: dict, after: dict) -> dict[str, int]:
    """One ledger for a run resumed (or restarted) from a checkpoint: `before` is the ledger its checkpoint saved (every
    earlier segment, up to that step), `after` this segment's. The draws still queued, running or buffered at the
    checkpoint were drawn again here (re-queued first), so they count once; everything else adds up."""
    if not before:
        return dict(after)
    pending = sum(int(before.get(k, 0)) for k in ("queued", "in_flight", "buffered"))
    out = {k: int(before.get(k, 0)) + int(v) for k, v in after.items() if k not in ("queued", "in_flight", "buffered",
                                                                                   "balanced")}
    out["drawn"] = int(before.get("drawn", 0)) - pending + int(after.get("drawn", 0))
    out.update({k: int(after.get(k, 0)) for k in ("queued", "in_flight", "buffered")})
    out["balanced"] = int(out["drawn"] == out["trained"] + out["filtered"] + out["queued"] + out["in_flight"]
                          + out["buffered"])
    return out

