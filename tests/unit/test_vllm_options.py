"""The LLM options VLLMEngine adds from its environment (rlhf_orch/engines/vllm.py), checked without vLLM."""
from __future__ import annotations

from rlhf_orch.engines.vllm import multicast_free


def test_tensor_parallel_engine_stays_off_multicast_where_the_cluster_turned_it_off(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert multicast_free(2) == {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}
    assert multicast_free(1) == {}   # one worker: no all-reduce to fuse


def test_vllm_decides_where_multicast_is_not_turned_off(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    assert multicast_free(2) == {}
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert multicast_free(4) == {}
