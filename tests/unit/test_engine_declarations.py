"""What engine kinds declare rather than have probed (rlhf_orch/engines): their capabilities, which the rollout
actor, the coordinator and the benchmarks read (engines/base.Capabilities), and the LLM options VLLMEngine adds from
its environment. Checked on CPU: no engine library is imported (SGLang's capabilities are read off a bare object)."""
from __future__ import annotations

import pytest

from rlhf_orch.engines import engine_class
from rlhf_orch.engines.base import TRANSPORTS, Capabilities, streams_over
from rlhf_orch.engines.vllm import multicast_free


def test_hf_engine_declares_what_its_decode_loop_and_receiver_do(tiny_model_dir):
    caps = engine_class("hf")(name="e", model_path=tiny_model_dir, seed=0).capabilities
    assert caps == Capabilities(partial_rollouts=True, reports_decode_steps=True, saves_rng=True)
    assert not caps.own_receivers and caps.streams == TRANSPORTS   # the rollout actor's receiver, one call a sync
    stepwise = engine_class("hf")(name="e", model_path=tiny_model_dir, seed=0, stepwise_sync=True)
    assert not streams_over(stepwise, "ipc") and not streams_over(stepwise, "broadcast")   # the test hook's path


def test_vllm_kinds_declare_their_receivers_and_streaming():
    plain = engine_class("vllm").capabilities
    assert plain == Capabilities(own_receivers=True, aborts_syncs=True)   # a sync is one call on both transports
    streaming = engine_class("vllm-streaming").capabilities
    assert streaming == Capabilities(own_receivers=True, aborts_syncs=True, partial_rollouts=True,
                                     concurrent_generate=True)


@pytest.mark.parametrize("tp, streams, aborts", [(1, {"ipc"}, True), (2, set(), False)])
def test_sglang_capabilities_follow_its_tensor_parallelism(tp, streams, aborts):
    from rlhf_orch.engines.sglang import SGLangEngine   # imports no SGLang until an engine starts
    eng = object.__new__(SGLangEngine)
    eng.tensor_parallel_size = tp
    caps = eng.capabilities
    assert caps.own_receivers and caps.streams == streams and caps.aborts_syncs == aborts
    assert not caps.partial_rollouts and not caps.concurrent_generate
    assert streams_over(eng, "ipc") == (tp == 1) and not streams_over(eng, "broadcast")


def test_tensor_parallel_engine_stays_off_multicast_where_the_cluster_turned_it_off(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert multicast_free(2) == {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}
    assert multicast_free(1) == {}   # one worker: no all-reduce to fuse


def test_vllm_decides_where_multicast_is_not_turned_off(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    assert multicast_free(2) == {}
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert multicast_free(4) == {}
