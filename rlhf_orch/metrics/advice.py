"""Advice from a run's own step metrics on its staleness bound: when a step waits for its batch because its slowest
group takes longer than the train steps that cover it, say which `rollout.max_staleness` would hide it.

Why (bench/RESULTS.md, ninth session, 1B on 2x H100): a step's batch is done when its slowest group is scored, and at
max_staleness k a step's groups are admitted about k train steps before it trains. So no step is shorter than
max(train, L / k), L being that group's time from dispatch to scored: with L = 8.2 s and a 5.8 s train step, k = 1 ran
at 0.77 of the throughput bound and k = 2 at 0.97. With partial rollouts a late group may be trained up to
rollout.partial_extra_lag steps later, so it has k + that many train steps. Only advice: a larger k trains on older
samples (the off-policy correction, README), so the run's settings are never changed here. Pure: no Ray; launch.py
logs what this returns.
"""
from __future__ import annotations

import math
import statistics
from collections import deque


class StalenessAdvisor:
    """Fed every step's flat metrics; returns one message (once per run) when, over the last `window` steps, the
    trainer waited for its batch for more than `min_wait_frac` of the step and the slowest group's latency (median)
    exceeded max_staleness train steps (median). It names the staleness that would cover that latency, or, past
    `max_suggested` train steps, says that generation itself bounds the step."""

    def __init__(self, max_staleness: int, window: int = 5, min_wait_frac: float = 0.1, max_suggested: int = 4,
                 extra_lag: int = 0):
        self.k, self.window, self.min_wait_frac = max_staleness, window, min_wait_frac
        self.extra = extra_lag   # rollout.partial_extra_lag in force: a group has k + extra train steps
        self.max_suggested = max_suggested   # beyond it, more staleness buys little: generation is the bottleneck
        self._recent: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self.said = False

    def observe(self, m: dict) -> str | None:
        if self.k < 1 or self.said or "rollout/group_latency_max_s" not in m:
            return None
        self._recent.append((m["rollout/group_latency_max_s"], m["perf/train_s"], m["perf/generate_s"], m["perf/step_s"]))
        if len(self._recent) < self.window:
            return None
        latency, train, wait, step = (statistics.median(x[i] for x in self._recent) for i in range(4))
        steps = self.k + self.extra
        if wait <= self.min_wait_frac * step or latency <= steps * train:
            return None
        self.said = True
        need = math.ceil(latency / max(train, 1e-9))
        given = f"rollout.max_staleness={self.k}" + (f" + partial_extra_lag={self.extra}" if self.extra else "")
        head = (f"the trainer waits {wait:.2f} s of each {step:.2f} s step for its batch: the slowest group takes "
                f"{latency:.2f} s from dispatch to scored, longer than the {steps} train step(s) of {train:.2f} s "
                f"that {given} gives it (medians of the last {self.window} steps). ")
        if need > self.max_suggested:   # so many train steps per group: generation itself bounds the step
            return head + ("Generation bounds these steps, not the staleness bound: more or faster engines, or "
                           "shorter responses (sampling.max_new_tokens)")
        partial = "" if self.extra else (
            "; so would rollout.partial_rollouts: true (engines that pause mid-request), whose long groups go on "
            f"across the syncs and are trained up to partial_extra_lag steps later (only their first tokens "
            f"{self.k + 1}+ versions old)")
        return head + (f"max_staleness: {need} would hide it (samples up to {need} versions old, corrected by "
                       f"algorithm.off_policy){partial}; shorter responses (sampling.max_new_tokens) also would")
