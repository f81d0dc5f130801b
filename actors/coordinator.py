"""WeightSyncCoordinator: plans the transports once, then runs one numbered sequence per sync.

setup: ask every trainer rank and engine worker where it sits -> make the plan (ipc for engines on a
trainer rank's device, broadcast for the rest) -> lay out buckets from rank 0's parameter specs ->
build senders and receivers, creating and warming the one broadcast group on all sides at once.

Engines whose receivers check what they load themselves (ours: hf, vLLM, and SGLang colocated;
`RolloutActor.streams`) take a whole sync in one call, `sync_weights`: they pause, receive every bucket
(colocated ones through a shared-memory mailbox with their trainer rank, opened once at setup: no call per
bucket), compare each tensor's checksum with the trainer's, record the version and resume, while the trainer
ranks send. So a sync costs one round of calls from here, not five. Other engines (SGLang over broadcast) keep
the stepwise sequence: pause -> every trainer rank streams its buckets (rank 0 broadcasts, ranks sharing a
device hand each bucket's IPC handle to their engines) while broadcast engines receive -> compare every
engine's checksums with its sender's here -> record the version -> resume. Both kinds in one sync are compared
here as well. Only metadata passes through this actor: handles, checksums and timings, never tensor data.
"""
from __future__ import annotations

import logging
import time

import ray

from actors.common import get, setup_process
from rlhf_orch.errors import WeightSyncError
from rlhf_orch.weight_sync import digest, make_plan, plan_buckets
from rlhf_orch.weight_sync.plan import sync_deadline_s
from rlhf_orch.weight_sync.verify import mismatches

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class WeightSyncCoordinator:
    def __init__(self, trainers: list, engines: dict, device: str, dtype: str, transport: str,
                 bucket_bytes: int, verify: bool, timeout_s: float | None, replay: bool = True):
        setup_process("cpu")
        self.replay = replay
        self.trainers, self.engines = trainers, engines
        self.device, self.dtype, self.transport = device, dtype, transport
        self.bucket_bytes, self.verify, self.configured_timeout = bucket_bytes, verify, timeout_s
        self.timeout_s = sync_deadline_s(0, timeout_s)   # until setup() knows the bytes
        self.plan = None
        self.layouts = []
        self.version = -1
        self.streaming: set[str] = set()   # engines that take a sync in one call (sync_weights)
        self.sync_id = 0                   # numbers the syncs for the mailboxes (see weight_sync/mailbox.py)

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
        self.plan = make_plan(trainer_devs, engine_devs, self.transport)
        specs = self._get(self.trainers[0].param_specs.remote(self.dtype), "parameter specs")
        self.layouts = plan_buckets(specs, self.bucket_bytes)
        self.timeout_s = sync_deadline_s(sum(b.nbytes for b in self.layouts), self.configured_timeout)
        streams = dict(zip(names, self._get([self.engines[n].streams.remote(self.plan.routes[n].transport) for n in names],
                                            "engine receiver kinds")))
        # Broadcast receivers check the trainer's checksums themselves only if every one of them can: the sums
        # follow the buckets as one more broadcast, which every group member must take part in.
        bcast_sums = self.verify and all(streams[n] for n in self.plan.broadcast_engines)
        group = None
        if self.plan.group_world_size:
            # Rank 0 hosts the store: its node's address and a port free there, never a fixed address.
            host, port = self._get(self.trainers[0].node_address.remote(), "trainer rank 0 address")
            group = {"backend": "nccl" if self.device == "cuda" else "gloo", "host": host, "port": port,
                     "world_size": self.plan.group_world_size, "sums": bcast_sums}
        refs = []
        for rank, t in enumerate(self.trainers):
            ipc = {e: self.engines[e] for e in self.plan.ipc_targets.get(rank, [])}
            refs.append(t.setup_sender.remote(self.layouts, ipc, group if rank == 0 else None, self.verify, self.timeout_s))
        for name, route in self.plan.routes.items():
            g = group if route.transport == "broadcast" else None
            rank = route.group_ranks[0] if route.group_ranks else 0
            refs.append(self.engines[name].setup_receiver.remote(self.layouts, g, rank, self.verify, self.timeout_s,
                                                                 self.replay))
        handles = self._get(refs, "weight-sync group creation and warm-up")[:len(self.trainers)]
        # Colocated engines that stream open their rank's ring buffers once and give it their mailbox.
        connect = [(rank, e) for rank, es in self.plan.ipc_targets.items() for e in es if streams[e]]
        boxes = self._get([self.engines[e].connect_stream.remote(handles[rank], self.timeout_s) for rank, e in connect],
                          "engines to open the trainer's ipc buffers")
        self._get([self.trainers[rank].attach_mailbox.remote(e, box) for (rank, e), box in zip(connect, boxes)],
                  "trainer ranks to attach the engines' mailboxes")
        self.streaming = {e for _, e in connect} | (set(self.plan.broadcast_engines) if bcast_sums else set())
        nbytes = sum(b.nbytes for b in self.layouts)
        logger.info("weight sync plan: %s; %d tensors in %d buckets (%.1f MB)", self.plan.summary(),
                    len(specs), len(self.layouts), nbytes / 1e6)
        return {"plan": self.plan.summary(), "buckets": len(self.layouts), "tensors": len(specs),
                "bytes": nbytes, "setup_s": time.perf_counter() - t0, "timeout_s": self.timeout_s}

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

    def sync(self, version: int, pause_mode: str = "wait", resync: bool = False) -> dict:
        """One full sync to `version`; returns flat `sync/` metrics. Raises WeightSyncError on mismatch.
        `pause_mode` is how engines treat running requests (engines/base.py): "keep" for partial rollouts.
        `resync`: the same version again (replacement engines while the trainer has not stepped)."""
        if version < self.version or (version == self.version and not resync):
            raise WeightSyncError(f"sync version {version} is not newer than {self.version}")
        t0 = time.perf_counter()
        names = list(self.engines)
        stepwise = [n for n in names if n not in self.streaming]
        try:
            self._get([self.engines[n].pause.remote(pause_mode) for n in stepwise], f"engines to pause ({pause_mode})")
            return self._sync(version, names, stepwise, pause_mode, t0)
        except WeightSyncError:
            # Leave live engines generating; the driver finds out whether one died, replaces it and syncs again.
            for n in names:
                try:
                    ray.get(self.engines[n].resume.remote(), timeout=10)
                except Exception:
                    pass
            raise

    def _sync(self, version: int, names: list[str], stepwise: list[str], pause_mode: str, t0: float) -> dict:
        t_pause = time.perf_counter()
        self.sync_id += 1
        send_refs = [t.send_weights.remote(version, self.sync_id) for t in self.trainers]
        routes = self.plan.routes
        one_call = {n: self.engines[n].sync_weights.remote(version, self.sync_id, pause_mode, routes[n].transport)
                    for n in names if n in self.streaming}
        bcast = [n for n in self.plan.broadcast_engines if n not in self.streaming]
        recv_refs = [self.engines[n].receive_broadcast.remote(version) for n in bcast]
        sent = self._get(send_refs, f"trainer ranks to send weights v{version}")
        synced = dict(zip(one_call, self._get(list(one_call.values()), f"engines to take weights v{version}")))
        received = dict(zip(bcast, self._get(recv_refs, f"engines to receive weights v{version}")))
        t_transfer = time.perf_counter()
        ipc_acks = [dict(r.engine_checksums) for r in sent]
        bcast_sums = {n: r[0] for n, r in received.items()}
        for n, r in synced.items():
            if routes[n].transport == "ipc":
                ipc_acks[routes[n].sender_rank][n] = r["sums"]
            else:
                bcast_sums[n] = r["sums"]
        bad = mismatches(self.plan, self.layouts, [r.checksums for r in sent], ipc_acks, bcast_sums) if self.verify else []
        if bad:
            raise WeightSyncError(f"weight sync v{version} failed verification; engines hold weights that differ from "
                                  "the trainer's: " + "; ".join(bad))
        t_verify = time.perf_counter()
        self._get([self.engines[n].finish_sync.remote(version) for n in stepwise], "engines to record the version")
        self._get([self.engines[n].resume.remote() for n in stepwise], "engines to resume")
        self.version = version
        t_end = time.perf_counter()
        total_bytes = sum(b.nbytes for b in self.layouts)
        transfer_s = t_transfer - t_pause
        rank0 = sent[0]
        load_s = max([r[1]["load_s"] for r in received.values()] + [r["load_s"] for r in synced.values()], default=0.0)
        return {
            "sync/version": version,
            "sync/bytes": total_bytes,
            # Engines that take the sync in one call pause (and record the version, and resume) inside it.
            "sync/pause_s": max([t_pause - t0] + [r["pause_s"] for r in synced.values()]),
            "sync/transfer_s": transfer_s,
            "sync/pack_s": max(r.pack_s for r in sent),
            "sync/wait_s": max(r.wait_s for r in sent),
            "sync/load_s": load_s,
            "sync/verify_s": t_verify - t_transfer,
            "sync/resume_s": max([t_end - t_verify] + [r["finish_s"] for r in synced.values()]),
            "sync/total_s": t_end - t0,
            "sync/gbps": total_bytes / max(transfer_s, 1e-9) / 1e9,
            "sync/checksum_ok": 1.0 if self.verify else float("nan"),
            "sync/digest": float(digest(rank0.checksums) % 10**9) if rank0.checksums else float("nan"),
            "sync/ipc_engines": sum(r.transport == "ipc" for r in routes.values()),
            "sync/broadcast_engines": len(self.plan.broadcast_engines),
            "sync/one_call_engines": len(synced),
            "sync/gpu_handover_engines": sum(int(r.get("on_device", 0.0)) for r in synced.values()),
        }
