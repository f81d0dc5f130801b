"""WeightSyncCoordinator: plans the transports once, then runs one numbered sequence per sync.

setup: ask every trainer rank and engine worker where it sits -> make the plan (ipc for engines on a
trainer rank's device, broadcast for the rest) -> lay out buckets from rank 0's parameter specs -> let each transport
make its members' specs -> run the one handshake (weight_sync/transport.py): every sender and receiver opens its side
at once (the broadcast group is created and warmed up on all sides together), every engine connects with its rank's
offer, every rank accepts the answer. This actor never names a transport.

Every sync is one protocol, whatever the transport (rlhf_orch/weight_sync/transport.py): every trainer rank sends
(`send_weights`) while every engine takes the whole sync in one call (`sync_weights`: pause, receive every bucket over
its transport, check, record the version, resume). Colocated engines stream from their rank's ring buffers through a
shared-memory mailbox opened once at setup; dedicated ones take rank 0's broadcasts. Where the trainer's checksums
travel with the buckets (always over ipc; over broadcast when every broadcast engine can check them itself:
`checks_loads`) each engine compares every tensor before it resumes. Otherwise (tensor-parallel SGLang, fed through
its own API) the engine returns its checksums and stays paused (`hold`): this actor compares them with the trainer's
and then resumes it (`commit`). Only metadata passes through this actor: handles, checksums and timings, never tensor
data.

With weight_sync.overlap, `begin` has the trainer ranks stage a copy of their weights, then runs the same sync from
that copy on a thread of this actor while the trainers train the next step; `finish` returns its metrics or error.

When one member of a sync fails (its process died, or its side raised), every other member is told at once
(`abort_sync`: weight_sync/abort.py) and abandons the sync within milliseconds instead of waiting for the sync
deadline, which grows with the model. The error raised carries `abort`, a record of who failed, when, and when each
survivor let go; the engines stay paused until a verified sync (the driver replaces the dead member and syncs again).
"""
from __future__ import annotations

import logging
import threading
import time

import ray
from ray.exceptions import RayActorError, RayTaskError

from actors.common import Located, get, setup_process
from rlhf_orch.config.schema import WeightSyncSection
from rlhf_orch.errors import ACTOR_DIED, WeightSyncError
from rlhf_orch.weight_sync import digest, make_plan, plan_buckets
from rlhf_orch.weight_sync.plan import sync_deadline_s
from rlhf_orch.weight_sync.transports import setup_specs
from rlhf_orch.weight_sync.verify import mismatches

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class WeightSyncCoordinator(Located):
    def __init__(self, trainers: list, engines: dict, device: str, dtype: str, ws: WeightSyncSection):
        """`ws`: the run's weight_sync section (transport, bucket size, verification, deadline, load replay)."""
        setup_process("cpu")
        self.replay = ws.replay_loads
        self.trainers, self.engines = trainers, engines
        self.device, self.dtype, self.transport = device, dtype, ws.transport
        self.bucket_bytes, self.verify = int(ws.bucket_size_mb * 2**20), ws.verify
        self.configured_timeout = ws.timeout_s
        self.timeout_s = sync_deadline_s(0, ws.timeout_s)   # until setup() knows the bytes
        self.plan = None
        self.layouts = []
        self.version = -1
        self.held: set[str] = set()   # engines this actor checks and then resumes (`commit`): see the module doc
        # Numbers the syncs for the mailboxes (weight_sync/mailbox.py) and aborts (abort.py). Starts from the clock
        # (ms) so that numbers keep growing across a replaced coordinator: an engine's abort flag holds the highest
        # number ever aborted, and a new coordinator counting from 1 would find its first syncs aborted.
        self.sync_id = int(time.time() * 1000)
        self.abort_grace_s = 30.0          # how long aborted survivors get to let go (they take milliseconds)
        self._background: tuple | None = None   # (thread, its result, version) of a sync `begin` started

    def _get(self, refs, what):
        return get(refs, self.timeout_s, what, WeightSyncError)

    def health(self) -> dict:
        """Its process id (fault tests kill it; the driver restarts the run when it dies)."""
        import os
        return {"pid": os.getpid()}

    def setup(self) -> dict:
        t0 = time.perf_counter()
        trainer_devs = self._get([t.device_id.remote() for t in self.trainers], "trainer device ids")
        names = list(self.engines)
        engine_devs = dict(zip(names, self._get([self.engines[n].device_ids.remote() for n in names], "engine device ids")))
        # Their Ray nodes too: IPC only between processes of one node (weight_sync/plan.py).
        trainer_nodes = [n["node_id"] for n in self._get([t.node.remote() for t in self.trainers], "trainer nodes")]
        engine_nodes = {n: w["node_id"] for n, w in zip(names, self._get([self.engines[n].node.remote() for n in names],
                                                                         "engine nodes"))}
        self.plan = make_plan(trainer_devs, engine_devs, self.transport, trainer_nodes, engine_nodes)
        params = self._get(self.trainers[0].param_specs.remote(self.dtype), "parameter specs")
        self.layouts = plan_buckets(params, self.bucket_bytes)
        self.timeout_s = sync_deadline_s(sum(b.nbytes for b in self.layouts), self.configured_timeout)
        routes = self.plan.routes
        checks = dict(zip(names, self._get([self.engines[n].checks_loads.remote(routes[n].transport) for n in names],
                                           "what each engine checks itself")))
        # Each transport makes its members' specs (weight_sync/transports.py); a rendezvous (the broadcast group's
        # store) sits on its sending rank's node, at a port free there, never at a fixed address.
        specs = setup_specs(routes, "nccl" if self.device == "cuda" else "gloo", self.verify, checks,
                            lambda rank: tuple(self._get(self.trainers[rank].node_address.remote(),
                                                         f"trainer rank {rank}'s address")))
        # The handshake (weight_sync/transport.py), the same for every transport. 1: every side opens at once (a
        # group's members must all be joining together); each rank offers what its receivers connect with.
        refs = [t.setup_sender.remote(self.layouts, specs.senders.get(rank, {}), self.verify, self.timeout_s)
                for rank, t in enumerate(self.trainers)]
        refs += [self.engines[name].setup_receiver.remote(self.layouts, *specs.receivers[name], self.verify,
                                                          self.timeout_s, self.replay) for name in names]
        offers = self._get(refs, "weight-sync transports to open (a broadcast group's creation and warm-up)")[
            :len(self.trainers)]
        # 2: every engine connects with its rank's offer and answers; 3: the rank accepts the answer.
        answers = self._get([self.engines[n].connect.remote(offers[routes[n].sender_rank][specs.receivers[n][0]])
                             for n in names], "engines to connect to their trainer rank (ipc: open its buffers)")
        self._get([self.trainers[routes[n].sender_rank].accept.remote(specs.receivers[n][0], n, answer)
                   for n, answer in zip(names, answers)], "trainer ranks to accept the engines' answers")
        # Engines whose loads only this actor can check stay paused after their receive until it has.
        self.held = specs.held
        nbytes = sum(b.nbytes for b in self.layouts)
        logger.info("weight sync plan: %s; %d tensors in %d buckets (%.1f MB)", self.plan.summary(),
                    len(params), len(self.layouts), nbytes / 1e6)
        return {"plan": self.plan.summary(), "buckets": len(self.layouts), "tensors": len(params),
                "bytes": nbytes, "setup_s": time.perf_counter() - t0, "timeout_s": self.timeout_s}

    def _gather(self, calls: dict, version: int) -> dict:
        """{member: result} of every member's call of one sync. At the first failure every other member is told to
        abort (`abort_sync`) and given `abort_grace_s` to let go; then WeightSyncError is raised with `abort`, the
        record of the failure (weight_sync/abort.py)."""
        pending = {ref: key for key, (_, ref) in calls.items()}
        done, deadline = {}, time.monotonic() + self.timeout_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise WeightSyncError(f"weight sync v{version}: timed out after {self.timeout_s:.0f}s (weight_sync."
                                      f"timeout_s) waiting for {sorted(pending.values())}")
            key = pending.pop(ready[0])
            try:
                done[key] = ray.get(ready[0])
            except Exception as e:
                raise self._abort(calls, key, e, pending, version) from None
        return done

    def _abort(self, calls: dict, culprit: str, err: Exception, pending: dict, version: int) -> WeightSyncError:
        """Abort the sync on every member still in it; returns the error to raise, with the failure's record."""
        t_fail = time.time()
        cause = _describe(err)
        logger.error("weight sync v%d (sync %d): %s failed (%s); aborting it on %s", version, self.sync_id, culprit,
                     cause, sorted(pending.values()))
        for key in pending.values():
            calls[key][0].abort_sync.remote(self.sync_id)   # fire and forget: a dead member's call fails by itself
        let_go, t_end = {}, time.monotonic() + self.abort_grace_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, t_end - time.monotonic()))
            if not ready:
                break
            key = pending.pop(ready[0])
            try:
                ray.get(ready[0])
                how = "finished"
            except Exception as e:
                how = _describe(e)
            let_go[key] = {"after_s": round(time.time() - t_fail, 4), "how": how}
        record = {"sync_id": self.sync_id, "version": version, "culprit": culprit, "cause": cause, "t_failure_seen": t_fail,
                  "survivors": let_go, "still_waiting": sorted(pending.values()),
                  "abort_s": max([v["after_s"] for v in let_go.values()], default=0.0)}
        logger.warning("weight sync v%d aborted: survivors let go in %.3fs: %s%s", version, record["abort_s"], let_go,
                       f"; still in it after {self.abort_grace_s:.0f}s: {record['still_waiting']}" if pending else "")
        error = WeightSyncError(f"weight sync v{version} aborted: {culprit} failed ({cause}); "
                                f"{len(let_go)} other member(s) abandoned it within {record['abort_s']:.3f}s")
        error.abort = record
        return error

    def reconfigure(self, engines: dict) -> dict:
        """The engines changed (one died, a replacement started): every live side leaves the old broadcast group,
        then the plan, buckets and group are made again with these engines (a new store port)."""
        old = [n for n in self.engines if n in engines]
        refs = [t.close_sender.remote() for t in self.trainers] + [engines[n].close_receiver.remote() for n in old]
        try:
            ray.get(refs, timeout=min(self.timeout_s, 60.0))
        except Exception as e:   # a side stuck in the dead group is rebuilt by setup() below anyway
            logger.warning("leaving the old weight-sync group: %s", str(e).splitlines()[0][:200])
        self.engines = dict(engines)
        return self.setup()

    def sync(self, version: int, pause_mode: str = "wait", resync: bool = False, staged: bool = False) -> dict:
        """One full sync to `version`; returns flat `sync/` metrics. Raises WeightSyncError on mismatch.
        `pause_mode` is how engines treat running requests (engines/base.py): "keep" for partial rollouts.
        `resync`: the same version again (replacement engines while the trainer has not stepped). `staged`: the
        trainer ranks send the copy `begin` staged, not their live weights (which may be a step further)."""
        if version < self.version or (version == self.version and not resync):
            raise WeightSyncError(f"sync version {version} is not newer than {self.version}")
        return self._sync(version, pause_mode, staged)

    # ---- weight_sync.overlap: the transfer runs while the trainer trains the next step ----------------------
    def begin(self, version: int, pause_mode: str = "wait") -> dict:
        """Stage `version` on every trainer rank (a copy in the sync's dtypes), then sync it from there on a thread
        of this actor's own, and return: the trainers are free to train the next step while the engines take the
        weights. `finish` returns that sync's metrics, or raises its error (the staged copy stays for a resync)."""
        if self._background is not None:
            raise WeightSyncError(f"weight sync v{version}: begun before v{self._background[2]} finished")
        t0 = time.perf_counter()
        staged = self._get([t.stage_weights.remote(version) for t in self.trainers], "trainer ranks to stage weights")
        out: dict = {}

        def transfer():
            try:
                out["metrics"] = self.sync(version, pause_mode, staged=True)
            except BaseException as e:   # handed to finish(), which raises it in the driver's call
                out["error"] = e

        thread = threading.Thread(target=transfer, name=f"weight-sync-v{version}", daemon=True)
        thread.start()
        self._background = (thread, out, version)
        return {"sync/stage_s": time.perf_counter() - t0, "sync/stage_gb": max(s["stage_gb"] for s in staged)}

    def poll(self) -> str:
        """"none", "running", "done" or "failed": the driver checks while it waits for a batch, so a failed overlapped
        sync is recovered at once (its engines stay paused, and the batch may need them)."""
        if self._background is None:
            return "none"
        thread, out, _ = self._background
        return "running" if thread.is_alive() else ("failed" if "error" in out else "done")

    def finish(self) -> dict:
        """Wait for the sync `begin` started; its metrics, with `sync/finish_wait_s` (how long this call waited for
        it: the part of the transfer the next train step did not hide). {} when none is under way."""
        if self._background is None:
            return {}
        thread, out, version = self._background
        t0 = time.perf_counter()
        thread.join(self.timeout_s + self.abort_grace_s)
        if thread.is_alive():
            raise WeightSyncError(f"weight sync v{version}: still under way after {self.timeout_s:.0f}s (weight_sync."
                                  "timeout_s)")
        self._background = None
        if "error" in out:
            raise out["error"]
        return {**out["metrics"], "sync/finish_wait_s": time.perf_counter() - t0}

    def _sync(self, version: int, pause_mode: str, staged: bool = False) -> dict:
        """Every trainer rank sends while every engine takes the sync in one call; then the checksums nobody checked
        yet are compared here, and the engines held for that are resumed. On failure the engines stay paused: one may
        hold part of this version. The driver replaces a dead member and syncs again (which resumes them), or
        restarts the run."""
        t0 = time.perf_counter()
        self.sync_id += 1
        routes = self.plan.routes
        send = "send_staged" if staged else "send_weights"
        calls = {f"trainer rank {r}": (t, getattr(t, send).remote(version, self.sync_id))
                 for r, t in enumerate(self.trainers)}
        for n, e in self.engines.items():
            calls[n] = (e, e.sync_weights.remote(version, self.sync_id, pause_mode, n in self.held))
        done = self._gather(calls, version)
        sent = [done[f"trainer rank {r}"] for r in range(len(self.trainers))]
        synced = {n: done[n] for n in self.engines}
        t_transfer = time.perf_counter()
        reported = {n: r["sums"] for n, r in synced.items()}   # each compared with its sender rank's
        bad = mismatches(self.plan, self.layouts, [r.checksums for r in sent], reported) if self.verify else []
        if bad:
            raise WeightSyncError(f"weight sync v{version} failed verification; engines hold weights that differ from "
                                  "the trainer's: " + "; ".join(bad))
        t_verify = time.perf_counter()
        held = [n for n in self.engines if n in self.held]
        self._get([self.engines[n].commit.remote(version) for n in held], "engines to record the version and resume")
        self.version = version
        t_end = time.perf_counter()
        total_bytes = sum(b.nbytes for b in self.layouts)
        transfer_s = t_transfer - t0
        rank0 = sent[0]
        load_s = max([r["load_s"] for r in synced.values()], default=0.0)
        parts: dict[str, float] = {}   # each part of the engines' pauses, the longest engine's (RolloutActor.pause)
        for r in synced.values():
            for k, v in r.get("pause_parts", {}).items():
                parts[f"sync/pause_{k}"] = max(parts.get(f"sync/pause_{k}", 0.0), v)
        return {
            **parts,
            "sync/version": version,
            "sync/bytes": total_bytes,
            "sync/pause_s": max([r["pause_s"] for r in synced.values()], default=0.0),   # inside sync_weights
            "sync/transfer_s": transfer_s,
            "sync/pack_s": max(r.pack_s for r in sent),
            "sync/wait_s": max(r.wait_s for r in sent),
            "sync/load_s": load_s,
            "sync/verify_s": t_verify - t_transfer,
            "sync/resume_s": max([t_end - t_verify] + [r["finish_s"] for r in synced.values()]),   # commit or in the call
            "sync/total_s": t_end - t0,
            "sync/gbps": total_bytes / max(transfer_s, 1e-9) / 1e9,
            "sync/checksum_ok": 1.0 if self.verify else float("nan"),
            "sync/digest": float(digest(rank0.checksums) % 10**9) if rank0.checksums else float("nan"),
            "sync/ipc_engines": sum(r.transport == "ipc" for r in routes.values()),
            "sync/broadcast_engines": len(self.plan.broadcast_engines),
            "sync/held_engines": len(held),   # checked here, then resumed (commit)
            "sync/gpu_handover_engines": sum(int(r.get("on_device", 0.0)) for r in synced.values()),
        }


def _describe(err: Exception) -> str:
    """One line for a member's failure: a death as such, a member's own error by its first line."""
    if isinstance(err, RayActorError):
        return f"{ACTOR_DIED}: its process is gone ({type(err).__name__})"   # the driver's restart test reads it
    cause = getattr(err, "cause", None) if isinstance(err, RayTaskError) else err
    cause = cause if cause is not None else err
    return f"{type(cause).__name__}: {str(cause).splitlines()[0][:300] if str(cause) else ''}"
