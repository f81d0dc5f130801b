"""The weight-sync benchmark's engine hosts see the GPUs they are given among those the benchmark sees
(bench/sync_bench_lib.py): under CUDA_VISIBLE_DEVICES=3 a colocated host on "GPU 0" must be on GPU 3, as the
trainer is (found on 2026-11-27: tests/gpu/test_weight_sync_gpu.py[coloc] on GPU 3 planned a broadcast)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.sync_bench_lib import visible_gpus  # noqa: E402


def test_host_gpus_are_indices_into_the_benchmarks_own():
    assert visible_gpus("0", None) == "0" and visible_gpus("1,2", "") == "1,2"
    assert visible_gpus("0", "3") == "3"
    assert visible_gpus("1,2", "4, 5,6") == "5,6"
