"""Weight-sync benchmark on GPUs: ours vs the hardware floor vs the naive per-parameter path.

    python bench/weight_sync.py --models llama-3.2-1b llama-3.1-8b qwen3-30b-a3b --out bench/RESULTS.md

Two processes per case, as in production: a "trainer" holding random bf16 weights in real shapes
(bench/shapes.py) and an "engine" holding its own copy. Disaggregated: trainer on GPU 1, engine on GPU 0,
NCCL. Colocated: both on GPU 0, CUDA IPC. For each case, in the same run:
  floor  - disaggregated: one NCCL broadcast of all the bytes in one buffer; colocated: one
           device-to-device copy of them (the least any sync must do);
  naive  - what users run today: one control message plus one broadcast (or one CUDA IPC handle)
           per parameter, loaded one tensor at a time;
  ours   - WeightSender/WeightReceiver: bucketed, double-buffered, one control message per sync
           (disaggregated) or per bucket (colocated), with and without checksum verification.
Control messages go over a pipe (a stand-in for the Ray call, same for naive and ours). Every timed
sync ends when the engine reports done. Medians of `--repeats` after a warm-up. The engine's weights
are checked against the trainer's after our sync (checksums), so a fast wrong sync cannot pass.
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.shapes import MODELS  # noqa: E402
from rlhf_orch.types import dtype_from_name  # noqa: E402
from rlhf_orch.weight_sync import WeightReceiver, WeightSender, plan_buckets  # noqa: E402
from rlhf_orch.weight_sync.buckets import checksums  # noqa: E402
from rlhf_orch.weight_sync.collective import BroadcastGroup, free_port  # noqa: E402
from rlhf_orch.weight_sync.ipc import open_handle  # noqa: E402


def _alloc(specs, device, random: bool):
    out = {}
    for s in specs:
        t = torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device=device)
        if random:
            t.normal_()
        out[s.name] = t
    return out


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _device(index: int) -> torch.device:
    # --device cpu runs the same protocol with gloo and shared memory (a smoke test of the script itself)
    if os.environ.get("RLHF_BENCH_DEVICE", "cuda") == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _backend(dev) -> str:
    return "nccl" if dev.type == "cuda" else "gloo"


def trainer_main(conn, model, placement, port, bucket_mb, repeats, naive_repeats):
    dev = _device(1 if placement == "disagg" else 0)
    specs = MODELS[model]()
    total = sum(s.nbytes for s in specs)
    res = {"model": model, "placement": placement, "bytes": total, "tensors": len(specs), "bucket_mb": bucket_mb}
    group = None
    if placement == "disagg":
        group = BroadcastGroup(_backend(dev), "127.0.0.1", port, 0, 2, 600, dev)
        group.warmup()

    def call(cmd, arg=None):
        conn.send((cmd, arg))
        return conn.recv()

    def timed(fn, reps):
        """Median wall time of fn() (which ends with the engine's reply), after one warm-up run."""
        ts, out = [], None
        for _ in range(reps + 1):
            _sync(dev)
            t0 = time.perf_counter()
            out = fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[1:]), out

    # --- floors (before the weights exist, so the single buffers fit)
    if placement == "disagg":
        buf = torch.empty(total, dtype=torch.uint8, device=dev).random_()
        call("bcast_alloc", total)

        def floor():
            conn.send(("bcast", None))
            group.broadcast(buf)
            return conn.recv()
        res["floor_s"], _ = timed(floor, repeats)
        del buf
        call("free")
    torch.cuda.empty_cache()
    res["copy_floor_s"] = call("copy_floor", total)
    if placement == "coloc":
        res["floor_s"] = res["copy_floor_s"]

    params = _alloc(specs, dev, random=True)
    call("alloc")
    # --- naive: one control message + one transfer per parameter, as engines' per-param APIs do
    if placement == "disagg":
        def naive():
            conn.send(("naive", None))
            for name, t in params.items():
                conn.send(("p", name, None))
                group.broadcast(t)
            conn.send(("p", None, None))
            return conn.recv()
    else:
        from rlhf_orch.weight_sync.ipc import allocate_shared, export_handle

        def naive():
            conn.send(("naive", None))
            for name, t in params.items():
                # a fresh tensor per parameter, as a ZeRO-3 gather hands over (and so a fresh handle to open);
                # like the per-parameter colocated APIs, wait for the engine's ack before freeing it
                bid, fresh = allocate_shared(t.numel() * t.element_size(), dev)
                fresh.view(t.dtype).view(t.shape).copy_(t)
                _sync(dev)
                conn.send(("p", name, pickle.dumps((export_handle(bid, fresh), t.dtype, tuple(t.shape)))))
                conn.recv()
                del fresh
            conn.send(("p", None, None))
            return conn.recv()
    res["naive_s"], _ = timed(naive, naive_repeats)

    # --- ours
    layouts = plan_buckets(specs, int(bucket_mb * 2**20))
    res["buckets"] = len(layouts)
    for verify in (True, False):
        sender = WeightSender(layouts, dev, ["engine"] if placement == "coloc" else [], group, verify=verify)
        call("ours_setup", (layouts, verify))
        last = {}

        def ours():
            conn.send(("ours", None))
            r = sender.send(iter(params.items()), 1, deliver=lambda e, h, i, v: conn.send(("ipc", h, i)),
                            wait=lambda _: conn.recv())
            conn.send(("end", None, None))
            last["r"] = r
            return conn.recv()          # (engine checksums, load seconds) once everything is loaded
        key = "ours_s" if verify else "ours_noverify_s"
        res[key], (engine_sums, load_s) = timed(ours, repeats)
        if verify:
            r = last["r"]
            got = r.engine_checksums["engine"][-len(r.checksums):] if placement == "coloc" else engine_sums
            res["verified"] = bool(r.checksums) and got == r.checksums and len(r.checksums) == len(specs)
            res.update(pack_s=r.pack_s, send_wait_s=r.wait_s, load_s=load_s)
        sender = None   # free its buffers before the next variant allocates
        torch.cuda.empty_cache()
    call("quit")
    return res


def engine_main(conn, model, placement, port):
    dev = _device(0)
    specs = MODELS[model]()
    group = None
    if placement == "disagg":
        group = BroadcastGroup(_backend(dev), "127.0.0.1", port, 1, 2, 600, dev)
        group.warmup()
    params, buf, recv, verify = None, None, None, True
    while True:
        cmd, arg = conn.recv()[:2]
        if cmd == "quit":
            conn.send("bye")
            return
        if cmd == "bcast_alloc":
            buf = torch.empty(arg, dtype=torch.uint8, device=dev)
            conn.send("ok")
        elif cmd == "bcast":
            group.broadcast(buf)
            _sync(dev)
            conn.send("done")
        elif cmd == "free":
            buf = None
            torch.cuda.empty_cache()
            conn.send("ok")
        elif cmd == "copy_floor":
            a = torch.empty(arg, dtype=torch.uint8, device=dev).random_()
            b = torch.empty_like(a)
            for _ in range(2):
                b.copy_(a)
            ts = []
            for _ in range(5):
                if dev.type == "cuda":
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record(); b.copy_(a); e.record(); e.synchronize()
                    ts.append(s.elapsed_time(e) / 1e3)
                else:
                    t0 = time.perf_counter(); b.copy_(a); ts.append(time.perf_counter() - t0)
            del a, b
            torch.cuda.empty_cache()
            conn.send(statistics.median(ts))
        elif cmd == "alloc":
            params = _alloc(specs, dev, random=False)
            conn.send("ok")
        elif cmd == "naive":
            while True:
                _, name, handle = conn.recv()
                if name is None:
                    break
                if placement == "disagg":
                    t = torch.empty_like(params[name])     # as engines do: receive into a fresh tensor, then load
                    group.broadcast(t)
                else:
                    h, dtype, shape = pickle.loads(handle)
                    t = open_handle(h).view(dtype).view(shape)   # opens one IPC handle per tensor
                params[name].copy_(t)
                if placement != "disagg":
                    _sync(dev)
                    del t
                    conn.send("ack")
            _sync(dev)
            conn.send("done")
        elif cmd == "ours_setup":
            layouts, verify = arg
            recv = WeightReceiver(layouts, dev,
                                  lambda named: torch._foreach_copy_([params[n] for n, _ in named], [t for _, t in named]),
                                  lambda names: checksums(params[n] for n in names))
            if group is not None:
                recv.attach_group(group)
            conn.send("ok")
        elif cmd == "ours":
            t0 = time.perf_counter()
            if placement == "disagg":
                sums, m = recv.receive_broadcast(verify)
                load_s = m["load_s"]
                conn.recv()                                # the trainer's "end"
            else:
                sums, load_s = [], 0.0
                while True:
                    msg = conn.recv()
                    if msg[0] == "end":
                        break
                    t1 = time.perf_counter()
                    conn.send(recv.receive_ipc(msg[1], msg[2], verify))
                    load_s += time.perf_counter() - t1
            _sync(dev)
            conn.send((sums, load_s))


def run_case(model, placement, bucket_mb, repeats, naive_repeats):
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    port = free_port("127.0.0.1")
    eng = ctx.Process(target=engine_main, args=(b, model, placement, port), daemon=True)
    eng.start()
    try:
        return trainer_main(a, model, placement, port, bucket_mb, repeats, naive_repeats)
    finally:
        eng.join(timeout=60)
        if eng.is_alive():
            eng.terminate()


def table(rows) -> str:
    head = ("| model | placement | GB | tensors | buckets | floor ms | naive ms | ours ms | ours/floor | naive/ours | "
            "ours no-verify ms | pack ms | load ms | verified |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        ms = lambda k: f"{r[k] * 1e3:.1f}" if k in r else "-"
        lines.append(f"| {r['model']} | {r['placement']} | {r['bytes'] / 1e9:.2f} | {r['tensors']} | {r.get('buckets', '-')} | "
                     f"{ms('floor_s')} | {ms('naive_s')} | {ms('ours_s')} | {r['ours_s'] / r['floor_s']:.2f}x | "
                     f"{r['naive_s'] / r['ours_s']:.1f}x | {ms('ours_noverify_s')} | {ms('pack_s')} | {ms('load_s')} | "
                     f"{r.get('verified')} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b", "qwen3-30b-a3b"], choices=list(MODELS))
    ap.add_argument("--placements", nargs="+", default=["disagg", "coloc"], choices=["disagg", "coloc"])
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--naive-repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: smoke-test the script with gloo")
    ap.add_argument("--out", default=None, help="append the table, command and machine to this markdown file")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ["RLHF_BENCH_DEVICE"] = args.device
    need = 2 if "disagg" in args.placements else 1
    if args.device == "cuda" and torch.cuda.device_count() < need:
        sys.exit(f"needs {need} GPUs (disaggregated runs use GPU 1 -> GPU 0); found {torch.cuda.device_count()}")
    rows = []
    for model in args.models:
        for placement in args.placements:
            t0 = time.perf_counter()
            r = run_case(model, placement, args.bucket_mb, args.repeats, args.naive_repeats)
            rows.append(r)
            print(f"{model} {placement}: floor {r['floor_s']*1e3:.1f} ms, naive {r['naive_s']*1e3:.1f} ms, "
                  f"ours {r['ours_s']*1e3:.1f} ms (no verify {r['ours_noverify_s']*1e3:.1f}), verified={r['verified']} "
                  f"[{time.perf_counter() - t0:.0f}s]", flush=True)
    text = table(rows)
    print(text)
    if args.out:
        gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (smoke test)"
        cmd = "python " + " ".join(sys.argv)
        with open(args.out, "a") as f:
            nccl = ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else "-"
            f.write(f"\n## weight sync, {time.strftime('%Y-%m-%d')}, {torch.cuda.device_count()}x {gpu}, torch {torch.__version__}, "
                    f"NCCL {nccl}\n\n`{cmd}`\n\n{text}\n")


if __name__ == "__main__":
    main()
