"""When does an engine count as hung? Pure bookkeeping for the rollout manager's health checks.

Each check gives, per engine, a progress counter (decode steps or tokens where the engine reports them, plus
finished generate calls), whether it has work outstanding, and whether it is paused or asleep on purpose (a
weight sync, a colocated hand-over). An engine is *stalled* when it had work, was not paused, and its counter
did not move for `stall_s`. An engine that does not answer a check at all is judged by the caller (a dead or
frozen process: the check itself times out).

Engines that report progress only when a whole call ends (non-streaming vLLM, SGLang) are judged on their
calls: give them a `stall_s` longer than their longest generate call (see `call_deadline_s`).

No Ray, no clocks of its own: the caller passes `now`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Seen:
    progress: int
    since: float   # when the counter last moved, or work started, or a pause ended


class HealthTracker:
    def __init__(self, stall_s: float):
        self.stall_s = stall_s
        self._seen: dict[str, _Seen] = {}

    def observe(self, engine: str, progress: int, busy: bool, paused: bool, now: float,
                limit_s: float | None = None) -> float | None:
        """Record one check; returns the seconds without progress if the engine is stalled (longer than
        `limit_s`, default `stall_s`), else None."""
        seen = self._seen.get(engine)
        if seen is None or progress != seen.progress or not busy or paused:
            self._seen[engine] = _Seen(progress, now)
            return None
        idle = now - seen.since
        return idle if idle >= (self.stall_s if limit_s is None else limit_s) else None

    def forget(self, engine: str) -> None:
        self._seen.pop(engine, None)


def call_deadline_s(stall_s: float, max_new_tokens: int, reports_tokens: bool) -> float:
    """How long an engine may go without progress: `stall_s` for engines that report every decode step; for
    engines that report only finished calls, `stall_s` plus a generous 50 ms per requested token."""
    return stall_s if reports_tokens else stall_s + 0.05 * max_new_tokens
