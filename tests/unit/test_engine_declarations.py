"""What engine kinds declare rather than have probed (rlhf_orch/engines): their capabilities, which the rollout
actor, the coordinator and the benchmarks read (engines/base.Capabilities), and the LLM options VLLMEngine adds from
its environment. Checked on CPU: no engine library is imported (SGLang's capabilities are read off a bare object)."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_orch.config.engines.hf import HFEngineConfig
from rlhf_orch.config.engines.sglang import SGLangEngineConfig
from rlhf_orch.config.engines.vllm import VLLMEngineConfig
from rlhf_orch.config import load_config
from rlhf_orch.engines import HOOKS_ENV, engine_class, engine_options, hooks_from_env
from rlhf_orch.engines.base import TRANSPORTS, Capabilities, checks_over
from rlhf_orch.engines.sglang import SGLangEngine   # imports no SGLang until an engine starts
from rlhf_orch.engines.vllm import multicast_free
from rlhf_orch.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_hf_engine_declares_what_its_decode_loop_and_receiver_do(tiny_model_dir):
    caps = engine_class("hf")(name="e", model_path=tiny_model_dir, seed=0).capabilities
    assert caps == Capabilities(partial_rollouts=True, reports_decode_steps=True, saves_rng=True)
    assert not caps.own_receivers and caps.checks_loads == TRANSPORTS   # the rollout actor's receiver checks both
    unchecked = engine_class("hf")(name="e", model_path=tiny_model_dir, seed=0, unchecked_broadcast=True)
    assert checks_over(unchecked, "ipc") and not checks_over(unchecked, "broadcast")   # the test hook's path


def test_vllm_kinds_declare_their_receivers_and_streaming():
    plain = engine_class("vllm").capabilities
    assert plain == Capabilities(own_receivers=True, aborts_syncs=True)   # a sync is one call on both transports
    streaming = engine_class("vllm-streaming").capabilities
    assert streaming == Capabilities(own_receivers=True, aborts_syncs=True, partial_rollouts=True,
                                     concurrent_generate=True)


@pytest.mark.parametrize("tp, streams, aborts", [(1, {"ipc", "broadcast"}, True), (2, set(), False)])
def test_sglang_capabilities_follow_its_tensor_parallelism(tp, streams, aborts):
    eng = object.__new__(SGLangEngine)
    eng.tensor_parallel_size = tp
    caps = eng.capabilities
    assert caps.own_receivers and caps.checks_loads == streams and caps.aborts_syncs == aborts
    assert not caps.partial_rollouts and not caps.concurrent_generate
    assert checks_over(eng, "ipc") == checks_over(eng, "broadcast") == (tp == 1)


def test_tensor_parallel_engine_stays_off_multicast_where_the_cluster_turned_it_off(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert multicast_free(2) == {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}
    assert multicast_free(1) == {}   # one worker: no all-reduce to fuse


def test_vllm_decides_where_multicast_is_not_turned_off(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    assert multicast_free(2) == {}
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert multicast_free(4) == {}


def test_an_engine_section_becomes_its_kind_and_arguments_where_the_engine_is_built():
    """The rollout actor receives the typed section (issue #28); engine_options turns it into the registry kind and
    the engine's own arguments: placement, sampling and sleep stay the driver's."""
    kind, kw = engine_options(HFEngineConfig(kind="hf"), "m", "float32", 7, {"decode_delay_s": 0.5})
    assert kind == "hf" and kw == {"model_path": "m", "dtype": "float32", "seed": 7, "max_batch_size": 256,
                                   "decode_delay_s": 0.5}
    kind, kw = engine_options(VLLMEngineConfig(kind="vllm", streaming=True, tensor_parallel_size=2,
                                               load_format="dummy"), "m", "bfloat16", 0)
    assert kind == "vllm-streaming" and kw["tensor_parallel_size"] == 2 and kw["load_format"] == "dummy"
    kind, kw = engine_options(SGLangEngineConfig(kind="sglang", placement="colocated", sleep_level=1,
                                                 python_path="/x"), "m", "bfloat16", 0)
    assert kind == "sglang" and kw["enable_memory_saver"] and kw["enable_weights_cpu_backup"]
    assert not {"python_path", "sleep_level", "placement", "sampling", "name", "count", "kind"} & set(kw)


def test_test_hooks_come_from_the_environment_not_the_config(monkeypatch):
    """The hf engine's test hooks are no config keys (a user's config cannot set them, issue #28); the driver reads
    $RLHF_ORCH_TEST_HOOKS per engine entry, and a wrong one fails with a message that names the variable."""
    with pytest.raises(Exception, match="decode_delay_s"):
        load_config(ROOT / "configs/tiny_cpu.yaml", ["engines.0.decode_delay_s=0.5"])
    monkeypatch.delenv(HOOKS_ENV, raising=False)
    assert hooks_from_env(0) == {}
    monkeypatch.setenv(HOOKS_ENV, '{"engines.1": {"sync_delay_s": 1, "unchecked_broadcast": 1}}')
    assert hooks_from_env(0) == {} and hooks_from_env(1) == {"sync_delay_s": 1.0, "unchecked_broadcast": True}
    with pytest.raises(ConfigError, match="hf engines only"):
        engine_options(VLLMEngineConfig(kind="vllm"), "m", "bfloat16", 0, hooks_from_env(1))
    monkeypatch.setenv(HOOKS_ENV, '{"engines.0": {"decode_delay": 1}}')
    with pytest.raises(ConfigError, match="RLHF_ORCH_TEST_HOOKS: unknown test hook"):
        hooks_from_env(0)
    monkeypatch.setenv(HOOKS_ENV, "[1]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        hooks_from_env(0)
