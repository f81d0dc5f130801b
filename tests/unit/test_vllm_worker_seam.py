"""The vLLM engine's side of setup's handshake and of a sync, on CPU, with vLLM's worker processes stood in for.

What is real: `VLLMEngine.setup_receiver` / `connect` / `receive` and the worker extension's `rlhf_setup_receiver` /
`rlhf_connect` / `rlhf_receive` (engines/vllm_worker.py) with our WeightReceiver, load replay, the shared-memory ring
buffers and mailbox (ipc) and a gloo group (broadcast: two tensor-parallel workers as ranks 1 and 2). What stands in:
vLLM's `collective_rpc` (each worker's method on a thread of its own, its arguments pickled as the engine packs
them), `vllm.distributed`'s tensor-parallel rank, and a toy model whose `load_weights` fuses q and k as vLLM's Llama
does. The same path runs against vLLM 0.26.0 on a GPU in tests/gpu/test_vllm_engine.py and test_vllm_tp.py.
"""
import pickle
import sys
import threading
import types

import pytest
import torch

from rlhf_orch.engines.vllm import VLLMEngine
from rlhf_orch.engines.vllm_worker import WeightSyncWorkerExtension
from rlhf_orch.errors import EngineError
from rlhf_orch.weight_sync.buckets import checksums, plan_buckets
from rlhf_orch.weight_sync.collective import free_port
from rlhf_orch.weight_sync.sender import WeightSender
from weight_sync_helpers import CPU, HOST, assert_bit_equal, spec

MODEL = [spec("q", "float32", 8, 4), spec("k", "float32", 4, 4), spec("w", "float32", 16, 4), spec("b", "float32", 5)]
BUCKET = 200   # q and k in separate buckets: a fused parameter written from two buckets
_tp = threading.local()   # the calling worker's tensor-parallel rank (vllm.distributed's, stood in for)
TP = {"size": 1}          # the engine's tensor-parallel size


class ToyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4), requires_grad=False)
        self.w = torch.nn.Parameter(torch.zeros(16, 4), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(5), requires_grad=False)

    def load_weights(self, named):
        for name, t in named:
            {"q": lambda: self.qkv[:8], "k": lambda: self.qkv[8:], "w": lambda: self.w, "b": lambda: self.b}[name]().copy_(t)


class Worker(WeightSyncWorkerExtension):
    def __init__(self, rank: int):
        self.rank, self.device, self.model = rank, CPU, ToyModel()
        self.vllm_config = types.SimpleNamespace(quant_config=None)
        self.model_runner = types.SimpleNamespace(get_model=lambda: self.model)


class LLM:
    """collective_rpc: every worker runs the method at once (a group's members must all be joining)."""

    def __init__(self, workers):
        self.workers = workers

    def collective_rpc(self, method, args=()):
        out, errors = [None] * len(self.workers), []

        def run(k, w):
            _tp.rank = w.rank
            try:
                out[k] = getattr(w, method)(*pickle.loads(pickle.dumps(args)))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(k, w)) for k, w in enumerate(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if errors:
            raise errors[0]
        return out


class Engine(VLLMEngine):
    def __init__(self, n_workers: int):
        self.name, self.workers = "v", [Worker(r) for r in range(n_workers)]
        self.llm = LLM(self.workers)

    def _need_weights_awake(self, what):
        pass


@pytest.fixture(autouse=True)
def fake_vllm_distributed(monkeypatch):
    dist = types.ModuleType("vllm.distributed")
    dist.get_tensor_model_parallel_rank = lambda: _tp.rank
    dist.get_tensor_model_parallel_world_size = lambda: TP["size"]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.distributed", dist)


def _values(seed):
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g) for s in MODEL}


def _sync(engine, sender, values, sync_id):
    out = {}
    t = threading.Thread(target=lambda: out.update(sent=sender.send(iter([(s.name, values[s.name]) for s in MODEL]),
                                                                    sync_id, sync_id=sync_id)))
    t.start()
    try:
        return engine.receive(sync_id, True), out
    finally:
        t.join(30)


def _assert_holds(worker, values):
    assert_bit_equal(worker.model.qkv.data, torch.cat([values["q"], values["k"]]), f"worker {worker.rank} qkv")
    assert_bit_equal(worker.model.w.data, values["w"], "w")
    assert_bit_equal(worker.model.b.data, values["b"], "b")


def test_ipc_handshake_and_syncs_through_the_workers_rpc():
    layouts = plan_buckets(MODEL, BUCKET)
    engine = Engine(1)
    assert engine.setup_receiver(layouts, "ipc", {}, True, 10) >= 0
    sender = WeightSender(layouts, CPU, {"ipc": {"engines": ["v"]}}, timeout_s=10)
    answer = engine.connect(sender.offers()["ipc"])
    assert isinstance(answer, bytes)   # the worker's mailbox
    sender.accept("ipc", "v", answer)
    for sync_id in (1, 2):   # the second by replayed copies
        values = _values(sync_id)
        (sums, timings), out = _sync(engine, sender, values, sync_id)
        assert sums == out["sent"].checksums == checksums(values[s.name] for s in MODEL)
        assert "wait_s" in timings
        _assert_holds(engine.workers[0], values)
    assert engine.workers[0]._rlhf_state()["receiver"].replay.status()["replayed"] == list(range(len(layouts)))
    engine.abort_stream()   # the worker fails its mailbox: the next send stops at once
    with pytest.raises(Exception, match="gave up"):
        sender.send(iter([(s.name, v) for s, v in zip(MODEL, _values(3).values())]), 3, sync_id=3)


def test_broadcast_handshake_two_tensor_parallel_workers_join_as_consecutive_ranks():
    TP["size"] = 2
    try:
        layouts = plan_buckets(MODEL, BUCKET)
        engine = Engine(2)
        port, box = free_port(HOST), {}
        group = {"backend": "gloo", "host": HOST, "port": port, "world_size": 3, "sums": True}
        t = threading.Thread(target=lambda: box.update(sender=WeightSender(layouts, CPU, {"broadcast": group},
                                                                            timeout_s=10)))
        t.start()
        engine.setup_receiver(layouts, "broadcast", {**group, "rank": 1}, True, 10)   # workers: ranks 1 and 2
        t.join(30)
        assert [w._rlhf_state()["receiver"].group.rank for w in engine.workers] == [1, 2]
        assert engine.connect(box["sender"].offers()["broadcast"]) is None   # broadcast answers nothing
        for sync_id in (1, 2):
            values = _values(10 + sync_id)
            (sums, _), out = _sync(engine, box["sender"], values, sync_id)
            assert sums == out["sent"].checksums   # both workers checked the trainer's sums and agree
            for w in engine.workers:
                _assert_holds(w, values)
        box["sender"].close()
        for w in engine.workers:
            w.rlhf_close()
    finally:
        TP["size"] = 1


def test_an_answer_from_several_workers_is_refused():
    class Two(Engine):
        def _rpc(self, method, *args):
            return [b"a", b"b"] if method == "rlhf_connect" else super()._rpc(method, *args)

    with pytest.raises(EngineError, match="2 workers answered"):
        Two(2).connect([])
