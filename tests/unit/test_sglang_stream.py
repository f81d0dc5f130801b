"""The one-call sync into SGLang (engines/sglang_stream.py), colocated and over broadcast, with SGLang's scheduler
stood in for.

What is real: our WeightSender on CPU shared-memory ring buffers or a gloo broadcast group, the mailbox, the
WeightReceiver and load replay that the hook builds, the hook's request dispatch (`rlhf_sglang_hook`) and its report
files, and the engine side (`SchedulerStream` as SGLangEngine mixes it in). What stands in: SGLang's `update_weights_from_tensor`, which calls
the custom loader named by `load_format` with the model (as weight_updater.py:346 does), and a toy model whose
`load_weights` fuses q and k into one parameter the way SGLang's Llama does. The same path runs against SGLang 0.5.17
on a GPU in tests/gpu/test_sglang_engine.py (the `ipc_stream` case).
"""
import importlib
import os
import threading
import time

import pytest
import torch

from rlhf_orch.engines.sglang import SGLangEngine, install
from rlhf_orch.engines.sglang_stream import HOOK, SchedulerStream
from rlhf_orch.errors import EngineError, WeightSyncError
from rlhf_orch.weight_sync.abort import AbortFlag
from rlhf_orch.weight_sync.buckets import checksums, plan_buckets
from rlhf_orch.weight_sync.collective import free_port
from rlhf_orch.weight_sync.sender import WeightSender
from weight_sync_helpers import CPU, assert_bit_equal, spec

MODEL = [spec("q", "float32", 8, 4), spec("k", "float32", 4, 4), spec("w", "float32", 16, 4), spec("b", "float32", 5)]
BUCKET = 200    # q and k in separate buckets: a fused parameter written from two buckets


class ToyModel(torch.nn.Module):
    """q and k land in one `qkv` parameter (rows 0-7, 8-11), as SGLang fuses them."""

    def __init__(self, corrupt: str | None = None):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4), requires_grad=False)
        self.w = torch.nn.Parameter(torch.zeros(16, 4), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(5), requires_grad=False)
        self.corrupt = corrupt

    def load_weights(self, named):
        for name, t in named:
            dst = {"q": lambda: self.qkv[:8], "k": lambda: self.qkv[8:], "w": lambda: self.w, "b": lambda: self.b}[name]()
            if name == self.corrupt:
                t.view(-1)[0] += 1.0    # bytes that arrived wrong (a received-mode checksum sees the bucket)
            dst.copy_(t)


class FakeSGLang:
    """SGLang's Engine as far as the hook sees it: update_weights_from_tensor runs the named custom loader."""

    def __init__(self, model):
        self.model = model

    def update_weights_from_tensor(self, named, load_format=None, flush_cache=True):
        module, fn = load_format.rsplit(".", 1)
        getattr(importlib.import_module(module), fn)(self.model, named)
        return True, "Success"


class Engine(SchedulerStream):
    """SGLangEngine's state that the stream uses, and its own `_call`/`_reports`."""
    _call = SGLangEngine._call
    _reports = SGLangEngine._reports
    checksums = SGLangEngine.checksums

    def __init__(self, model, folder, layouts):
        self.name, self.engine, self._dir, self._layouts = "s", FakeSGLang(model), str(folder), layouts
        self.tensor_parallel_size, self.report_timeout_s, self._sums = 1, 10.0, {}

    def _need_weights_awake(self, what):
        pass


def _values(version):
    g = torch.Generator().manual_seed(version)
    return {s.name: torch.randn(s.shape, generator=g) for s in MODEL}


def _setup(tmp_path, corrupt=None, abort_flag=None):
    layouts = plan_buckets(MODEL, BUCKET)
    assert len(layouts) >= 3
    model = ToyModel(corrupt)
    install(model, {"dir": str(tmp_path), "verify": True}, 0, "cpu")
    eng = Engine(model, tmp_path, layouts)
    if abort_flag is not None:   # as RolloutActor.setup_receiver: the engine keeps it, then the actor unlinks its file
        eng.keep_abort_flag(abort_flag.handle())
        abort_flag.unlink()
    sender = WeightSender(layouts, CPU, {"ipc": {"engines": ["s"]}}, timeout_s=10)
    eng.open_stream("ipc", {}, 10)   # setup's handshake: open, connect with the rank's offer, accept the answer
    sender.accept("ipc", "s", eng.connect_stream(sender.offers()["ipc"]))
    return model, eng, sender


def _sync(eng, sender, values, sync_id, receive=None):
    """The trainer sends in a thread while the engine takes the sync (`receive`: its ipc stream by default)."""
    out = {}
    t = threading.Thread(target=lambda: out.update(sent=_send(sender, values, sync_id)))
    t.start()
    try:
        return (receive or eng.receive_stream)(sync_id), out
    finally:
        t.join(20)


def _send(sender, values, sync_id):
    try:
        return sender.send(iter([(s.name, values[s.name]) for s in MODEL]), sync_id, sync_id=sync_id)
    except WeightSyncError as e:
        return e


def _assert_holds(model, eng, values, sums, out, sync_id):
    """The trainer's and the scheduler's checksums are those of `values`, and the model holds them (q, k fused)."""
    want = checksums(values[s.name] for s in MODEL)
    assert out["sent"].checksums == want and sums == want
    assert_bit_equal(model.qkv.data, torch.cat([values["q"], values["k"]]), f"qkv after sync {sync_id}")
    assert_bit_equal(model.w.data, values["w"], "w")
    assert_bit_equal(model.b.data, values["b"], "b")
    assert eng.checksums([s.name for s in MODEL]) == want


def _assert_replayed(model, eng):
    """After the first sync every bucket was loaded by replayed copies, none by the model's own loader."""
    status = model._rlhf_state["stream"].replay.status()
    assert status["replayed"] == list(range(len(eng._layouts))) and not status["loader"]


def _assert_abort_ends_the_receive(receive, flag, sync_id: int) -> None:
    """`receive()` waits for bucket 0 of sync `sync_id`, which no trainer sends; the actor's abort of that sync must end
    it with SyncAborted within 2 s (the receivers' deadline is 10 s)."""
    out = {}

    def run():
        try:
            receive()
        except EngineError as e:
            out["error"], out["t"] = str(e), time.monotonic()

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    flag.abort(sync_id)
    t.join(10)
    assert "SyncAborted" in out["error"] and out["t"] - t0 < 2.0, out


def test_two_syncs_in_one_call_each_then_replayed_copies_follow_the_weights(tmp_path):
    model, eng, sender = _setup(tmp_path)
    assert eng.capabilities.checks_loads == {"ipc", "broadcast"}
    for sync_id in (1, 2, 3):
        if sync_id == 3:   # re-installing the load wrapper (verify off for SGLang's own calls) keeps the stream
            install(model, {"dir": str(tmp_path), "verify": False}, 0, "cpu")
        values = _values(sync_id)
        (sums, timings), out = _sync(eng, sender, values, sync_id)
        assert set(timings) == {"load_s", "wait_s", "total_s", "on_device"} and timings["on_device"] == 0.0   # CPU: host hand-over
        _assert_holds(model, eng, values, sums, out, sync_id)
    _assert_replayed(model, eng)


def test_replay_off_loads_through_the_models_own_loader_every_time(tmp_path):
    model, eng, sender = _setup(tmp_path)
    eng.set_replay(False)
    for sync_id in (1, 2):
        values = _values(10 + sync_id)
        (sums, _), out = _sync(eng, sender, values, sync_id)
        assert sums == out["sent"].checksums
        assert_bit_equal(model.qkv.data, torch.cat([values["q"], values["k"]]), "qkv")
    assert model._rlhf_state["stream"].replay.plans == {}


def test_a_mangled_load_is_an_engine_error_and_the_sender_stops_at_once(tmp_path):
    model, eng, sender = _setup(tmp_path, corrupt="k")
    with pytest.raises(EngineError, match="failed in SGLang's scheduler.*differ from the trainer's.*'k'"):
        _sync(eng, sender, _values(1), 1)
    # The sender was told by the mailbox, not by its 10 s deadline.
    sent = _send(sender, _values(1), 1)
    assert isinstance(sent, WeightSyncError) and "gave up" in str(sent)


def test_abort_from_the_actor_stops_a_waiting_sender(tmp_path):
    model, eng, sender = _setup(tmp_path)
    eng.abort_stream()   # e.g. the actor's call failed before the scheduler took the sync
    sent = _send(sender, _values(1), 1)
    assert isinstance(sent, WeightSyncError) and "gave up" in str(sent)


def test_stream_before_connect_and_unknown_requests_are_refused(tmp_path):
    model = ToyModel()
    install(model, {"dir": str(tmp_path), "verify": True}, 0, "cpu")
    eng = Engine(model, tmp_path, plan_buckets(MODEL, BUCKET))
    with pytest.raises(EngineError, match="setup_receiver first"):
        eng.receive_stream(1)
    with pytest.raises(EngineError, match="connect before setup_receiver"):
        eng.connect_stream([])
    hook = getattr(importlib.import_module(HOOK.rsplit(".", 1)[0]), HOOK.rsplit(".", 1)[1])
    with pytest.raises(RuntimeError, match="only serves rlhf_orch's own requests"):
        hook(model, [("model.embed_tokens.weight", torch.zeros(1))])
    eng.tensor_parallel_size = 2
    assert eng.capabilities.checks_loads == frozenset()
    with pytest.raises(EngineError, match="single-GPU engine"):
        eng.open_stream("ipc", {}, 10)


def test_an_aborted_sync_ends_the_schedulers_receive_at_once(tmp_path):
    """Issue #33 on SGLang: the stream's receiver in the scheduler polls the rollout actor's abort flag (mapped through
    a link the engine made before the actor removed the flag's file), so the coordinator's abort_sync ends a sync
    whose trainer side is gone in milliseconds, not at the 10 s deadline."""
    flag = AbortFlag.create()
    model, eng, sender = _setup(tmp_path, abort_flag=flag)
    assert eng.capabilities.aborts_syncs and not os.path.exists(eng._abort["link"])   # the scheduler took the link
    _assert_abort_ends_the_receive(lambda: eng.receive_stream(7), flag, 7)
    assert not model._rlhf_state["abort"].aborted(8)   # the scheduler's view of the flag: only sync 7 is aborted


# ---- over broadcast: our receiver in the scheduler joins the group, one call per sync ---------------------------
def _setup_broadcast(tmp_path, corrupt=None, abort_flag=None):
    layouts = plan_buckets(MODEL, BUCKET)
    model = ToyModel(corrupt)
    install(model, {"dir": str(tmp_path), "verify": True}, 0, "cpu")
    eng = Engine(model, tmp_path, layouts)
    if abort_flag is not None:
        eng.keep_abort_flag(abort_flag.handle())
        abort_flag.unlink()
    port, box = free_port("127.0.0.1"), {}

    group = {"backend": "gloo", "host": "127.0.0.1", "port": port, "world_size": 2, "sums": True}

    def trainer():   # rank 0: as the trainer actor's setup_sender
        box["sender"] = WeightSender(layouts, CPU, {"broadcast": group}, verify=True, timeout_s=10)

    t = threading.Thread(target=trainer)
    t.start()
    secs = eng.open_stream("broadcast", {**group, "rank": 1}, 10)
    t.join(20)
    assert secs > 0 and "sender" in box
    assert eng.connect_stream(box["sender"].offers()["broadcast"]) is None and eng._abort_side is None   # no answer
    return model, eng, box["sender"]


def _bsync(eng, sender, values, sync_id):
    return _sync(eng, sender, values, sync_id, eng.receive_stream)


def test_broadcast_syncs_in_one_call_each_verified_in_the_scheduler_then_replayed(tmp_path):
    model, eng, sender = _setup_broadcast(tmp_path)
    for sync_id in (1, 2, 3):
        values = _values(20 + sync_id)
        (sums, timings), out = _bsync(eng, sender, values, sync_id)
        assert set(timings) == {"load_s", "total_s"}
        _assert_holds(model, eng, values, sums, out, sync_id)
    _assert_replayed(model, eng)
    assert model._rlhf_state["stream"].transport.name == "broadcast"


def test_a_mangled_broadcast_load_fails_the_sync_in_the_scheduler(tmp_path):
    model, eng, sender = _setup_broadcast(tmp_path, corrupt="w")
    err = None
    try:
        _bsync(eng, sender, _values(1), 1)
    except EngineError as e:
        err = str(e)
    assert err and "differ from the trainer's" in err and "'w'" in err


def test_an_aborted_broadcast_sync_ends_the_schedulers_receive_at_once(tmp_path):
    """Issue #33 on SGLang over broadcast: SGLang's own receive waits for its group's timeout; ours in the scheduler
    polls the abort flag, so a sync whose trainer side never sends ends in milliseconds, not at the 10 s deadline."""
    flag = AbortFlag.create()
    model, eng, sender = _setup_broadcast(tmp_path, abort_flag=flag)
    # A re-plan re-installs the load wrapper first (setup_receiver): the receiver and its abort flag must survive it.
    install(model, {"dir": str(tmp_path), "verify": True}, 0, "cpu")
    assert model._rlhf_state["abort"] is not None and model._rlhf_state["stream"].transport.name == "broadcast"
    _assert_abort_ends_the_receive(lambda: eng.receive_stream(9), flag, 9)
