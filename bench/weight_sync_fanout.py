"""Weight-sync fan-out: one trainer rank broadcasting into several vLLM engines, and into a TP=2 engine.

    python bench/weight_sync_fanout.py --out bench/RESULTS.md                    # 8B shape, needs 4 GPUs
    python bench/weight_sync_fanout.py --models llama-3.2-1b                     # quick check
    python bench/weight_sync_fanout.py --dry-run                                 # CPU/gloo smoke, no vLLM

Issue #7 targets: syncing 3 engines within 1.25x of the single-receiver broadcast floor (NCCL pipelines a
broadcast, so a cost per receiver means something is serialised); and for a TP=2 engine, whether each TP
worker should receive only its shard or the full tensors. Measured in one run, all on random bf16 weights
in the real shape (bench/shapes.py; vLLM gets "dummy" weights in the same shape):
  floor1   raw NCCL broadcast of all the bytes, bucket by bucket as ours does, GPU 0 -> GPU 1;
  floor3   the same into GPUs 1, 2, 3 (one group);
  floor2   the same into GPUs 2, 3 (what full tensors cost a TP=2 engine on the link);
  split2   half of every bucket to GPU 2 and the other half to GPU 3 at once, two groups: the ideal of
           per-shard sends (each TP worker gets only half the bytes);
  ours1    WeightSender on GPU 0 -> one vLLM TP=1 engine on GPU 1 (our group, checksums verified);
  ours3    into three TP=1 engines on GPUs 1, 2, 3 (one group, every engine a rank);
  ours_tp2 into one TP=2 engine on GPUs 2, 3 (each TP worker a rank, receiving the full tensors);
  ours_tp1+tp2  into the TP=1 engine on GPU 1 and the TP=2 engine at once.
Every engine runs `rlhf_orch.engines.vllm.VLLMEngine` in its own process with CUDA_VISIBLE_DEVICES set (the
trainer is this process, on GPU 0). A timed sync ends when every engine reports done. Medians of
--repeats after a warm-up. "load ms" is the engine-side time in load_weights + checksums (max over workers).

The argument for full tensors: one broadcast sends each bucket once out of GPU 0 and NCCL forwards it to
every rank, so the root's egress, which bounds the sync, is the same whether the ranks keep all or half
of it; per-shard sends would need one collective (or send) per shard and still push every byte out of GPU
0 once. split2 vs floor2 measures whether halving the bytes per receiver buys anything on this link, and
ours_tp2 vs ours1 whether a TP worker pays for receiving tensors it then narrows to its shard.
"""
from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.shapes import MODELS  # noqa: E402
from rlhf_orch.types import dtype_from_name  # noqa: E402
from rlhf_orch.weight_sync import WeightReceiver, WeightSender, plan_buckets  # noqa: E402
from rlhf_orch.weight_sync.buckets import checksums  # noqa: E402
from rlhf_orch.weight_sync.collective import BroadcastGroup, free_port  # noqa: E402

HOST = "127.0.0.1"
TIMEOUT_S = 600
# NVLink multicast stays off in every process here and in the engines (they inherit this environment).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}


class CpuEngine:
    """--dry-run stand-in for VLLMEngine: one WeightReceiver on CPU over gloo (checks this script only)."""

    def __init__(self, **_):
        self.views, self.rec = {}, None

    def setup_receiver(self, layouts, group, rank_offset, verify, timeout_s):
        self.rec = WeightReceiver(layouts, torch.device("cpu"), self.views.update,
                                  lambda names: checksums(self.views[n] for n in names))
        return self.rec.join_group("gloo", group["host"], group["port"], rank_offset, group["world_size"], timeout_s)

    def receive_broadcast(self, verify=True):
        return self.rec.receive_broadcast(verify)

    def shutdown(self):
        if self.rec is not None:
            self.rec.close()


def host_main(conn, gpus: str, dry: bool) -> None:
    """One process per engine (or raw receiver), driven over a pipe; sees only `gpus`."""
    if not dry:
        assert not torch.cuda.is_initialized(), "CUDA_VISIBLE_DEVICES must be set before CUDA starts"
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    dev = torch.device("cpu") if dry else torch.device("cuda", 0)
    backend = "gloo" if dry else "nccl"
    groups, bufs, engine = {}, [], None
    while True:
        cmd, arg = conn.recv()
        try:
            out = None
            if cmd == "join":            # a raw group for the floors
                key, port, rank, world = arg
                g = BroadcastGroup(backend, HOST, port, rank, world, TIMEOUT_S, dev)
                g.warmup()
                groups[key] = g
            elif cmd == "floor":         # receive one raw broadcast per bucket size, two buffers in turn
                key, sizes = arg
                if not bufs or bufs[0].numel() < max(sizes):
                    bufs = [torch.empty(max(sizes), dtype=torch.uint8, device=dev) for _ in range(2)]
                t0 = time.perf_counter()
                works = [groups[key].broadcast(bufs[i % 2][:n], async_op=True) for i, n in enumerate(sizes)]
                for w in works:
                    w.wait()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                out = time.perf_counter() - t0
            elif cmd == "drop":          # free the raw groups and buffers before vLLM starts here
                for g in groups.values():
                    g.destroy()
                groups, bufs = {}, []
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            elif cmd == "engine":
                t0 = time.perf_counter()
                if dry:
                    engine = CpuEngine(**arg)
                else:
                    from rlhf_orch.engines.vllm import VLLMEngine
                    engine = VLLMEngine(**arg)
                out = time.perf_counter() - t0
            elif cmd == "setup":
                layouts, group, offset = arg
                out = engine.setup_receiver(layouts, group, offset, True, TIMEOUT_S)
            elif cmd == "recv":
                out = engine.receive_broadcast(True)
            elif cmd == "exit":
                if engine is not None:
                    engine.shutdown()
                    core = getattr(getattr(getattr(engine, "llm", None), "llm_engine", None), "engine_core", None)
                    if core is not None:
                        core.shutdown()    # stop vLLM's EngineCore (and its workers) now, not at exit
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", out))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class Host:
    def __init__(self, ctx, gpus: str, dry: bool):
        self.gpus = gpus
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=host_main, args=(child, gpus, dry), daemon=False)   # vLLM spawns children
        self.proc.start()

    def send(self, cmd, arg=None):
        self.conn.send((cmd, arg))

    def get(self, timeout: float = TIMEOUT_S):
        if not self.conn.poll(timeout):
            raise RuntimeError(f"process on GPUs {self.gpus}: no answer in {timeout:.0f}s")
        status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"process on GPUs {self.gpus} failed:\n{out}")
        return out

    def close(self):
        if self.proc.is_alive():
            try:
                self.send("exit")
                self.get(120)
            except (RuntimeError, OSError, EOFError):
                pass
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


def median_after_warmup(fn, reps: int) -> float:
    fn()
    return statistics.median(fn() for _ in range(reps))


def wait_gpus_free(gpus: list[int], limit_mib: int = 2048, timeout_s: float = 90) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        q = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True).stdout
        used = {int(i): int(m) for i, m in (line.split(",") for line in q.strip().splitlines())}
        if all(used.get(g, 0) < limit_mib for g in gpus):
            return
        time.sleep(1)
    print(f"warning: GPUs {gpus} still hold memory after {timeout_s:.0f}s", flush=True)


class Bench:
    def __init__(self, model: str, bucket_mb: float, reps: int, dry: bool):
        self.dry, self.reps = dry, reps
        self.backend = "gloo" if dry else "nccl"
        self.dev = torch.device("cpu") if dry else torch.device("cuda", 0)
        if not dry:
            torch.cuda.set_device(self.dev)
        self.specs = MODELS[model]()
        self.layouts = plan_buckets(self.specs, int(bucket_mb * 2**20))
        self.sizes = [lay.nbytes for lay in self.layouts]
        self.params = {s.name: torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device=self.dev).normal_()
                       for s in self.specs}

    def _sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def group(self, members, floor_key: str | None = None) -> BroadcastGroup:
        """Trainer rank 0 plus members [(host, tp)] in order, each taking tp ranks: raw joins, or engine receivers."""
        port = free_port(HOST)
        world = 1 + sum(tp for _, tp in members)
        spec = {"backend": self.backend, "host": HOST, "port": port, "world_size": world}
        rank = 1
        for h, tp in members:
            h.send("join", (floor_key, port, rank, world)) if floor_key else h.send("setup", (self.layouts, spec, rank))
            rank += tp
        g = BroadcastGroup(self.backend, HOST, port, 0, world, TIMEOUT_S, self.dev)
        g.warmup()   # returns once every rank has joined and warmed up
        for h, _ in members:
            h.get()
        return g

    def floor(self, parts) -> float:
        """parts: [(group key, [hosts]), sizes per bucket]; all parts broadcast bucket by bucket at once."""
        groups = [(key, self.group([(h, 1) for h in hosts], key), hosts, sizes) for (key, hosts), sizes in parts]
        n = max(max(s) for *_, s in groups)
        bufs = [torch.empty(n, dtype=torch.uint8, device=self.dev).random_(0, 255) for _ in range(2)]

        def once():
            t0 = time.perf_counter()
            for key, _, hosts, sizes in groups:
                for h in hosts:
                    h.send("floor", (key, sizes))
            works = [g.broadcast(bufs[i % 2][:sizes[i]], async_op=True)
                     for i in range(len(self.sizes)) for _, g, _, sizes in groups]
            for w in works:
                w.wait()
            self._sync()
            for _, _, hosts, _ in groups:
                for h in hosts:
                    h.get()
            return time.perf_counter() - t0
        t = median_after_warmup(once, self.reps)
        for _, g, _, _ in groups:
            g.destroy()
        return t

    def ours(self, members) -> dict:
        g = self.group(members)
        sender = WeightSender(self.layouts, self.dev, [], g)
        last = {}

        def once():
            t0 = time.perf_counter()
            for h, _ in members:
                h.send("recv")
            r = sender.send(iter(self.params.items()), 1)
            got = [h.get() for h, _ in members]
            dt = time.perf_counter() - t0
            last.update(verified=all(sums == r.checksums for sums, _ in got),
                        load_s=max(m["load_s"] for _, m in got), recv_s=max(m["total_s"] for _, m in got))
            return dt
        t = median_after_warmup(once, self.reps)
        sender = None   # frees its two bucket buffers
        g.destroy()
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        return dict(s=t, **last)


def run(model: str, args) -> list[dict]:
    dry = args.dry_run
    ctx = mp.get_context("spawn")
    hosts = {k: Host(ctx, str(k), dry) for k in (1, 2, 3)}   # raw receivers first, then TP=1 engines
    b = Bench(model, args.bucket_mb, args.repeats, dry)
    total = sum(s.nbytes for s in b.specs)
    rows = []

    def row(case, gpus, ranks, s, **kw):
        rows.append(dict(model=model, case=case, gpus=gpus, ranks=ranks, gb=total / 1e9, buckets=len(b.layouts), s=s, **kw))
        print(f"{model} {case}: {s * 1e3:.1f} ms {kw}", flush=True)

    h1, h2, h3 = hosts[1], hosts[2], hosts[3]
    tp2 = None
    try:
        half = [n // 2 for n in b.sizes]
        row("floor1", "1", 1, b.floor([(("f1", [h1]), b.sizes)]))
        row("floor3", "1,2,3", 3, b.floor([(("f3", [h1, h2, h3]), b.sizes)]))
        row("floor2", "2,3", 2, b.floor([(("f2", [h2, h3]), b.sizes)]))
        row("split2", "2 & 3, half each", 2, b.floor([(("sa", [h2]), half), (("sb", [h3]), [n - m for n, m in zip(b.sizes, half)])]))
        path = "" if dry else model_path(model)
        kw = dict(model_path=path, dtype="bfloat16", load_format="dummy", gpu_memory_utilization=args.gpu_mem,
                  enforce_eager=True, enable_sleep_mode=False, max_model_len=64, seed=0)
        for k, h in hosts.items():
            h.send("drop")
            h.get()
            h.send("engine", dict(kw, name=f"tp1-gpu{k}"))
        start = max(h.get() for h in hosts.values())
        print(f"{model}: three TP=1 engines up in {start:.0f} s", flush=True)
        row("ours1", "1", 1, **_ours(b.ours([(h1, 1)])))
        row("ours3", "1,2,3", 3, **_ours(b.ours([(h1, 1), (h2, 1), (h3, 1)])))
        if dry:
            return rows
        for h in (h2, h3):
            h.close()
        wait_gpus_free([2, 3])
        tp2 = Host(ctx, "2,3", dry)
        tp2.send("engine", dict(kw, name="tp2-gpu23", tensor_parallel_size=2))
        print(f"{model}: TP=2 engine up in {tp2.get():.0f} s", flush=True)
        row("ours_tp2", "2,3 (TP=2)", 2, **_ours(b.ours([(tp2, 2)])))
        row("ours_tp1+tp2", "1 + 2,3 (TP=2)", 3, **_ours(b.ours([(h1, 1), (tp2, 2)])))
        return rows
    finally:
        for h in list(hosts.values()) + ([tp2] if tp2 else []):
            h.close()


def _ours(r: dict) -> dict:
    return dict(s=r["s"], load_s=r["load_s"], recv_s=r["recv_s"], verified=r["verified"])


def model_path(model: str) -> str:
    from bench.weight_sync_vllm import model_dir
    return model_dir(model, Path(os.environ.get("TMPDIR", "/tmp")) / "rlhf_orch_vllm_bench")


def report(rows: list[dict]) -> str:
    lines = ["| model | case | receiver GPUs | receiving ranks | GB | buckets | ms | vs floor1 | engine load ms | verified |",
             "|" + "---|" * 10]
    by = {}
    for r in rows:
        by[(r["model"], r["case"])] = r
        f1 = by[(r["model"], "floor1")]["s"]
        load = f"{r['load_s'] * 1e3:.1f}" if "load_s" in r else ""
        lines.append(f"| {r['model']} | {r['case']} | {r['gpus']} | {r['ranks']} | {r['gb']:.2f} | {r['buckets']} | "
                     f"{r['s'] * 1e3:.1f} | {r['s'] / f1:.2f}x | {load} | {r.get('verified', '')} |")
    notes = []
    for model in dict.fromkeys(r["model"] for r in rows):
        g = {case: r for (m, case), r in by.items() if m == model}
        f1 = g["floor1"]["s"]
        if "ours3" in g:
            x = g["ours3"]["s"] / f1
            notes.append(f"- {model}: ours3 / floor1 = {x:.2f}x (target <= 1.25x: {'hit' if x <= 1.25 else 'missed'}); "
                         f"floor3 / floor1 = {g['floor3']['s'] / f1:.2f}x; ours3 / ours1 = {g['ours3']['s'] / g['ours1']['s']:.2f}x")
        notes.append(f"- {model}: per-shard ideal split2 / full-tensor floor2 = {g['split2']['s'] / g['floor2']['s']:.2f}x")
        if "ours_tp2" in g:
            notes.append(f"- {model}: TP=2 vs TP=1: sync {g['ours_tp2']['s'] / g['ours1']['s']:.2f}x, engine load "
                         f"{g['ours_tp2']['load_s'] * 1e3:.1f} ms vs {g['ours1']['load_s'] * 1e3:.1f} ms")
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.1-8b"], choices=["llama-3.2-1b", "llama-3.1-8b"])
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gpu-mem", type=float, default=0.35, help="gpu_memory_utilization of every engine")
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke: gloo, tiny shape, receivers stand in for vLLM")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    args = ap.parse_args()
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    if args.dry_run:
        args.models = ["tiny"]
        args.bucket_mb = min(args.bucket_mb, 0.25)
    elif torch.cuda.device_count() < 4:
        raise SystemExit(f"needs 4 GPUs (trainer on GPU 0, engines on 1-3); this machine has {torch.cuda.device_count()}")
    rows = []
    for m in args.models:
        rows += run(m, args)
    text = report(rows)
    print(text)
    if args.out:
        machine = "cpu (dry run)" if args.dry_run else f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
        with open(args.out, "a") as f:
            f.write(f"\n## Weight sync fan-out into vLLM engines ({time.strftime('%Y-%m-%d')}, {machine})\n\n"
                    f"`python {' '.join(sys.argv)}`\n\n{text}\n")


if __name__ == "__main__":
    main()
