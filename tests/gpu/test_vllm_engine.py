"""The vLLM engine on a GPU: the engine contract, then our weight sync into it over NCCL (trainer
tensors on GPU 1, vLLM on GPU 0) and CUDA IPC (both on GPU 0), checked by checksum and by the engine's
logprobs matching an independent forward of the new weights; and sleep/wake (colocation) with the
weights refilled after level 2. Needs vLLM 0.26.0 (staged on the device).

    python -m pytest -q -m gpu tests/gpu/test_vllm_engine.py
"""
import os
import threading

import pytest
import torch

from engine_contract import named_weights, reference_logprobs, run_contract, run_sleep_contract, two_models

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm")
# Spawn, not fork: a test before these may have made a CUDA context in this process (a forked engine core then
# fails with "CUDA error: initialization error", as on 2026-11-27 after tests/gpu/test_vllm_streaming.py).
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

from rlhf_orch.engines.base import SamplingParams  # noqa: E402
from rlhf_orch.engines.vllm import VLLMEngine  # noqa: E402
from rlhf_orch.models import build_tokenizer  # noqa: E402
from rlhf_orch.types import ParamSpec, dtype_name  # noqa: E402
from rlhf_orch.weight_sync import WeightSender, plan_buckets  # noqa: E402
from rlhf_orch.weight_sync.collective import free_port  # noqa: E402

SPEC = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return two_models(tmp_path_factory.mktemp("vllm_models"), SPEC)


@pytest.fixture(scope="module")
def engine(dirs):
    e = VLLMEngine(name="v", model_path=dirs[0], dtype="bfloat16", gpu_memory_utilization=0.25,
                   enforce_eager=True, enable_sleep_mode=True, max_model_len=64, seed=0,
                   kv_cache_memory_gb=1)
    yield e
    getattr(e, "shutdown", lambda: None)()


def test_vllm_engine_contract(engine, dirs):
    assert engine.device_ids()[0].startswith("gpu-")
    run_contract(engine, dirs[0], dirs[1], build_tokenizer(), atol=0.05, dtype=torch.bfloat16)


def test_vllm_engine_sleep_contract(engine, dirs):
    """Sleep levels 2 and 1 through vLLM's CuMemAllocator, weights refilled by load_weights after level 2."""
    run_sleep_contract(engine, dirs[0], build_tokenizer(), atol=0.05, dtype=torch.bfloat16)


def _check_logprobs(engine, model_dir, version):
    p = build_tokenizer()("2+3=", add_special_tokens=False).input_ids
    s = engine.generate([p], SamplingParams(temperature=1.0, max_new_tokens=4, n=1))[0]
    assert s.weight_version == version
    ref = reference_logprobs(model_dir, s.prompt_ids, s.response_ids, 1.0)
    assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(ref), atol=0.05), (s.logprobs, ref)


@pytest.mark.parametrize("placement", ["nccl", "ipc_stream"])
def test_sync_into_vllm(engine, dirs, placement):
    if placement == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    target = dirs[1]     # the sleep contract left the engine on dirs[0]
    dev = torch.device("cuda", 1 if placement == "nccl" else 0)
    weights = [(n, t.to(dev)) for n, t in named_weights(target, torch.bfloat16)]
    layouts = plan_buckets([ParamSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in weights], 64 * 1024)
    assert len(layouts) >= 3
    engine.pause()
    if placement == "nccl":
        port, box = free_port("127.0.0.1"), {}

        group = {"backend": "nccl", "host": "127.0.0.1", "port": port, "world_size": 2, "sums": True}

        def trainer_side():   # the engine checks the sums itself
            box["sender"] = WeightSender(layouts, dev, {"broadcast": group})
        t = threading.Thread(target=trainer_side)
        t.start()
        engine.setup_receiver(layouts, "broadcast", {**group, "rank": 1}, True, 120)
        t.join(120)
        assert engine.connect(box["sender"].offers()["broadcast"]) is None   # broadcast answers nothing
        res = {}
        t = threading.Thread(target=lambda: res.update(r=box["sender"].send(iter(weights), 2)))
        t.start()
        got, _ = engine.receive(0, True)
        t.join(120)
        sent = res["r"]
        assert got == sent.checksums
    else:   # one call per sync: the worker takes every bucket through the mailbox and checks each tensor
        engine.setup_receiver(layouts, "ipc", {}, True, 120)
        sender = WeightSender(layouts, dev, {"ipc": {"engines": ["v"]}}, timeout_s=120)
        sender.accept("ipc", "v", engine.connect(sender.offers()["ipc"]))
        res = {}
        t = threading.Thread(target=lambda: res.update(r=sender.send(iter(weights), 4, sync_id=1)))
        t.start()
        got, timings = engine.receive(1, True)
        t.join(120)
        sent = res["r"]
        assert got == sent.checksums and timings["load_s"] > 0
    version = {"nccl": 2, "ipc_stream": 4}[placement]
    engine.finish_sync(version)
    engine.resume()
    _check_logprobs(engine, target, version)


def _stream_sync(engine, sender, weights, version, sync_id):
    res = {}
    t = threading.Thread(target=lambda: res.update(r=sender.send(iter(weights), version, sync_id=sync_id)))
    t.start()
    got, timings = engine.receive(sync_id, True)
    t.join(120)
    assert got == res["r"].checksums
    engine.finish_sync(version)
    return res["r"]


def _flat(weights, dev):
    """The trainer's tensors as views of one flat buffer (as DeepSpeed ZeRO-1/2 keeps them), values copied in."""
    sizes = [(t.numel() * t.element_size() + 255) // 256 * 256 for _, t in weights]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
    out, off = [], 0
    for (n, t), size in zip(weights, sizes):
        v = flat[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        out.append((n, v))
        off += size
    return out


def test_replayed_syncs_into_vllm_follow_the_weights_and_survive_sleep(engine, dirs):
    """Load replay (weight_sync/replay.py): the first sync records where vLLM's load_weights puts every tensor
    (q/k/v and gate/up into fused parameters), later ones redo it with the fused copy-and-checksum kernel. The
    engine must then serve each new model's logprobs exactly, also after a level-2 sleep."""
    dev = torch.device("cuda", 0)
    ws = [[(n, t.to(dev)) for n, t in named_weights(d, torch.bfloat16)] for d in dirs]
    layouts = plan_buckets([ParamSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in ws[0]], 64 * 1024)
    trainer = _flat(ws[0], dev)       # the trainer's own tensors: they stay put, their values change
    engine.pause()
    engine.setup_receiver(layouts, "ipc", {}, True, 120)
    sender = WeightSender(layouts, dev, {"ipc": {"engines": ["v"]}}, timeout_s=120)
    sender.accept("ipc", "v", engine.connect(sender.offers()["ipc"]))

    def sync(k, version, sync_id):
        torch._foreach_copy_([t for _, t in trainer], [t for _, t in ws[k % 2]])
        engine.pause()
        return _stream_sync(engine, sender, trainer, version, sync_id)

    for k in range(4):   # the weights alternate, so a replay that did nothing would show
        sync(k, 20 + k, 100 + k)
        engine.resume()
        _check_logprobs(engine, dirs[k % 2], 20 + k)
    (status,) = engine.replay_status()
    assert status["replayed"] == list(range(len(layouts))) and not status["loader"], status
    assert status["fused_kernel"], status
    engine.sleep(2)
    engine.wake_up(["weights"])
    sync(1, 30, 200)
    engine.resume()
    engine.wake_up(["kv_cache"])
    _check_logprobs(engine, dirs[1], 30)
