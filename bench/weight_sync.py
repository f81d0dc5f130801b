"""Weight-sync benchmark: our sync against the hardware floor, for each engine, placement, model shape and fan-out.

    python bench/weight_sync.py                                  # raw receiver, 3 shapes, both placements (2 GPUs)
    python bench/weight_sync.py --engine vllm --models llama-3.1-8b --out bench/RESULTS.md --json $OUT/sync.json
    PYTHONPATH=/tmp/site-sglang:$PWD python bench/weight_sync.py --engine sglang --models llama-3.2-1b
    python bench/weight_sync.py --engine vllm --placements disagg --receivers 1 3 tp2 tp1+tp2 --shard-floor  # 4 GPUs
    python bench/weight_sync.py --dry-run                        # CPU: raw receivers over gloo and shared memory

This process is the trainer, rank 0 on GPU 0, holding random bf16 weights in a real shape (bench/shapes.py).
Every receiver is its own process that sees only its GPUs (bench/sync_bench_lib.py): `raw` is our WeightReceiver
loading into a dict of tensors (no inference engine), `vllm` and `sglang` are rlhf_orch's engines ("dummy"
weights of the same shape). Colocated: every engine on GPU 0 (ipc); disaggregated: engines on GPUs 1.. in one
NCCL group, every engine worker a rank. The transports come from make_plan on the processes' real device ids, and
a sync is the coordinator's one protocol (actors/coordinator.py): every engine takes it in one call that pauses,
receives over its transport, checks every tensor against the trainer's checksums where they come with the buckets, and
resumes (RolloutActor.sync_weights); an engine that cannot check them itself (tensor-parallel SGLang over broadcast)
stays paused until its checksums are compared here, then resumes (commit). Control messages go over pipes,
a cheaper stand-in for Ray calls. Every case runs --warmup + --repeats rounds (>= 10 by default); a round is, in
this order, so drift hits all alike:
  floor     colocated: a device-to-device copy of the same bytes on GPU 0 (bucket by bucket); disaggregated: a raw
            broadcast of the same bytes, bucket by bucket, all posted at once, from GPU 0 into every receiving GPU
            (plain processes beside the engines, in their own group)
  sync      ours, verified: the trainer's and every engine's checksums must match (asserted, every round)
  floor1    (more than one receiving GPU) the raw broadcast into the first receiving GPU only
  shard     (--shard-floor) 1/k of every bucket to each of the k receiving GPUs at once, one group each: what
            sending each TP worker only its shard could at best save
  one_call  (sglang) SGLang's own single, unverified call for all tensors: update_weights_from_distributed while
            the trainer broadcasts tensor by tensor, or (colocated) update_weights_from_tensor of the engine
            process's own tensors
The trainer negates its weights before every round (untimed): an engine left with old weights fails the check.
"sync" ms are sync/transfer_s + sync/verify_s (what the floor bounds); the phase table gives the coordinator's
sync/* metrics (medians) to explain a miss. --naive adds the per-parameter path (one call and one broadcast or
fresh IPC handle per tensor) after the rounds. Tables: markdown (--out appends) and JSON (--json).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.shapes import MODELS, SHAPES, model_dir  # noqa: E402
from bench.sync_bench_lib import HOST, SAFE_ENV, TIMEOUT_S, Pool, parse_receivers, write_reports  # noqa: E402
from rlhf_orch.types import dtype_from_name  # noqa: E402
from rlhf_orch.weight_sync import WeightSender, digest, make_plan, plan_buckets  # noqa: E402
from rlhf_orch.weight_sync.abort import AbortFlag  # noqa: E402
from rlhf_orch.weight_sync.collective import BroadcastGroup, free_port  # noqa: E402
from rlhf_orch.weight_sync.ipc import allocate_shared, export_handle  # noqa: E402
from rlhf_orch.weight_sync.transports import setup_specs  # noqa: E402
from rlhf_orch.weight_sync.verify import mismatches  # noqa: E402

PLACEMENTS = {"colocated": "colocated", "coloc": "colocated", "disaggregated": "disaggregated", "disagg": "disaggregated"}
ENGINE_MODELS = {"raw": list(MODELS), "vllm": [*SHAPES, "qwen3-30b-a3b"], "sglang": [*SHAPES, "qwen3-30b-a3b"]}


class Trainer:
    """Rank 0: random weights of one model shape, their buckets, and two bucket-sized buffers for the floors."""

    def __init__(self, model: str, args, dev: torch.device):
        self.model, self.dev = model, dev
        self.specs = MODELS[model]()
        self.layouts = plan_buckets(self.specs, int(args.bucket_mb * 2**20))
        self.sizes = [lay.nbytes for lay in self.layouts]
        self.params = {s.name: torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device=dev).normal_() for s in self.specs}
        self.bufs = [torch.empty(max(self.sizes), dtype=torch.uint8, device=dev).random_(0, 255) for _ in range(2)]
        self.id = f"gpu-{torch.cuda.get_device_properties(dev).uuid}" if dev.type == "cuda" else "cpu-slot0"
        self.path = "" if args.engine == "raw" else model_dir(model, Path(os.environ.get("TMPDIR", "/tmp")) / "rlhf_orch_sync_bench")

    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)


class Case:
    """One (model, placement, receivers) case: its receivers, groups and sender, then the interleaved rounds."""

    def __init__(self, tr: Trainer, placement: str, spec: str, args, pool: Pool):
        self.tr, self.placement, self.spec, self.args = tr, placement, spec, args
        self.coloc, self.verify, self.sync_id, self.last = placement == "colocated", not args.no_verify, 0, None
        self.group, self.own_group, self.fgroups, self.sender = None, None, {}, None
        tps = parse_receivers(spec)
        self.gpus, nxt = [], 1
        for tp in tps:
            self.gpus.append("0" if self.coloc else ",".join(str(g) for g in range(nxt, nxt + tp)))
            nxt += 0 if self.coloc else tp
        keys = [("engine", tr.model, g, tp, i) for i, (g, tp) in enumerate(zip(self.gpus, tps))]
        hosts = pool.take(keys + [("floor", "", str(g), 1, 0) for g in range(1, nxt)])
        self.engines, self.floors = {f"e{i}": h for i, h in enumerate(hosts[:len(keys)])}, hosts[len(keys):]
        new = [(i, h, tp) for i, (h, tp) in enumerate(zip(self.engines.values(), tps)) if not h.info]
        for i, h, tp in new:   # engines start at once, in their own processes
            h.send("start", args.engine, tr.model, self._engine_kwargs(f"{args.engine}{i}-gpu{h.gpus.replace(',', '')}", tp))
        for _, h, _ in new:
            h.info = h.get()
        self.label = next(iter(self.engines.values())).info[2]
        self._plan_and_setup()
        self.parts = {}
        if not self.coloc:
            self.parts["floor"] = [("all", self.floors, tr.sizes)]
            if len(self.floors) > 1:
                self.parts["floor1"] = [("one", self.floors[:1], tr.sizes)]
            if len(self.floors) > 1 and args.shard_floor:
                k = len(self.floors)
                self.parts["shard"] = [(f"s{i}", [h], [n // k + (n % k if i == k - 1 else 0) for n in tr.sizes])
                                       for i, h in enumerate(self.floors)]
            for key, hs, _ in (p for ps in self.parts.values() for p in ps):
                self.fgroups[key] = self._raw_group(key, hs)
        if args.engine == "sglang" and self.coloc and (args.naive or not args.no_one_call):
            self._all("own_tensors")

    def _engine_kwargs(self, name: str, tp: int) -> dict:
        a = self.args
        if a.engine == "vllm":
            return dict(name=name, model_path=self.tr.path, dtype="bfloat16", load_format="dummy", seed=0,
                        gpu_memory_utilization=a.gpu_mem, kv_cache_memory_gb=a.kv_gb, enforce_eager=True,
                        enable_sleep_mode=False, max_model_len=64, tensor_parallel_size=tp)
        if a.engine == "sglang":
            return dict(name=name, model_path=self.tr.path, dtype="bfloat16", load_format="dummy", context_length=64,
                        mem_fraction_static=a.gpu_mem, disable_cuda_graph=True, tensor_parallel_size=tp)
        return {}

    def _plan_and_setup(self):
        """The coordinator's setup: plan from device ids, group on every side at once, mailboxes for streams."""
        tr, hosts = self.tr, self.engines
        self.plan = plan = make_plan([tr.id], {n: list(h.info[1]) for n, h in hosts.items()})
        want = "ipc" if self.coloc else "broadcast"
        if any(r.transport != want for r in plan.routes.values()):
            raise RuntimeError(f"{self.placement} engines should be fed by {want}, but the plan is {plan.summary()}")
        checks = {n: plan.routes[n].transport in h.info[3] for n, h in hosts.items()}
        # As the coordinator: each transport's specs, then the handshake (open everywhere at once, connect, accept).
        specs = setup_specs(plan.routes, "nccl" if tr.dev.type == "cuda" else "gloo", self.verify, checks,
                            lambda rank: (HOST, free_port(HOST)))
        self.held = specs.held   # engines whose loads only the coordinator can check: paused until it has
        for n in plan.routes:
            hosts[n].send("setup", tr.layouts, *specs.receivers[n], self.verify)
        # returns once every rank of a broadcast group joined and warmed up
        self.sender = WeightSender(tr.layouts, tr.dev, specs.senders.get(0, {}), self.verify, timeout_s=TIMEOUT_S,
                                   abort_flag=AbortFlag.private())   # polled, as a run's
        for h in hosts.values():
            h.get()
        self.group = self.sender.group
        group = specs.senders.get(0, {}).get("broadcast")
        a = self.args
        if a.engine == "sglang" and group is not None and group["sums"] and (a.naive or not a.no_one_call):
            # Our receiver in SGLang's scheduler holds our group; SGLang's own calls need a group SGLang joined itself.
            own = {**group, "port": free_port(HOST), "sums": False}
            for n, r in plan.routes.items():
                hosts[n].send("own_group", own, r.group_ranks[0])
            self.own_group = BroadcastGroup(own["backend"], HOST, own["port"], 0, own["world_size"], TIMEOUT_S, tr.dev)
            self.own_group.warmup()
            for h in hosts.values():
                h.get()
        offers = self.sender.offers()
        for n in plan.routes:
            name = specs.receivers[n][0]
            self.sender.accept(name, n, hosts[n].call("connect", offers[name]))

    def _raw_group(self, key: str, hosts) -> BroadcastGroup:
        port, world = free_port(HOST), len(hosts) + 1
        for rank, h in enumerate(hosts, start=1):
            h.send("join", key, port, rank, world)
        g = BroadcastGroup("nccl" if self.tr.dev.type == "cuda" else "gloo", HOST, port, 0, world, TIMEOUT_S, self.tr.dev)
        g.warmup()
        for h in hosts:
            h.get()
        return g

    def _all(self, cmd: str, *args, names=None) -> list:
        hs = [self.engines[n] for n in (self.engines if names is None else names)]
        for h in hs:
            h.send(cmd, *args)
        return [h.get() for h in hs]

    # ---- the measurements ---------------------------------------------------------------------------
    def floor_copy(self) -> float:
        a, b = self.tr.bufs
        self.tr.sync()
        t0 = time.perf_counter()
        for n in self.tr.sizes:
            b[:n].copy_(a[:n])
        self.tr.sync()
        return time.perf_counter() - t0

    def floor_bcast(self, parts) -> float:
        t0 = time.perf_counter()
        for key, hs, sizes in parts:
            for h in hs:
                h.send("floor", key, sizes)
        works = [self.fgroups[key].broadcast(self.tr.bufs[i % 2][:sizes[i]], async_op=True)
                 for i in range(len(self.tr.sizes)) for key, _, sizes in parts]
        for w in works:
            w.wait()
        self.tr.sync()
        for _, hs, _ in parts:
            for h in hs:
                h.get()
        return time.perf_counter() - t0

    def sync(self, version: int) -> tuple[float, dict, dict]:
        """One sync as WeightSyncCoordinator._sync runs it; returns (transfer + verify seconds, sync/* metrics, engine's)."""
        tr, hosts, plan = self.tr, self.engines, self.plan
        t0 = time.perf_counter()
        self.sync_id += 1
        for n in hosts:
            hosts[n].send("sync_weights", version, self.sync_id, n in self.held)
        sent = self.sender.send(iter(tr.params.items()), version, self.sync_id)
        synced = {n: hosts[n].get() for n in hosts}
        t_transfer = time.perf_counter()
        bad = mismatches(plan, tr.layouts, [sent.checksums], {n: r["sums"] for n, r in synced.items()}) if self.verify else []
        t_verify = time.perf_counter()
        if bad:
            raise AssertionError(f"sync v{version} failed verification: " + "; ".join(bad))
        if self.verify:   # the checksums must cover every tensor and differ from the last round's (weights negated)
            d = digest(sent.checksums)
            assert len(sent.checksums) == len(tr.specs) and d != self.last, "the trainer's checksums did not change"
            self.last = d
        self._all("commit", version, names=[n for n in hosts if n in self.held])
        t_end = time.perf_counter()
        eng: dict[str, float] = {}   # what the engines report (slowest engine)
        for k, v in [kv for r in synced.values() for kv in r.items() if kv[0] != "sums"]:
            eng[k] = max(eng.get(k, float("-inf")), float(v))
        transfer = t_transfer - t0
        return transfer + t_verify - t_transfer, {
            "sync/pause_s": max([r["pause_s"] for r in synced.values()], default=0.0),
            "sync/transfer_s": transfer, "sync/pack_s": sent.pack_s, "sync/wait_s": sent.wait_s,
            "sync/load_s": max([r["load_s"] for r in synced.values()], default=0.0),   # the engines' own figure
            "sync/verify_s": t_verify - t_transfer,
            "sync/resume_s": max([t_end - t_verify] + [r["finish_s"] for r in synced.values()]),
            "sync/total_s": t_end - t0, "sync/gbps": sum(tr.sizes) / max(transfer, 1e-9) / 1e9}, eng

    def _with_broadcast(self, cmd: str, *args) -> float:
        """Engines run `cmd` (hook off: SGLang's own calls must not pay for our checksums) while the trainer
        broadcasts every tensor in order (disaggregated)."""
        self._all("hook", False)
        t0 = time.perf_counter()
        for h in self.engines.values():
            h.send(cmd, *args)
        if not self.coloc:
            group = self.own_group or self.group
            for t in self.tr.params.values():
                group.broadcast(t)
            self.tr.sync()
        for h in self.engines.values():
            h.get()
        dt = time.perf_counter() - t0
        self._all("hook", True)
        return dt

    def naive(self) -> float:
        if not self.coloc or self.args.engine == "sglang":
            return self._with_broadcast("naive" if not self.coloc else "naive_local")
        tr = self.tr
        t0 = time.perf_counter()
        for s in tr.specs:   # a fresh buffer per tensor, as a ZeRO-3 gather hands over, so a fresh handle to open
            bid, fresh = allocate_shared(s.nbytes, tr.dev)
            fresh.view(dtype_from_name(s.dtype)).view(s.shape).copy_(tr.params[s.name])
            tr.sync()
            for h in self.engines.values():   # one handle (one torch IPC reference) per engine, or it is never freed
                h.send("naive_ipc", s.name, export_handle(bid, fresh), s.dtype, tuple(s.shape))
            for h in self.engines.values():
                h.get()
            del fresh
        dt = time.perf_counter() - t0
        if tr.dev.type == "cuda":
            torch.cuda.ipc_collect()   # blocks shared by IPC stay allocated until collected: a model's worth per pass
        return dt

    def run(self) -> dict:
        a, tr = self.args, self.tr
        measures, phases, receiver, verified = defaultdict(list), defaultdict(list), defaultdict(list), 0
        for r in range(a.warmup + a.repeats):
            self._negate()   # every round sends different bytes (untimed)
            rec = {"floor": self.floor_copy() if self.coloc else self.floor_bcast(self.parts["floor"])}
            if a.compare_handover and self.sender is not None and self.sender.gpu_handover:
                # The same sync with the host hand-over per bucket, in the same round; which goes first alternates.
                host_first = r % 2 == 1
                if host_first:
                    rec["sync_host"], ph_h = self._host_handover(r)
                    self._negate()   # each sync moves other bytes than the last
                rec["sync"], ph, eng = self.sync(r)
                if not host_first:
                    self._negate()
                    rec["sync_host"], ph_h = self._host_handover(r)
                for k in ("pack", "wait", "load"):
                    rec[f"host_{k}"] = ph_h[f"sync/{k}_s"]
            else:
                rec["sync"], ph, eng = self.sync(r)
            if a.compare_loads:   # the same sync with the engine's own loader, in the same round (replay off)
                self._negate()
                self._all("set_replay", False)
                rec["sync_loader"], ph_l, _ = self.sync(r)
                self._all("set_replay", True)
                rec["loader_load"] = ph_l["sync/load_s"]
            for key in ("floor1", "shard"):
                if key in self.parts:
                    rec[key] = self.floor_bcast(self.parts[key])
            if a.engine == "sglang" and not a.no_one_call:
                rec["one_call"] = self._with_broadcast("one_call", self.coloc)
            if r >= a.warmup:
                verified += self.verify
                for d, src in ((measures, rec), (phases, ph), (receiver, eng)):
                    for k, v in src.items():
                        d[k].append(v)
        for r in range(a.naive_repeats + 1 if a.naive else 0):   # 10x slower: after the rounds, one warm-up
            t = self.naive()
            if r:
                measures["naive"].append(t)
        return dict(engine=self.label, model=tr.model, placement=self.placement, receivers=self.spec,
                    gpus=" + ".join(self.gpus), bytes=sum(tr.sizes), tensors=len(tr.specs), buckets=len(tr.layouts),
                    bucket_mb=a.bucket_mb, verify=self.verify, verified=verified, repeats=a.repeats, warmup=a.warmup,
                    plan=self.plan.summary(), held=sorted(self.held),
                    measures=dict(measures), phases=dict(phases), receiver=dict(receiver))

    def _negate(self) -> None:
        """Negate the trainer's weights and wait for it: untimed. (Until 2026-11-26 the second sync of a round,
        --compare-loads' replay-off one, started behind this un-awaited negation, ~8 ms of GPU work for 8B.)"""
        torch._foreach_neg_(list(self.tr.params.values()))
        self.tr.sync()

    def _host_handover(self, r: int):
        """One sync with the per-bucket host hand-over (RLHF_ORCH_SYNC_HANDOVER=host), verified like the rest."""
        self.sender.gpu_handover = False
        try:
            t, ph, _ = self.sync(r)
        finally:
            self.sender.gpu_handover = True
        return t, ph

    def close(self):
        for h in self.floors:
            h.send("drop")
        for g in list(self.fgroups.values()) + [g for g in (self.group, self.own_group) if g]:
            g.destroy()
        for h in self.floors:
            h.get(60)
        self.fgroups, self.group, self.own_group, self.sender = {}, None, None, None
        gc.collect()
        if self.tr.dev.type == "cuda":
            torch.cuda.empty_cache()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="raw", choices=["raw", "vllm", "sglang"])
    ap.add_argument("--models", "--model", nargs="+", default=None, choices=list(MODELS),
                    help="default: raw 1b 8b 30b-a3b (tiny on CPU); vllm 1b 8b; sglang 1b")
    ap.add_argument("--placements", "--placement", nargs="+", default=["disaggregated", "colocated"], choices=list(PLACEMENTS))
    ap.add_argument("--receivers", nargs="+", default=["1"],
                    help="one case per spec: a count (3 engines), tpN (one TP=N engine), KxtpN, joined by + (tp1+tp2)")
    ap.add_argument("--repeats", type=int, default=10, help="measured rounds (floor, sync, ... interleaved)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--no-verify", action="store_true", help="syncs without checksums (the cost of verification)")
    ap.add_argument("--shard-floor", action="store_true", help="also the per-shard ideal (>1 receiving GPU)")
    ap.add_argument("--no-one-call", action="store_true", help="sglang: skip SGLang's own one-call baseline")
    ap.add_argument("--naive", action="store_true", help="also the per-parameter path, after the rounds")
    ap.add_argument("--compare-handover", action="store_true",
                    help="each round also syncs with the per-bucket host hand-over instead of the GPU one (CUDA events)")
    ap.add_argument("--compare-loads", action="store_true",
                    help="each round also syncs with load replay off (the engine's loader at every sync)")
    ap.add_argument("--naive-repeats", type=int, default=2)
    ap.add_argument("--gpu-mem", type=float, default=0.35, help="vLLM gpu_memory_utilization / SGLang mem_fraction_static")
    ap.add_argument("--kv-gb", type=float, default=2.0, help="vLLM kv_cache_memory_gb")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: raw receivers over gloo/shared memory")
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke run: --device cpu, tiny shape, 0.25 MiB buckets")
    ap.add_argument("--out", default=None, help="append the tables, command and machine to this markdown file")
    ap.add_argument("--json", default=None, help="write every round's seconds and the summaries to this JSON file")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.bucket_mb = "cpu", min(args.bucket_mb, 0.25)
    if args.device == "cpu" and args.engine != "raw":
        ap.error(f"--engine {args.engine} needs CUDA; on CPU use --engine raw")
    args.models = args.models or (["tiny"] if args.device == "cpu" else
                                  {"raw": ["llama-3.2-1b", "llama-3.1-8b", "qwen3-30b-a3b"], "vllm": ["llama-3.2-1b", "llama-3.1-8b"],
                                   "sglang": ["llama-3.2-1b"]}[args.engine])
    bad = [m for m in args.models if m not in ENGINE_MODELS[args.engine]]
    if bad:
        ap.error(f"--models {bad}: no engine config for {args.engine}; use {ENGINE_MODELS[args.engine]}")
    args.placements = list(dict.fromkeys(PLACEMENTS[p] for p in args.placements))
    if args.repeats < 1 or args.warmup < 0 or args.naive_repeats < 1:
        ap.error("--repeats and --naive-repeats must be >= 1, --warmup >= 0")
    for spec in args.receivers:
        if args.engine == "raw" and max(parse_receivers(spec)) > 1:
            ap.error(f"--receivers {spec}: the raw receiver is one rank (TP sizes are for vllm and sglang)")
        if "colocated" in args.placements and max(parse_receivers(spec)) > 1:
            ap.error(f"--receivers {spec}: colocated engines are single-GPU (one spanning GPUs is fed by broadcast); "
                     "give TP sizes with --placements disaggregated only")
    return args


def environment(args) -> tuple[torch.device, str]:
    """Process environment for the run; returns (the trainer's device, the machine in words)."""
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    if args.engine == "sglang":
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")   # as SGLang in its own processes, or the first broadcast fails
    if args.device == "cpu":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("OMP_NUM_THREADS", "1")   # several processes' OpenMP pools on a few cores spin each other out
        torch.set_num_threads(1)
        dev, machine = torch.device("cpu"), f"CPU (smoke test: gloo, shared memory), torch {torch.__version__}"
    else:
        need = 1 + max(sum(parse_receivers(s)) for s in args.receivers) if "disaggregated" in args.placements else 1
        if torch.cuda.device_count() < need:
            sys.exit(f"needs {need} GPUs (trainer on GPU 0, disaggregated engines on GPUs 1..); found {torch.cuda.device_count()}")
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        machine = (f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
                   f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    return dev, machine


def run_case(model: str, placement: str, bucket_mb: float = 512, repeats: int = 10, naive_repeats: int = 2,
             engine: str = "raw", receivers: str = "1", device: str = "cuda") -> dict:
    """One case, with the per-parameter path (tests/gpu/test_weight_sync_gpu.py); `verified` is True when every
    measured sync was verified."""
    args = parse_args(["--engine", engine, "--models", model, "--placements", placement, "--receivers", receivers,
                       "--bucket-mb", str(bucket_mb), "--repeats", str(repeats), "--naive",
                       "--naive-repeats", str(naive_repeats), "--device", device])
    dev, _ = environment(args)
    pool, case = Pool(args.device), None
    try:
        case = Case(Trainer(model, args, dev), args.placements[0], receivers, args, pool)
        c = case.run()
    finally:
        if case is not None:
            case.close()
        pool.close()
    return dict(c, verified=c["verify"] and c["verified"] == repeats)


def main():
    args = parse_args()
    dev, machine = environment(args)
    pool, cases = Pool(args.device), []
    try:
        for model in args.models:
            tr = Trainer(model, args, dev)
            for placement in args.placements:
                for spec in args.receivers:
                    t0, case, failed = time.perf_counter(), None, False
                    try:
                        case = Case(tr, placement, spec, args, pool)
                        c = case.run()
                        cases.append(c)
                        f, s = (statistics.median(c["measures"][k]) * 1e3 for k in ("floor", "sync"))
                        ver = f"verified {c['verified']}/{args.repeats}" if c["verify"] else "checksums off"
                        print(f"{c['engine']} {model} {placement} {spec}: floor {f:.1f} ms, sync {s:.1f} ms ({s / f:.2f}x), "
                              f"{ver} [{time.perf_counter() - t0:.0f} s]", flush=True)
                    except Exception as e:   # record it and go on: the other cases still run and report
                        traceback.print_exc()
                        failed = True
                        cases.append(dict(engine=args.engine, model=model, placement=placement, receivers=spec,
                                          error=f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:300]}"))
                    finally:
                        if case is not None:
                            try:
                                case.close()
                            except Exception:
                                failed = True
                        if failed:
                            pool.close()   # a failed receiver's state is unknown: start the next case afresh
            del tr
            gc.collect()
    finally:
        pool.close()
    print(write_reports(cases, machine, "python " + " ".join(sys.argv), vars(args), args.out, args.json))
    sys.exit(1 if any("error" in c for c in cases) else 0)


if __name__ == "__main__":
    main()
