"""The bulk step of a colocated sync alone: pack a model's tensors into buckets and checksum them, old vs new.

    python bench/copysum_kernel.py --models llama-3.2-1b llama-3.1-8b qwen3-30b-a3b --repeats 10

Per model shape (random bf16 tensors on GPU 0, 512 MiB buckets), interleaved in every round:
  floor      a device-to-device copy of the same bytes, bucket by bucket
  old        torch._foreach_copy_ into the bucket, then buckets.bucket_checksums (the sender before copysum.py)
  fused      copysum.CopyPlan: copy and checksum in one kernel launch per bucket (the sender and replaying engines now)
  sum_only   the same kernel reading the destinations only (what a recording sync costs on top)
and the fused kernel again for each (BLOCK, num_warps) variant given. Prints medians, min-max and x floor.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.shapes import MODELS  # noqa: E402
from rlhf_orch.types import dtype_from_name  # noqa: E402
from rlhf_orch.weight_sync import copysum, plan_buckets  # noqa: E402
from rlhf_orch.weight_sync.buckets import bucket_checksums, checksums, slot_view  # noqa: E402


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"], choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--variants", nargs="*", default=["1024x4", "4096x8"], help="BLOCKxWARPS of extra fused runs")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, Triton kernel: {copysum.triton_available(dev)}")
    rows = ["| model | GB | tensors | measure | median ms | min-max ms | x floor | GB/s (bytes moved once) |",
            "|---|---|---|---|---|---|---|---|"]
    for model in args.models:
        specs = MODELS[model]()
        layouts = plan_buckets(specs, int(args.bucket_mb * 2**20))
        params = {s.name: torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device=dev).normal_() for s in specs}
        n = max(lay.nbytes for lay in layouts)
        bufs = [torch.zeros(n, dtype=torch.uint8, device=dev) for _ in range(2)]
        plans = [copysum.CopyPlan([copysum.Run(params[s.name].view(-1).view(torch.uint8),
                                               slot_view(bufs[lay.index % 2], s).view(-1).view(torch.uint8), k)
                                   for k, s in enumerate(lay.slots)], len(lay.slots), dev) for lay in layouts]
        total = sum(lay.nbytes for lay in layouts)

        def floor():
            for lay in layouts:
                bufs[1][:lay.nbytes].copy_(bufs[0][:lay.nbytes])

        def old():
            for lay in layouts:
                buf = bufs[lay.index % 2]
                torch._foreach_copy_([slot_view(buf, s) for s in lay.slots], [params[s.name] for s in lay.slots])
                bucket_checksums(lay, buf)

        def fused(copy=True):
            return [p.run(copy=copy) for p in plans]

        # Correct first: the fused sums equal the tensors' checksums.
        got = [x for sums in fused() for x in sums]
        assert got == checksums(params[s.name] for s in specs), "fused checksums differ from the tensors'"
        measures = {"floor": floor, "old": old, "fused": fused, "sum_only": lambda: fused(False)}
        for v in args.variants:
            b, w = (int(x) for x in v.split("x"))

            def variant(b=b, w=w):
                copysum._BLOCK, copysum._WARPS = b, w
                try:
                    fused()
                finally:
                    copysum._BLOCK, copysum._WARPS = 2048, 8
            measures[f"fused {v}"] = variant
        for fn in measures.values():   # warm-up (Triton compiles)
            fn()
        times = {k: [] for k in measures}
        for _ in range(args.repeats):
            for k, fn in measures.items():
                times[k].append(timed(fn))
        fl = statistics.median(times["floor"])
        for k, xs in times.items():
            med = statistics.median(xs)
            rows.append(f"| {model} | {total / 1e9:.2f} | {len(specs)} | {k} | {med * 1e3:.2f} | "
                        f"{min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f} | {med / fl:.2f}x | {total / med / 1e9:.0f} |")
        del params, bufs, plans
        torch.cuda.empty_cache()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
