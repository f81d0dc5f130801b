"""Weight sync into a real SGLang 0.5.17 engine: ours vs the floor vs SGLang's per-parameter and one-call paths.

    PYTHONPATH=/tmp/site-sglang:$PWD NCCL_NVLS_ENABLE=0 python bench/weight_sync_sglang.py \\
        --models llama-3.2-1b llama-3.1-8b --out bench/RESULTS.md

The engine is `rlhf_orch.engines.sglang.SGLangEngine` (SGLang on GPU 0, random "dummy" weights in the real
shape); the trainer's tensors are random bf16 in this process. Disaggregated: trainer tensors on GPU 1, NCCL
into SGLang's scheduler through `init_weights_update_group` (our `BroadcastGroup` as rank 0). Colocated:
trainer tensors on GPU 0, CUDA IPC. Medians after a warm-up.
floor: disaggregated, all the bytes as ONE `update_weights_from_distributed` flattened bucket that our hook
  drops unloaded (SGLang's receive path: allocation + broadcast; >= the raw link floor in DESIGN.md);
  colocated, one device copy of the bytes.
per-param: one SGLang call per parameter (`update_weights_from_distributed` / `update_weights_from_tensor`
  with one tensor), the loop users write today.
one-call: SGLang's own batched call listing every tensor (per-tensor broadcasts / per-tensor IPC handles).
ours: `SGLangEngine.receive_broadcast` / `receive_ipc`: one flattened-bucket call per bucket, the received
  checksums compared to the trainer's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.shapes import MODELS  # noqa: E402
from bench.weight_sync_vllm import SHAPES, median_after_warmup, model_dir  # noqa: E402
from rlhf_orch.engines.sglang import _PAD, SGLangEngine  # noqa: E402
from rlhf_orch.types import dtype_from_name  # noqa: E402
from rlhf_orch.weight_sync import WeightSender, plan_buckets  # noqa: E402
from rlhf_orch.weight_sync.collective import GROUP_NAME, BroadcastGroup, free_port  # noqa: E402


def with_sender(send, receive):
    """Trainer side in a thread, engine side here; re-raises a failure of either."""
    box = {}

    def run():
        try:
            box["r"] = send()
        except Exception as e:
            box["e"] = e
    th = threading.Thread(target=run)
    th.start()
    out = receive()
    th.join()
    if "e" in box:
        raise box["e"]
    return out


def run(model: str, placement: str, bucket_mb: float, reps: int, root: Path) -> dict:
    specs = MODELS[model]()
    dev = torch.device("cuda", 1 if placement == "disagg" else 0)
    engine = SGLangEngine(name="s", model_path=model_dir(model, root), dtype="bfloat16", load_format="dummy",
                          mem_fraction_static=0.35, disable_cuda_graph=True, context_length=64)
    sg = engine.engine
    res = {"model": model, "placement": placement, "bytes": sum(s.nbytes for s in specs), "tensors": len(specs)}
    try:
        params = {s.name: torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device=dev).normal_() for s in specs}
        layouts = plan_buckets(specs, int(bucket_mb * 2**20))
        res["buckets"] = len(layouts)
        engine.pause()
        if placement == "disagg":
            port, box = free_port("127.0.0.1"), {}

            def make_group():   # rank 0 must take part in the warm-up broadcast, or the engine waits forever
                box["g"] = BroadcastGroup("nccl", "127.0.0.1", port, 0, 2, 300, dev)
                box["g"].warmup()
            th = threading.Thread(target=make_group)
            th.start()
            engine.setup_receiver(layouts, {"backend": "nccl", "host": "127.0.0.1", "port": port, "world_size": 2}, 1, True, 300)
            th.join()
            group = box["g"]
            sender = WeightSender(layouts, dev, [], group)

            raw = torch.empty(res["bytes"], dtype=torch.uint8, device=dev).random_()

            def floor():
                with_sender(lambda: (group.broadcast(raw), torch.cuda.synchronize(dev)),
                            lambda: sg.update_weights_from_distributed(names=[_PAD + "floor"], dtypes=["uint8"], shapes=[[res["bytes"]]],
                                                                       group_name=GROUP_NAME, flush_cache=False,
                                                                       load_format="flattened_bucket"))
                engine._after_load([], False)
            res["floor_s"] = median_after_warmup(floor, reps)
            del raw
            torch.cuda.empty_cache()

            last = {}

            def ours():
                last["got"], _ = with_sender(lambda: last.update(r=sender.send(iter(params.items()), 1)),
                                             lambda: engine.receive_broadcast(True))
            res["ours_s"] = median_after_warmup(ours, reps)
            res["verified"] = last["got"] == last["r"].checksums

            def send_each():
                for t in params.values():
                    group.broadcast(t)
                torch.cuda.synchronize(dev)

            engine._install(False)   # naive paths: the hook only drops reserved names, no checksums

            def per_param():
                def recv():
                    for s in specs:
                        engine._call("update_weights_from_distributed", sg.update_weights_from_distributed, names=[s.name],
                                     dtypes=[s.dtype], shapes=[list(s.shape)], group_name=GROUP_NAME, flush_cache=False)
                    engine._install(False)
                with_sender(send_each, recv)
            res["naive_s"] = median_after_warmup(per_param, 1)

            def one_call():
                with_sender(send_each, lambda: engine._call(
                    "update_weights_from_distributed", sg.update_weights_from_distributed, names=[s.name for s in specs],
                    dtypes=[s.dtype for s in specs], shapes=[list(s.shape) for s in specs], group_name=GROUP_NAME, flush_cache=False))
                engine._install(False)
            res["one_call_s"] = median_after_warmup(one_call, reps)
        else:
            a = torch.empty(res["bytes"], dtype=torch.uint8, device=dev).random_()
            b = torch.empty_like(a)
            b.copy_(a)
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = []
            for _ in range(reps):
                ev0.record(); b.copy_(a); ev1.record(); ev1.synchronize(); ts.append(ev0.elapsed_time(ev1) / 1e3)
            res["floor_s"] = statistics.median(ts)
            del a, b
            torch.cuda.empty_cache()
            engine.setup_receiver(layouts, None, 0, True, 300)
            sender = WeightSender(layouts, dev, ["s"])
            last = {}

            def ours():
                last["r"] = sender.send(iter(params.items()), 1, deliver=lambda e, h, i, v: engine.receive_ipc(h, i, True),
                                        wait=lambda x: x)
            res["ours_s"] = median_after_warmup(ours, reps)
            res["verified"] = last["r"].engine_checksums["s"] == last["r"].checksums
            engine._install(False)

            def per_param():
                for name, t in params.items():
                    engine._call("update_weights_from_tensor", sg.update_weights_from_tensor, [(name, t)], flush_cache=False)
                engine._install(False)
            res["naive_s"] = median_after_warmup(per_param, 1)

            def one_call():
                engine._call("update_weights_from_tensor", sg.update_weights_from_tensor, list(params.items()), flush_cache=False)
                engine._install(False)
            res["one_call_s"] = median_after_warmup(one_call, reps)
        return res
    finally:
        engine.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b"], choices=list(SHAPES))
    ap.add_argument("--placements", nargs="+", default=["disagg", "coloc"], choices=["disagg", "coloc"])
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.placements != ["coloc"] and torch.cuda.device_count() < 2:
        sys.exit("the disaggregated case needs 2 GPUs (use --placements coloc on one)")
    import sglang
    root = Path(os.environ.get("TMPDIR", "/tmp")) / "rlhf_orch_sglang_bench"
    rows = []
    for m in args.models:
        for p in args.placements:
            r = run(m, p, args.bucket_mb, args.repeats, root)
            rows.append(r)
            print(f"sglang {m} {p}: floor {r['floor_s']*1e3:.1f} ms, per-param {r['naive_s']*1e3:.1f} ms, one-call "
                  f"{r['one_call_s']*1e3:.1f} ms, ours {r['ours_s']*1e3:.1f} ms, verified={r['verified']}", flush=True)
    lines = ["| engine | model | placement | GB | tensors | buckets | floor ms | per-param ms | one-call ms | ours ms | "
             "ours/floor | per-param/ours | verified |", "|" + "---|" * 13]
    for r in rows:
        lines.append(f"| SGLang {sglang.__version__} | {r['model']} | {r['placement']} | {r['bytes']/1e9:.2f} | {r['tensors']} | "
                     f"{r['buckets']} | {r['floor_s']*1e3:.1f} | {r['naive_s']*1e3:.1f} | {r['one_call_s']*1e3:.1f} | "
                     f"{r['ours_s']*1e3:.1f} | {r['ours_s']/r['floor_s']:.2f}x | {r['naive_s']/r['ours_s']:.1f}x | {r['verified']} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n## weight sync into SGLang, {time.strftime('%Y-%m-%d')}, {torch.cuda.device_count()}x "
                    f"{torch.cuda.get_device_name(0)}\n\n`python {' '.join(sys.argv)}`\n\n{text}\n")


if __name__ == "__main__":
    main()
