"""A tensor-parallel (TP=2) vLLM engine taking our NCCL broadcast: every worker joins the group, loads its slice of
each tensor, and after the first sync replays its recorded copies (weight_sync/replay.py, sharded plans). The
engine must then serve each new model's logprobs, and the checksums of what it received must equal the trainer's.
Needs 3 GPUs (the engine on 0 and 1, the trainer's tensors on 2) and vLLM 0.26.0 (staged on the device).

    CUDA_VISIBLE_DEVICES=0,1,2 python -m pytest -q -m gpu tests/gpu/test_vllm_tp.py
"""
import threading

import pytest
import torch

from engine_contract import named_weights, two_models
from test_vllm_engine import SPEC, _check_logprobs   # (it sets vLLM's spawn: this process holds GPU 2's context)

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm")
if torch.cuda.device_count() < 3:
    pytest.skip("needs 3 GPUs", allow_module_level=True)

from rlhf_orch.engines.vllm import VLLMEngine  # noqa: E402
from rlhf_orch.types import ParamSpec, dtype_name  # noqa: E402
from rlhf_orch.weight_sync import WeightSender, plan_buckets  # noqa: E402
from rlhf_orch.weight_sync.collective import free_port  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return two_models(tmp_path_factory.mktemp("vllm_tp_models"), SPEC)


def test_tp2_engine_replays_its_slices_and_serves_each_synced_model(dirs):
    engine = VLLMEngine(name="v", model_path=dirs[0], dtype="bfloat16", gpu_memory_utilization=0.25,
                        enforce_eager=True, enable_sleep_mode=False, max_model_len=64, seed=0,
                        kv_cache_memory_gb=1, tensor_parallel_size=2)
    try:
        dev = torch.device("cuda", 2)
        ws = [[(n, t.to(dev)) for n, t in named_weights(d, torch.bfloat16)] for d in dirs]
        layouts = plan_buckets([ParamSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in ws[0]], 64 * 1024)
        assert len(layouts) >= 3
        port, box = free_port("127.0.0.1"), {}

        group = {"backend": "nccl", "host": "127.0.0.1", "port": port, "world_size": 3, "sums": True}

        def trainer_side():   # each worker checks the sums
            box["sender"] = WeightSender(layouts, dev, {"broadcast": group})
        t = threading.Thread(target=trainer_side)
        t.start()
        engine.pause()
        engine.setup_receiver(layouts, "broadcast", {**group, "rank": 1}, True, 120)   # TP workers: ranks 1 and 2
        t.join(120)
        assert engine.connect(box["sender"].offers()["broadcast"]) is None   # broadcast answers nothing
        for k in range(4):   # the weights alternate, so a replay that copied nothing would show
            engine.pause()
            res = {}
            t = threading.Thread(target=lambda: res.update(r=box["sender"].send(iter(ws[(k + 1) % 2]), 10 + k)))
            t.start()
            got, _ = engine.receive(0, True)
            t.join(120)
            assert got == res["r"].checksums
            engine.finish_sync(10 + k)
            engine.resume()
            _check_logprobs(engine, dirs[(k + 1) % 2], 10 + k)
        statuses = engine.replay_status()
        assert len(statuses) == 2
        for status in statuses:
            assert status["replayed"] == list(range(len(layouts))) and not status["loader"], status
            assert status["sharded"] and status["fused_kernel"], status
    finally:
        getattr(engine, "shutdown", lambda: None)()
