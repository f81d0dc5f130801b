"""Load replay (weight_sync/replay.py) and the fused copy-and-checksum pass (copysum.py), on CPU.

The toy engine loads like vLLM does: q/k/v into slices of one fused parameter, the embedding into the first rows
of a padded table whose tail it fills with zeros. Replayed loads must leave exactly the bytes its loader leaves,
and their checksums (of what the engine holds) must equal the trainer's checksums of the tensors it sent.
"""
from __future__ import annotations

import logging

import pytest
import torch

from rlhf_orch.types import ParamSpec
from rlhf_orch.weight_sync.buckets import checksums, pack, plan_buckets
from rlhf_orch.weight_sync.copysum import CopyPlan, Run
from rlhf_orch.weight_sync.replay import LoadReplay
from rlhf_orch.weight_sync.receiver import WeightReceiver
from rlhf_orch.weight_sync.sender import WeightSender
from weight_sync_helpers import in_process_streams

HID, Q, KV, VOCAB, PAD_VOCAB = 8, 8, 4, 10, 16


class FusedToy(torch.nn.Module):
    def __init__(self, loader: str = "plain"):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.full((Q + 2 * KV, HID), float("nan")), requires_grad=False)
        self.emb = torch.nn.Parameter(torch.full((PAD_VOCAB, HID), float("nan")), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.full((HID,), float("nan")), requires_grad=False)
        self.loader = loader
        self.calls = 0

    def load_weights(self, named):
        self.calls += 1
        offsets = {"q": (0, Q), "k": (Q, KV), "v": (Q + KV, KV)}
        with torch.no_grad():
            for name, t in named:
                if name in offsets:
                    start, rows = offsets[name]
                    if self.loader == "sharded" and name == "k":
                        self.qkv.data.narrow(0, start, rows // 2).copy_(t[:rows // 2])
                    else:
                        self.qkv.data.narrow(0, start, rows).copy_(t)
                elif name == "emb":
                    self.emb[:t.shape[0]].data.copy_(t)
                    self.emb[t.shape[0]:].data.fill_(0)
                elif name == "norm":
                    if self.loader == "transpose":
                        self.norm.data.copy_(t.flip(0))
                    elif self.loader == "scale":
                        self.norm.data.copy_(t)
                        self.norm.data.mul_(1.0)
                    else:
                        self.norm.data.copy_(t)


def _specs():
    return [ParamSpec("emb", "float32", (VOCAB, HID)), ParamSpec("q", "float32", (Q, HID)),
            ParamSpec("k", "float32", (KV, HID)), ParamSpec("v", "float32", (KV, HID)),
            ParamSpec("norm", "float32", (HID,))]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g) for s in _specs()}


def _expected(w) -> dict[str, torch.Tensor]:
    emb = torch.zeros(PAD_VOCAB, HID)
    emb[:VOCAB] = w["emb"]
    return {"qkv": torch.cat([w["q"], w["k"], w["v"]]), "emb": emb, "norm": w["norm"]}


def _sync(replay, model, layouts, bufs, w) -> list[int]:
    """Pack `w` as a trainer would and load every bucket; returns the engine's checksums (None: loader ran)."""
    sums = []
    for lay in layouts:
        buf = bufs[lay.index % 2]
        pack(lay, [w[s.name] for s in lay.slots], buf)
        got = replay.load(lay, buf, model.load_weights)
        sums.extend(got if got is not None else [None] * len(lay.slots))
    return sums


@pytest.mark.parametrize("bucket_bytes", [10_000, 400])   # one bucket; a bucket per tensor or two
def test_replayed_loads_equal_the_loader_and_checksum_what_the_engine_holds(bucket_bytes):
    layouts = plan_buckets(_specs(), bucket_bytes)
    bufs = [torch.zeros(max(lay.nbytes for lay in layouts), dtype=torch.uint8) for _ in range(2)]
    model = FusedToy()
    replay = LoadReplay(lambda: dict(model.named_parameters()))
    names = [s.name for lay in layouts for s in lay.slots]
    for step in range(4):
        w = _weights(step)
        calls = model.calls
        sums = _sync(replay, model, layouts, bufs, w)
        want = _expected(w)
        for n, p in model.named_parameters():
            assert torch.equal(p, want[n]), (step, n)
        assert sums == checksums(w[n] for n in names), step
        # The loader runs once per bucket, at the first sync (recording); later syncs are replays.
        assert model.calls - calls == (len(layouts) if step == 0 else 0)
    assert all(not isinstance(p, str) for p in replay.plans.values())


def test_replay_follows_parameters_that_move_and_refuses_ones_that_change_shape():
    layouts = plan_buckets(_specs(), 10_000)
    bufs = [torch.zeros(layouts[0].nbytes, dtype=torch.uint8) for _ in range(2)]
    model = FusedToy()
    replay = LoadReplay(lambda: dict(model.named_parameters()))
    _sync(replay, model, layouts, bufs, _weights(0))
    model.qkv.data = torch.zeros_like(model.qkv)         # reallocated (an engine woken from sleep)
    w = _weights(1)
    _sync(replay, model, layouts, bufs, w)
    assert torch.equal(model.qkv, _expected(w)["qkv"]) and model.calls == 1
    model.norm.data = torch.empty(0)                      # emptied (asleep): the engine's own loader decides
    with pytest.raises(RuntimeError):
        _sync(replay, model, layouts, bufs, w)


@pytest.mark.parametrize("loader,why", [("transpose", "computed tensor"), ("sharded", "not loaded whole"),
                                         ("scale", "calls mul_")])
def test_loads_the_recorder_cannot_map_stay_on_the_loader(loader, why, caplog):
    layouts = plan_buckets(_specs(), 10_000)
    bufs = [torch.zeros(layouts[0].nbytes, dtype=torch.uint8) for _ in range(2)]
    model = FusedToy(loader)
    replay = LoadReplay(lambda: dict(model.named_parameters()))
    with caplog.at_level(logging.INFO, logger="rlhf_orch.weight_sync.replay"):
        for step in range(3):
            sums = _sync(replay, model, layouts, bufs, _weights(step))
            assert sums == [None] * len(sums)     # the caller checksums as before
    assert model.calls == 3 and why in caplog.text
    if loader == "transpose":
        assert torch.equal(model.norm, _weights(2)["norm"].flip(0))


def test_disabled_replay_always_runs_the_loader():
    layouts = plan_buckets(_specs(), 10_000)
    bufs = [torch.zeros(layouts[0].nbytes, dtype=torch.uint8) for _ in range(2)]
    model = FusedToy()
    replay = LoadReplay(lambda: dict(model.named_parameters()), enabled=False)
    for step in range(2):
        assert _sync(replay, model, layouts, bufs, _weights(step)) == [None] * 5
    assert model.calls == 2


def test_copy_plan_sums_runs_into_slots_and_can_checksum_without_copying():
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int32) for n in (6, 7, 16)]
    dsts = [torch.zeros_like(s) for s in srcs]
    as_bytes = [t.view(torch.uint8) for t in srcs]
    # Two runs of one slot split at a multiple of 8 bytes add up to that slot's checksum.
    runs = [Run(as_bytes[0], dsts[0].view(torch.uint8), 0), Run(as_bytes[1], dsts[1].view(torch.uint8), 1),
            Run(as_bytes[2][:32], dsts[2].view(torch.uint8)[:32], 2), Run(as_bytes[2][32:], dsts[2].view(torch.uint8)[32:], 2)]
    plan = CopyPlan(runs, 3, torch.device("cpu"))
    assert plan.run() == checksums(srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    dsts[1][0] += 1
    assert plan.run(copy=False) == checksums(dsts) != checksums(srcs)


def test_sender_checksums_equal_the_tensors_checksums_also_when_converting_dtypes():
    specs = [ParamSpec("a", "float32", (5, 3)), ParamSpec("b", "bfloat16", (7,)), ParamSpec("c", "float32", (4,))]
    layouts = plan_buckets(specs, 128)
    sender = WeightSender(layouts, torch.device("cpu"), {"ipc": {"engines": ["e"]}})
    g = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g),   # b: float32 -> bfloat16
               "c": torch.randn(8, generator=g)[::2]}                                    # c: strided
    recv = WeightReceiver(layouts, torch.device("cpu"), lambda named: None)   # takes the buckets, checks nothing
    res, got = in_process_streams(sender, {"e": recv}, verify=False)(iter(tensors.items()))
    assert got == {"e": []}
    want = checksums([tensors["a"], tensors["b"].to(torch.bfloat16), tensors["c"].contiguous()])
    assert res.checksums == want


def test_a_loader_of_one_multi_tensor_copy_is_replayed_too():
    """The hf engine (and the benchmark's raw receiver) load a bucket with one torch._foreach_copy_."""
    specs = [ParamSpec("a", "float32", (3, 4)), ParamSpec("b", "float32", (5,))]
    layouts = plan_buckets(specs, 10_000)
    buf = torch.zeros(layouts[0].nbytes, dtype=torch.uint8)
    params = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    calls = []

    def load(named):
        calls.append(1)
        torch._foreach_copy_([params[n] for n, _ in named], [t for _, t in named])

    replay = LoadReplay(lambda: params)
    for step in range(3):
        w = {"a": torch.randn(3, 4), "b": torch.randn(5)}
        pack(layouts[0], [w["a"], w["b"]], buf)
        assert replay.load(layouts[0], buf, load) == checksums([w["a"], w["b"]])
        assert torch.equal(params["a"], w["a"]) and torch.equal(params["b"], w["b"])
    assert len(calls) == 1


class TPShard(torch.nn.Module):
    """One worker of a tensor-parallel engine, loading as vLLM's layers do: a column-parallel fused qkv (a block of
    each received tensor's rows into a slice of its parameter), a row-parallel o (a block of every row: a strided
    view), a vocab-parallel embedding (its rows, the padding filled), a replicated norm (whole)."""

    def __init__(self, rank: int, world: int = 2):
        super().__init__()
        self.rank, self.world, self.calls = rank, world, 0
        q, kv, v = Q // world, KV // world, PAD_VOCAB // world
        self.qkv = torch.nn.Parameter(torch.full((q + 2 * kv, HID), float("nan")), requires_grad=False)
        self.o = torch.nn.Parameter(torch.full((HID, HID // world), float("nan")), requires_grad=False)
        self.emb = torch.nn.Parameter(torch.full((v, HID), float("nan")), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.full((HID,), float("nan")), requires_grad=False)

    def load_weights(self, named):
        self.calls += 1
        r, w = self.rank, self.world
        q, kv = Q // w, KV // w
        offsets = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        with torch.no_grad():
            for name, t in named:
                if name in offsets:
                    start, rows = offsets[name]
                    self.qkv.data.narrow(0, start, rows).copy_(t.narrow(0, r * rows, rows))
                elif name == "o":
                    cols = HID // w
                    self.o.data.copy_(t.narrow(1, r * cols, cols))
                elif name == "emb":
                    per = PAD_VOCAB // w
                    lo, hi = r * per, min((r + 1) * per, t.shape[0])
                    self.emb[:hi - lo].data.copy_(t[lo:hi])
                    self.emb[hi - lo:].data.fill_(0)
                elif name == "norm":
                    self.norm.data.copy_(t)


def _tp_specs():
    return _specs() + [ParamSpec("o", "float32", (HID, HID))]


@pytest.mark.parametrize("bucket_bytes", [10_000, 400])
def test_tensor_parallel_workers_replay_their_slices_and_checksum_the_received_tensors(bucket_bytes):
    layouts = plan_buckets(_tp_specs(), bucket_bytes)
    names = [s.name for lay in layouts for s in lay.slots]
    for rank in range(2):
        bufs = [torch.zeros(max(lay.nbytes for lay in layouts), dtype=torch.uint8) for _ in range(2)]
        model, twin = TPShard(rank), TPShard(rank)   # the twin always loads through its loader
        replay = LoadReplay(lambda: dict(model.named_parameters()), sharded=True)
        for step in range(3):
            w = {**_weights(step), "o": torch.randn(HID, HID, generator=torch.Generator().manual_seed(50 + step))}
            calls = model.calls
            sums = _sync(replay, model, layouts, bufs, w)
            twin.load_weights(list(w.items()))
            for (n, p), (_, want) in zip(model.named_parameters(), twin.named_parameters()):
                assert torch.equal(p, want), (rank, step, n)
            assert sums == checksums(w[n] for n in names), (rank, step)   # of the whole tensors received
            assert model.calls - calls == (len(layouts) if step == 0 else 0)
        status = replay.status()
        assert status["loader"] == {} and status["sharded"] and set(status["sharded"]) <= set(status["replayed"])


def test_without_sharding_a_tensor_parallel_loader_stays_on_the_loader():
    layouts = plan_buckets(_tp_specs(), 10_000)
    bufs = [torch.zeros(layouts[0].nbytes, dtype=torch.uint8) for _ in range(2)]
    model = TPShard(1)
    replay = LoadReplay(lambda: dict(model.named_parameters()))
    for step in range(2):
        w = {**_weights(step), "o": torch.randn(HID, HID)}
        assert _sync(replay, model, layouts, bufs, w) == [None] * 6
    assert model.calls == 2 and "strided view" in replay.status()["loader"][0]


def test_a_sharded_plan_refuses_writes_that_overlap():
    layouts = plan_buckets(_tp_specs(), 10_000)
    buf = torch.zeros(layouts[0].nbytes, dtype=torch.uint8)
    model = TPShard(0)

    def twice(named):
        model.load_weights(named)
        t = dict(named)["norm"]
        model.qkv.data[0].copy_(t)   # the first row of q written again, from another tensor

    replay = LoadReplay(lambda: dict(model.named_parameters()), sharded=True)
    w = {**_weights(0), "o": torch.randn(HID, HID)}
    pack(layouts[0], [w[s.name] for s in layouts[0].slots], buf)
    assert replay.load(layouts[0], buf, twice) is None
    assert "written twice" in replay.status()["loader"][0]
