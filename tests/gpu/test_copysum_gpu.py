"""The fused copy-and-checksum kernel (weight_sync/copysum.py) against the torch path, on a GPU with Triton.

    python -m pytest -q -m gpu tests/gpu/test_copysum_gpu.py
"""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
pytest.importorskip("triton")

from rlhf_orch.weight_sync import copysum  # noqa: E402
from rlhf_orch.weight_sync.buckets import checksums  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_equals_the_torch_path_on_random_bytes(seed, monkeypatch):
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(seed)
    # Sizes around a chunk boundary, tiny ones, and ones that are not whole words (those take the torch path).
    sizes = [8, 16, 4096, copysum.CHUNK_WORDS * 8, copysum.CHUNK_WORDS * 8 + 8, 3 * copysum.CHUNK_WORDS * 8 + 24, 6, 130]
    srcs = [torch.randint(0, 256, (n,), generator=g, device=dev, dtype=torch.uint8) for n in sizes]
    slots = [0, 1, 1, 2, 3, 4, 5, 6]   # two runs share slot 1
    want = {}
    for s, k in zip(srcs, slots):
        want.setdefault(k, []).append(s)

    def run(copy_dsts):
        plan = copysum.CopyPlan([copysum.Run(s, d, k) for s, d, k in zip(srcs, copy_dsts, slots)], 7, dev)
        return plan, plan.run()

    dsts = [torch.full_like(s, 7) for s in srcs]
    plan, sums = run(dsts)
    assert plan.kernel_runs == 6 and len(plan.slow) == 2
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    ref = [sum(checksums(want[k])) for k in range(7)]
    wrap = lambda v: (v + 2**63) % 2**64 - 2**63   # noqa: E731  (slot 1: two tensors' sums added mod 2**64)
    assert sums == [wrap(v) for v in ref]
    monkeypatch.setenv("RLHF_ORCH_COPYSUM", "torch")
    monkeypatch.setattr(copysum, "_kernel", None)
    dsts2 = [torch.full_like(s, 7) for s in srcs]
    plan2, sums2 = run(dsts2)
    assert plan2.kernel_runs == 0 and sums2 == sums
    dsts[3][5] ^= 1
    assert plan.run(copy=False) != sums   # checksum of the destinations: the flipped bit shows


def test_kernel_copies_blocks_of_rows_like_the_torch_path(monkeypatch):
    """A tensor-parallel slice: a block of every row of a matrix (row-parallel) and a block of rows, 2-D runs."""
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(3)
    full = torch.randint(0, 256, (300, 4096), generator=g, device=dev, dtype=torch.uint8)   # 300 rows of 4 KiB

    def plan_and_run():
        half = torch.zeros(300, 2048, dtype=torch.uint8, device=dev)
        top = torch.zeros(100, 4096, dtype=torch.uint8, device=dev)
        runs = [copysum.Run(full[:, 2048:], half, 0), copysum.Run(full[100:200], top, 1)]
        plan = copysum.CopyPlan(runs, 2, dev)
        return plan, plan.run(), half, top

    plan, sums, half, top = plan_and_run()
    assert plan.kernel_runs == 2 and not plan.slow and plan.desc.shape[0] == 300 + 100
    assert torch.equal(half, full[:, 2048:]) and torch.equal(top, full[100:200])
    monkeypatch.setenv("RLHF_ORCH_COPYSUM", "torch")
    monkeypatch.setattr(copysum, "_kernel", None)
    plan2, sums2, half2, top2 = plan_and_run()
    assert plan2.kernel_runs == 0 and sums2 == sums and torch.equal(half2, half) and torch.equal(top2, top)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_plan_and_sender_run_on_their_device_whatever_the_current_one():
    """Triton launches on the calling thread's current device: a plan (and a whole send) on GPU 0 called while GPU 1
    is current must still run on GPU 0 (the SGLang GPU tests failed with "invalid resource handle" without it)."""
    from rlhf_orch.types import ParamSpec, dtype_name
    from rlhf_orch.weight_sync import WeightSender, plan_buckets
    from rlhf_orch.weight_sync.mailbox import SLOTS
    dev = torch.device("cuda", 0)
    src = torch.arange(4096, device=dev, dtype=torch.int64).view(torch.uint8)
    dst = torch.zeros_like(src)
    want = copysum.CopyPlan([copysum.Run(src, dst, 0)], 1, dev).run()
    weights = [(f"w{i}", torch.randn(256, 64, device=dev, dtype=torch.bfloat16)) for i in range(4)]
    layouts = plan_buckets([ParamSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in weights], 64 * 1024)
    def send():   # a sender's pack and checksum of every bucket, as its send runs them (no receiver in this process:
        sender = WeightSender(layouts, dev, {"ipc": {"engines": ["e"]}})   # CUDA IPC handles do not open in the process that made them)
        it = iter(weights)
        return [x for lay in layouts for x in sender._pack_and_sum(lay, lay.index % SLOTS, [next(it)[1] for _ in lay.slots])]
    with torch.cuda.device(1):
        dst.zero_()
        assert copysum.CopyPlan([copysum.Run(src, dst, 0)], 1, dev).run() == want and torch.equal(dst, src)
        assert send() == checksums([t for _, t in weights])
