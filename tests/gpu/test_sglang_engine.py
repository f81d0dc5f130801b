"""The SGLang engine on a GPU: the engine contract, then our weight sync into it through SGLang's own APIs,
over NCCL (trainer tensors on GPU 1, SGLang on GPU 0; `update_weights_from_distributed`, flattened buckets; and our
receiver in the scheduler taking a whole sync in one call, engines/sglang_stream.py)
and CUDA IPC (both on GPU 0; `update_weights_from_tensor`, flattened buckets, a call per bucket; and the one-call
stream of engines/sglang_stream.py), checked by checksum and by the engine's logprobs matching an independent
forward of the new weights. Needs SGLang 0.5.17 (its own folder):

    PYTHONPATH=/tmp/site-sglang:$PWD:$PWD/tests NCCL_NVLS_ENABLE=0 python -m pytest -q -m gpu tests/gpu/test_sglang_engine.py
"""
import threading

import pytest
import torch

from engine_contract import named_weights, reference_logprobs, run_contract, two_models

pytestmark = pytest.mark.gpu
sglang = pytest.importorskip("sglang")

SPEC = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return two_models(tmp_path_factory.mktemp("sglang_models"), SPEC)


@pytest.fixture(scope="module")
def engine(dirs):
    from rlhf_orch.engines.sglang import SGLangEngine
    e = SGLangEngine(name="s", model_path=dirs[0], dtype="bfloat16", mem_fraction_static=0.25,
                     disable_cuda_graph=True, context_length=64, seed=0)
    yield e
    e.shutdown()


def test_sglang_engine_contract(engine, dirs):
    from rlhf_orch.models import build_tokenizer
    assert engine.device_ids()[0] == "gpu-" + str(torch.cuda.get_device_properties(0).uuid)
    run_contract(engine, dirs[0], dirs[1], build_tokenizer(), atol=0.05, dtype=torch.bfloat16)


def _check_logprobs(engine, model_dir, version):
    from rlhf_orch.engines.base import SamplingParams
    from rlhf_orch.models import build_tokenizer
    p = build_tokenizer()("2+3=", add_special_tokens=False).input_ids
    s = engine.generate([p], SamplingParams(temperature=1.0, max_new_tokens=4, n=1))[0]
    assert s.weight_version == version
    ref = reference_logprobs(model_dir, s.prompt_ids, s.response_ids, 1.0)
    assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(ref), atol=0.05), (s.logprobs, ref)


@pytest.mark.parametrize("placement", ["nccl", "nccl_stream"])   # colocated: the stream test below
def test_sync_into_sglang(engine, dirs, placement):
    """nccl: SGLang's own group and one update_weights_from_distributed call per bucket (the tensor-parallel path);
    nccl_stream: our receiver in the scheduler joins the group and takes each sync in one call, checking the
    trainer's checksums that follow the buckets. Both on the engine's one `receive` call per sync."""
    from rlhf_orch.types import ParamSpec, dtype_name
    from rlhf_orch.weight_sync import WeightSender, plan_buckets
    from rlhf_orch.weight_sync.collective import free_port
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    # each case moves the engine to other weights than the case before
    target, version = {"nccl": (dirs[1], 2), "nccl_stream": (dirs[0], 3)}[placement]
    dev = torch.device("cuda", 1)
    weights = [(n, t.to(dev)) for n, t in named_weights(target, torch.bfloat16)]
    layouts = plan_buckets([ParamSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in weights], 64 * 1024)
    assert len(layouts) >= 3
    engine.pause()
    port, box, stream = free_port("127.0.0.1"), {}, placement == "nccl_stream"

    group = {"backend": "nccl", "host": "127.0.0.1", "port": port, "world_size": 2, "sums": stream}

    def trainer_side():
        try:   # its warm-up meets the engine's inside setup_receiver
            box["sender"] = WeightSender(layouts, dev, {"broadcast": group})
        except Exception as e:             # surfaced by the assert below, not lost in the thread
            box["error"] = e
    t = threading.Thread(target=trainer_side)
    t.start()
    secs = engine.setup_receiver(layouts, "broadcast", {**group, "rank": 1}, True, 120)
    t.join(120)
    assert "sender" in box, box.get("error")
    # with the sums: our receiver in the scheduler; without: SGLang's own group, bucket by bucket
    assert secs > 0 and (engine._transport == "broadcast") == stream and engine._group != stream
    assert engine.connect(box["sender"].offers()["broadcast"]) is None   # broadcast answers nothing
    for sync_id in (1, 2):   # the second over the same (warm) group: the path every later training step takes
        res = {}
        t = threading.Thread(target=lambda: res.update(r=box["sender"].send(iter(weights), version, sync_id=sync_id)))
        t.start()
        got, metrics = engine.receive(sync_id, True)
        t.join(120)
        sent = res["r"]
        assert got == sent.checksums
        assert {"load_s", "total_s"} <= set(metrics) and (stream or "transfer_s" in metrics)
    assert engine.checksums([n for n, _ in weights]) == sent.checksums
    engine.finish_sync(version)
    engine.resume()
    _check_logprobs(engine, target, version)


def test_colocated_stream_into_sglang_in_one_call_per_sync(engine, dirs):
    """Our receiver in SGLang's scheduler (engines/sglang_stream.py): the syncs alternate the two models, so the
    replayed copies (sync 2 on) must follow the weights; each is checked in the scheduler and by the logprobs."""
    from rlhf_orch.types import ParamSpec, dtype_name
    from rlhf_orch.weight_sync import WeightSender, plan_buckets
    dev = torch.device("cuda", 0)
    models = [[(n, t.to(dev)) for n, t in named_weights(d, torch.bfloat16)] for d in dirs]
    layouts = plan_buckets([ParamSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in models[0]], 64 * 1024)
    assert engine.capabilities.checks_loads == {"ipc", "broadcast"}   # a single-GPU engine takes both in one call (72a4c1d)
    engine.setup_receiver(layouts, "ipc", {}, True, 120)
    sender = WeightSender(layouts, dev, {"ipc": {"engines": ["s"]}}, timeout_s=120)
    sender.accept("ipc", "s", engine.connect(sender.offers()["ipc"]))
    for sync_id in (1, 2, 3, 4):
        k = sync_id % 2
        engine.pause()
        res = {}
        sender.gpu_handover = sync_id != 3   # sync 3: the per-bucket host hand-over (weight_sync/mailbox.py)
        t = threading.Thread(target=lambda: res.update(r=sender.send(iter(models[k]), 10 + sync_id, sync_id=sync_id)))
        t.start()
        got, metrics = engine.receive(sync_id, True)
        t.join(120)
        assert got == res["r"].checksums and set(metrics) == {"load_s", "wait_s", "total_s", "on_device"}
        assert metrics["on_device"] == float(sender.gpu_handover), (sync_id, metrics)
        engine.finish_sync(10 + sync_id)
        engine.resume()
        _check_logprobs(engine, dirs[k], 10 + sync_id)
    assert engine.checksums([n for n, _ in models[0]]) == res["r"].checksums
