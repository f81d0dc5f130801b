"""Weight sync into a real vLLM 0.26.0 engine: ours vs the link floor vs the per-parameter path.

    python bench/weight_sync_vllm.py --models llama-3.2-1b llama-3.1-8b --out bench/RESULTS.md

The engine is `rlhf_orch.engines.vllm.VLLMEngine` (vLLM on GPU 0, random "dummy" weights in the real
shape); the trainer's tensors are random bf16 in this process. Disaggregated: trainer tensors on GPU 1,
NCCL into the engine's worker through our group. Colocated: trainer tensors on GPU 0, CUDA IPC.
floor: one raw broadcast of all the bytes (disaggregated) or one device copy of them (colocated).
naive: one collective_rpc plus one broadcast (or one fresh IPC handle) per parameter, each followed by
`load_weights` of that one tensor: the per-parameter loop our users run today.
ours: the engine's own receiver (one collective_rpc per sync, or per bucket for IPC), bucketed, with
the received checksums compared to the trainer's. Medians after a warm-up.
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
from rlhf_orch.types import dtype_from_name  # noqa: E402
from rlhf_orch.weight_sync import WeightSender, plan_buckets  # noqa: E402
from rlhf_orch.weight_sync.collective import BroadcastGroup, free_port  # noqa: E402
from rlhf_orch.weight_sync.ipc import allocate_shared, export_handle  # noqa: E402
from rlhf_orch.engines.vllm_worker import pack_arg  # noqa: E402

SHAPES = {"llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
          "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)}


def model_dir(model: str, root: Path) -> str:
    from transformers import LlamaConfig
    from rlhf_orch.models import build_tokenizer
    path = root / model
    LlamaConfig(**SHAPES[model], max_position_embeddings=2048, torch_dtype="bfloat16", architectures=["LlamaForCausalLM"]).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def median_after_warmup(fn, reps):
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:])


def run(model: str, placement: str, bucket_mb: float, reps: int, root: Path) -> dict:
    from rlhf_orch.engines.vllm import VLLMEngine
    specs = MODELS[model]()
    dev = torch.device("cuda", 1 if placement == "disagg" else 0)
    engine = VLLMEngine(name="v", model_path=model_dir(model, root), dtype="bfloat16", load_format="dummy",
                        gpu_memory_utilization=0.35, enforce_eager=True, enable_sleep_mode=False, max_model_len=64)
    res = {"model": model, "placement": placement, "bytes": sum(s.nbytes for s in specs), "tensors": len(specs)}
    try:
        params = {s.name: torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device=dev).normal_() for s in specs}
        layouts = plan_buckets(specs, int(bucket_mb * 2**20))
        res["buckets"] = len(layouts)
        engine.pause()
        if placement == "disagg":
            port, box = free_port("127.0.0.1"), {}
            def make_group():   # rank 0 must take part in the warm-up broadcast, or the worker waits forever
                g = BroadcastGroup("nccl", "127.0.0.1", port, 0, 2, 120, dev)
                g.warmup()
                box["g"] = g
            t = threading.Thread(target=make_group)
            t.start()
            engine.setup_receiver(layouts, {"backend": "nccl", "host": "127.0.0.1", "port": port, "world_size": 2}, 1, True, 120)
            t.join()
            group = box["g"]
            sender = WeightSender(layouts, dev, [], group)

            def with_sender(send, receive):
                th = threading.Thread(target=send)
                th.start()
                out = receive()
                th.join()
                return out
            raw = torch.empty(res["bytes"], dtype=torch.uint8, device=dev).random_()
            res["floor_s"] = median_after_warmup(lambda: with_sender(lambda: (group.broadcast(raw), torch.cuda.synchronize(dev)),
                                                                    lambda: engine._rpc("rlhf_recv_raw", res["bytes"])), reps)
            del raw
            last = {}

            def ours():
                r = with_sender(lambda: last.update(r=sender.send(iter(params.items()), 1)), lambda: engine.receive_broadcast(True))
                last["got"] = r[0]
            res["ours_s"] = median_after_warmup(ours, reps)
            res["verified"] = last["got"] == last["r"].checksums

            def naive():
                def send():
                    for t in params.values():
                        group.broadcast(t)
                    torch.cuda.synchronize(dev)
                th = threading.Thread(target=send)
                th.start()
                for s in specs:
                    engine._rpc("rlhf_receive_one", s.name, s.dtype, list(s.shape))
                th.join()
            res["naive_s"] = median_after_warmup(naive, 1)
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
            sender = WeightSender(layouts, dev, ["v"])
            last = {}

            def ours():
                last["r"] = sender.send(iter(params.items()), 1, deliver=lambda e, h, i, v: engine.receive_ipc(h, i, True),
                                        wait=lambda x: x)
            res["ours_s"] = median_after_warmup(ours, reps)
            res["verified"] = last["r"].engine_checksums["v"] == last["r"].checksums

            def naive():
                for s in specs:
                    bid, fresh = allocate_shared(s.nbytes, dev)       # a fresh gathered tensor per parameter
                    fresh.view(dtype_from_name(s.dtype)).view(s.shape).copy_(params[s.name])
                    torch.cuda.synchronize(dev)
                    engine._rpc("rlhf_receive_one_ipc", s.name, pack_arg(export_handle(bid, fresh)), s.dtype, list(s.shape))
            res["naive_s"] = median_after_warmup(naive, 1)
        return res
    finally:
        engine.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"], choices=list(SHAPES))
    ap.add_argument("--placements", nargs="+", default=["disagg", "coloc"], choices=["disagg", "coloc"])
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    root = Path(os.environ.get("TMPDIR", "/tmp")) / "rlhf_orch_vllm_bench"
    rows = []
    for m in args.models:
        for p in args.placements:
            r = run(m, p, args.bucket_mb, args.repeats, root)
            rows.append(r)
            print(f"vllm {m} {p}: floor {r['floor_s']*1e3:.1f} ms, naive {r['naive_s']*1e3:.1f} ms, ours {r['ours_s']*1e3:.1f} ms, "
                  f"verified={r['verified']}", flush=True)
    lines = ["| engine | model | placement | GB | tensors | buckets | floor ms | naive ms | ours ms | ours/floor | naive/ours | verified |",
             "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| vLLM 0.26.0 | {r['model']} | {r['placement']} | {r['bytes']/1e9:.2f} | {r['tensors']} | {r['buckets']} | "
                     f"{r['floor_s']*1e3:.1f} | {r['naive_s']*1e3:.1f} | {r['ours_s']*1e3:.1f} | {r['ours_s']/r['floor_s']:.2f}x | "
                     f"{r['naive_s']/r['ours_s']:.1f}x | {r['verified']} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n## weight sync into vLLM, {time.strftime('%Y-%m-%d')}, {torch.cuda.device_count()}x "
                    f"{torch.cuda.get_device_name(0)}\n\n`python {' '.join(sys.argv)}`\n\n{text}\n")


if __name__ == "__main__":
    main()
