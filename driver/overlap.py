"""weight_sync.overlap: the step's weight sync runs while the trainer trains the next step (issue #27 item 2).

After step s's update the trainer ranks copy their weights into a staging buffer of their own (weight_sync/sender.py
`stage`) and the coordinator sends that copy on a thread of its own (actors/coordinator.py `begin`); the driver goes
on to step s+1 at once. The transfer is finished (`finish`: its metrics, or its error) at the next step's sync, before
an evaluation, or at the run's end. Versions stay exact: the rollout manager counts version s from the start of its
sync, and an engine serves a group admitted under it only once it holds it (actors/rollout.py `generate`), so no
group runs on weights older than its admission and the staleness bound holds as without overlap.

A transfer that fails leaves its engines paused (a half-loaded version is never served), and the next batch may need
them, so the driver polls the coordinator while it waits for that batch (`wait_for`) and recovers at once: the dead
engine or coordinator replaced as after any failed sync (driver/recovery.py), and the staged copy, which the trainers
keep until the next stage (and across a re-plan), sent again. Their live weights may be a step further by then.

On when `weight_sync.overlap` is true, or "auto" at max_staleness >= 1, and no GPU hand-over (colocation offload or
engine sleep) is due: engines asleep during training could not take the weights. It does not change the sync's
transports, verification or abort (those are the coordinator's), only when the trainer waits for them.
"""
from __future__ import annotations

import logging
import time

import ray

from actors.common import get
from rlhf_orch.config.checks import overlap_allowed
from rlhf_orch.errors import WeightSyncError

logger = logging.getLogger(__name__)


class OverlappedSync:
    def __init__(self, cluster):
        self.cluster = cluster
        self.pending: tuple[int, float] | None = None   # (version, start) of the sync under way
        self.finished: dict = {}   # a sync finished early (an evaluation, a failure seen while waiting), for the next step

    def wanted(self) -> bool:
        c = self.cluster
        return overlap_allowed(c.cfg.weight_sync.overlap, c.max_staleness) and not (c.colocation.do_offload or
                                                                                     c.colocation.do_sleep)

    def step(self, version: int) -> dict:
        """Finish the previous sync, then stage `version` and start its transfer. The step's `sync/` metrics are the
        previous sync's (finished under this step; `sync/finish_wait_s` the part the trainer waited for) and this
        one's staging (`sync/stage_s`, `sync/stage_gb`)."""
        c = self.cluster
        done, self.finished = {**self.finished, **self.finish()}, {}
        c.replace_dead_engines()   # their first sync is this one; the plan is made again before it begins
        staged = get(c.coordinator.begin.remote(version, c.pause_mode), c.sync_timeout,
                     f"trainer ranks to stage weights v{version}", WeightSyncError)
        self.pending = (version, time.time())
        return {**done, **staged, "sync/overlapped": 1.0, "fault/engines_live": float(len(c.engines)),
                "fault/engine_restarts": float(c.engine_restarts)}

    def finish(self) -> dict:
        """The end of the sync under way ({} if none): its metrics, after recovery as Cluster.sync does (a dead engine
        or coordinator replaced, and the staged copy sent again)."""
        if self.pending is None:
            return {}
        c = self.cluster
        (version, t0), self.pending = self.pending, None
        try:
            out = get(c.coordinator.finish.remote(), c.sync_timeout, f"weight sync v{version}", WeightSyncError)
        except WeightSyncError as err:
            c._sync_aborted(err)
            if not (c._coordinator_died(err, version) or c._engines_died(err, f"weight sync v{version}")):
                raise
            out = c._sync_once(version, True, staged=True)
        c.timeline.add("weight-sync", "sync (overlapped)", t0, t0 + out["sync/total_s"], version=version)
        return {**out, **c._synced_replacements(out)}

    def last(self) -> dict:
        """At the run's end: the last sync's metrics (finished now, or earlier for an evaluation); {} if none."""
        done, self.finished = {**self.finished, **self.finish()}, {}
        return done

    def finish_early(self) -> None:
        """Finish now (an evaluation needs the step's weights in the engines); the metrics go with the next step."""
        self.finished.update(self.finish())

    def wait_for(self, ref) -> None:
        """Wait for `ref` (the next batch) while a sync is under way, recovering at once from a failed one."""
        c = self.cluster
        while self.pending is not None and not ray.wait([ref], timeout=0.5)[0]:
            try:
                state = get(c.coordinator.poll.remote(), c.timeout, "weight-sync state", WeightSyncError)
            except WeightSyncError:   # the coordinator itself died: finish() replaces it
                state = "failed"
            if state == "failed":
                self.finish_early()

    def abandon(self) -> None:
        """At the run's end (close): let the transfer end before its members are shut down; no recovery."""
        if self.pending is None:
            return
        self.pending = None
        c = self.cluster
        try:
            get(c.coordinator.finish.remote(), c.sync_timeout, "the last weight sync", WeightSyncError)
        except Exception as e:
            logger.warning("the last weight sync did not finish: %s", str(e).splitlines()[0])
