"""Unit tests for rlhf_orch.weight_sync: real shared memory, real child processes, a real gloo group.

Nothing is mocked. Child processes use the spawn start method (a fresh interpreter, as Ray workers
are), talk to the parent through pipes/queues, and are always joined with a timeout and terminated in
a `finally`, so a failure never hangs the run.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod

import pytest
import torch

from rlhf_orch.errors import ConfigError, WeightSyncError
from rlhf_orch.types import ParamSpec, dtype_from_name
from rlhf_orch.weight_sync.buckets import ALIGN, checksums, digest, pack, plan_buckets, unpack
from rlhf_orch.weight_sync.collective import BroadcastGroup, free_port
from rlhf_orch.weight_sync.ipc import HandleCache, IpcHandle, allocate_shared, export_handle, open_handle
from rlhf_orch.weight_sync.plan import make_plan
from rlhf_orch.weight_sync.receiver import WeightReceiver
from rlhf_orch.weight_sync.sender import SendResult, WeightSender

HOST = "127.0.0.1"
CPU = torch.device("cpu")
CHILD_TIMEOUT_S = 60.0     # generous: only reached when something is broken
GROUP_TIMEOUT_S = 30.0


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as uint8, for bit-exact comparisons (distinguishes -0.0 from 0.0, NaN payloads)."""
    return t.detach().contiguous().view(-1).view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, what: str = ""):
    assert a.dtype == b.dtype, what
    assert tuple(a.shape) == tuple(b.shape), what
    assert torch.equal(raw_bytes(a), raw_bytes(b)), what


def spec(name, dtype, *shape) -> ParamSpec:
    return ParamSpec(name, dtype, tuple(shape))


def stop_children(procs, timeout=5.0):
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


# ============================================================================ buckets

def test_plan_buckets_packs_in_order_within_size_with_aligned_disjoint_offsets():
    specs = [spec(f"p{i}", "float32", n) for i, n in enumerate([10, 70, 5, 64, 1, 30, 3, 100, 2])]
    bucket_bytes = 600
    layouts = plan_buckets(specs, bucket_bytes)

    assert [b.index for b in layouts] == list(range(len(layouts)))
    assert len(layouts) >= 3
    assert [n for b in layouts for n in b.names] == [s.name for s in specs]   # order preserved, nothing lost
    by_name = {s.name: s for s in specs}
    for b in layouts:
        assert b.nbytes <= bucket_bytes
        prev_end = 0
        for slot in b.slots:                     # slots are in increasing offset order
            assert slot.offset % ALIGN == 0
            assert slot.offset >= prev_end       # no overlap
            assert slot.nbytes == by_name[slot.name].nbytes
            assert slot.dtype == "float32" and slot.shape == by_name[slot.name].shape
            prev_end = slot.offset + slot.nbytes
        assert b.slots[0].offset == 0
        assert b.nbytes == prev_end              # the bucket ends where its last tensor ends
    # Greedy: a bucket was closed only because the next tensor did not fit.
    for b, nxt in zip(layouts, layouts[1:]):
        start = (b.nbytes + ALIGN - 1) // ALIGN * ALIGN
        assert start + nxt.slots[0].nbytes > bucket_bytes


def test_plan_buckets_gives_an_oversize_tensor_its_own_bucket():
    specs = [spec("a", "float32", 10), spec("huge", "float32", 1000), spec("b", "bfloat16", 3), spec("c", "int64", 2)]
    layouts = plan_buckets(specs, 1024)
    assert [b.names for b in layouts] == [["a"], ["huge"], ["b", "c"]]
    assert layouts[1].nbytes == 4000 and layouts[1].slots[0].offset == 0
    assert layouts[2].slots[1].offset == ALIGN
    # Oversize first and last, too.
    assert [b.names for b in plan_buckets([spec("h", "float32", 500), spec("x", "float32", 1)], 256)] == [["h"], ["x"]]
    assert [b.names for b in plan_buckets([spec("x", "float32", 1), spec("h", "float32", 500)], 256)] == [["x"], ["h"]]


def test_plan_buckets_edge_cases():
    assert plan_buckets([], 1024) == []
    with pytest.raises(ValueError):
        plan_buckets([spec("a", "float32", 1)], 0)
    # Exactly full bucket stays one bucket.
    layouts = plan_buckets([spec("a", "float32", 64), spec("b", "float32", 64)], 512)
    assert [b.names for b in layouts] == [["a", "b"]] and layouts[0].nbytes == 512


MIXED = [
    spec("w.f32", "float32", 3, 5),
    spec("w.bf16", "bfloat16", 7),
    spec("idx.i64", "int64", 4, 2),
    spec("w.f16odd", "float16", 5),          # 10 bytes: not a multiple of 4 or 8
    spec("w.conv", "bfloat16", 2, 3),        # receives a float32 tensor (dtype conversion on pack)
    spec("scalar", "float32"),               # 0-dim
]


def _mixed_tensors():
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(3, 5, generator=g)
    f32[0, 0], f32[0, 1], f32[0, 2] = -0.0, float("inf"), float("nan")
    return [
        f32,
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.tensor([[2**62, -1], [0, -(2**63)], [12345678901, 7], [-5, 2**40]], dtype=torch.int64),
        torch.tensor([1.0, -2.5, 65504.0, -0.0, 0.333], dtype=torch.float16),
        torch.randn(2, 3, generator=g) * 1.2345678,    # float32, not representable in bf16
        torch.tensor(3.25),
    ]


def test_pack_unpack_round_trip_mixed_dtypes_bit_exact():
    layouts = plan_buckets(MIXED, 1 << 20)
    assert len(layouts) == 1
    layout = layouts[0]
    buf = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
    src = _mixed_tensors()
    pack(layout, iter(src), buf)            # any iterable, consumed lazily

    out = list(unpack(layout, buf))
    assert [n for n, _ in out] == [s.name for s in MIXED]
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for (name, view), s, t in zip(out, MIXED, src):
        assert lo <= view.data_ptr() < hi or view.numel() == 0       # a view into the bucket, not a copy
        expected = t.to(dtype_from_name(s.dtype))
        assert_bit_equal(view, expected, name)
    # The float32 -> bfloat16 slot really converted (not a reinterpretation of the first bytes).
    conv = dict(out)["w.conv"]
    assert conv.dtype == torch.bfloat16
    assert not torch.equal(conv.float(), src[4])       # bf16 rounding happened
    torch.testing.assert_close(conv.float(), src[4], rtol=1e-2, atol=0)


def test_pack_rejects_shape_mismatch_and_too_few_tensors():
    layout = plan_buckets(MIXED, 1 << 20)[0]
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    bad = _mixed_tensors()
    bad[2] = torch.zeros(2, 4, dtype=torch.int64)       # same numel, wrong shape
    with pytest.raises(ValueError, match="idx.i64"):
        pack(layout, bad, buf)
    with pytest.raises(ValueError, match=r"got 4 tensors for 6 slots"):
        pack(layout, _mixed_tensors()[:4], buf)


def test_checksums_equal_for_equal_bytes_and_change_with_one_element():
    tensors = _mixed_tensors()
    copies = [t.clone() for t in tensors]
    base = checksums(tensors)
    assert len(base) == len(tensors) and all(isinstance(x, int) for x in base)
    assert checksums(copies) == base
    assert checksums([]) == []
    for i in range(len(tensors)):
        changed = [t.clone() for t in tensors]
        flat = changed[i].view(-1)
        flat[-1] = flat[-1] + 1 if changed[i].dtype == torch.int64 else flat[-1] * 2 + 1
        got = checksums(changed)
        assert got[i] != base[i], f"tensor {i} ({tensors[i].dtype}, {tensors[i].numel() * tensors[i].element_size()} B)"
        assert got[:i] + got[i + 1:] == base[:i] + base[i + 1:]


def test_checksums_odd_byte_sizes():
    # 10 bytes (float16 x5) and 3 bytes (int8 x3): neither a multiple of 4.
    h = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float16)
    h2 = h.clone()
    h2[2] = 7.0
    assert checksums([h]) == checksums([h.clone()])
    assert checksums([h2]) != checksums([h])
    b = torch.tensor([1, 2, 3], dtype=torch.int8)
    b2 = b.clone()
    b2[0] = 9
    assert checksums([b]) == checksums([b.clone()]) and checksums([b2]) != checksums([b])


def test_checksums_of_views_match_their_copies():
    """Engines' parameters are often views into a flat buffer (fused or flattened weights) at any offset;
    a checksum depends on the bytes only, not on where the tensor starts in its storage."""
    flat = torch.arange(40, dtype=torch.float32) * 1.5
    views = [flat[1:3], flat[1:5], flat[3:11], flat[2:4], flat[5:8], flat[1:2]]
    assert checksums(views) == checksums([v.clone() for v in views])
    h = torch.arange(20, dtype=torch.float16)
    hv = [h[1:5], h[3:7], h[1:3], h[2:6]]
    assert checksums(hv) == checksums([v.clone() for v in hv])
    # Non-contiguous (transposed) views checksum their logical contents.
    m = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert checksums([m.t()]) == checksums([m.t().contiguous()])


def test_digest_is_deterministic_and_order_sensitive():
    vals = [5, -3, 2**63 - 1, 0, 17]
    assert digest(vals) == digest(list(vals))
    assert digest(vals) != digest(list(reversed(vals)))
    assert digest([1, 2]) != digest([2, 1])
    assert digest([1, 2]) != digest([1, 3])
    assert 0 <= digest(vals) < 2**63 and 0 <= digest([]) < 2**63


# ============================================================================ plan

def test_make_plan_routes_colocated_engines_to_ipc_and_others_to_broadcast():
    trainers = ["n0/cpu-slot0", "n0/cpu-slot1"]
    engines = {
        "e_remote": ["n1/cpu-slot0"],
        "e_colo1": ["n0/cpu-slot1"],
        "e_tp": ["n1/cpu-slot1", "n1/cpu-slot2"],     # two workers (tensor parallel)
        "e_colo0": ["n0/cpu-slot0"],
        "e_remote2": ["n2/cpu-slot0"],
    }
    plan = make_plan(trainers, engines)
    r = plan.routes
    assert (r["e_colo1"].transport, r["e_colo1"].sender_rank, r["e_colo1"].group_ranks) == ("ipc", 1, ())
    assert (r["e_colo0"].transport, r["e_colo0"].sender_rank) == ("ipc", 0)
    assert plan.ipc_targets == {1: ["e_colo1"], 0: ["e_colo0"]}
    assert r["e_remote"].transport == "broadcast" and r["e_remote"].sender_rank == 0
    assert r["e_remote"].group_ranks == (1,)
    assert r["e_tp"].group_ranks == (2, 3)
    assert r["e_remote2"].group_ranks == (4,)
    assert plan.group_world_size == 1 + 4
    assert sorted(plan.broadcast_engines) == ["e_remote", "e_remote2", "e_tp"]
    assert plan.summary()["e_colo1"] == "ipc from trainer rank 1"


def test_make_plan_forced_broadcast():
    plan = make_plan(["d0", "d1"], {"a": ["d0"], "b": ["d1"]}, transport="broadcast")
    assert {n: (r.transport, r.sender_rank, r.group_ranks) for n, r in plan.routes.items()} == {
        "a": ("broadcast", 0, (1,)), "b": ("broadcast", 0, (2,))}
    assert plan.group_world_size == 3 and plan.ipc_targets == {}


def test_make_plan_forced_ipc_with_remote_engine_is_a_config_error():
    with pytest.raises(ConfigError) as ei:
        make_plan(["d0"], {"a": ["d0"], "far": ["d9"]}, transport="ipc")
    assert "weight_sync.transport" in str(ei.value) and "far" in str(ei.value)
    # All colocated: forced ipc is fine.
    plan = make_plan(["d0"], {"a": ["d0"]}, transport="ipc")
    assert plan.routes["a"].transport == "ipc" and plan.group_world_size == 0
    with pytest.raises(ConfigError, match="weight_sync.transport"):
        make_plan(["d0"], {"a": ["d0"]}, transport="nvlink")


def test_make_plan_without_broadcast_engines_has_no_group():
    plan = make_plan(["d0", "d1"], {"a": ["d0"], "b": ["d1"]})
    assert plan.group_world_size == 0 and plan.broadcast_engines == []
    assert make_plan(["d0"], {}).group_world_size == 0


# ============================================================================ ipc across processes

def _ipc_child(handle: IpcHandle, other: IpcHandle, q):
    try:
        cache = HandleCache()
        t = cache.open(handle)
        same = cache.open(handle) is t
        other_t = cache.open(other)
        seen = t.clone().tolist()
        t[:] = torch.arange(t.numel(), dtype=torch.uint8) * 3 + 1      # write through the mapping
        other_t.fill_(0x5A)
        q.put(("ok", seen, same, other_t is t))
    except BaseException as e:  # report, never hang the parent
        q.put(("error", repr(e), None, None))


def test_ipc_handle_is_zero_copy_across_processes():
    bid, buf = allocate_shared(64, CPU)
    bid2, buf2 = allocate_shared(32, CPU)
    assert bid != bid2 and buf.dtype == torch.uint8 and buf.numel() == 64
    buf.copy_(torch.arange(64, dtype=torch.uint8) * 2)
    buf2.zero_()
    h, h2 = export_handle(bid, buf), export_handle(bid2, buf2)
    assert h.device == "cpu" and h.buffer_id == bid and isinstance(h.payload, bytes)

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(h, h2, q), daemon=True)
    p.start()
    try:
        status, seen, same, aliased = q.get(timeout=CHILD_TIMEOUT_S)
        assert status == "ok", seen
        p.join(CHILD_TIMEOUT_S)
        assert p.exitcode == 0
    finally:
        stop_children([p])
    assert seen == [2 * i for i in range(64)]                 # the child read the parent's bytes
    assert same is True and aliased is False                   # cache: one tensor per buffer id
    assert buf.tolist() == [(3 * i + 1) % 256 for i in range(64)]   # the parent sees the child's write
    assert buf2.tolist() == [0x5A] * 32


def test_handle_cache_in_process_returns_same_mapped_tensor():
    bid, buf = allocate_shared(16, CPU)
    h = export_handle(bid, buf)
    cache = HandleCache()
    t = cache.open(h)
    assert cache.open(h) is t
    assert cache.open(IpcHandle(bid, h.device, h.payload)) is t     # keyed by buffer id
    t[3] = 77
    assert int(buf[3]) == 77                                       # same pages
    cache.clear()
    t2 = cache.open(export_handle(bid, buf))
    assert t2 is not t
    buf[5] = 9
    assert int(t2[5]) == 9
    assert int(open_handle(export_handle(bid, buf))[3]) == 77


# ============================================================================ sender -> receivers

MODEL = [
    spec("embed.weight", "float32", 32, 8),          # 1024 B
    spec("layers.0.ln.weight", "float32", 8),
    spec("layers.0.attn.qkv.weight", "float32", 24, 8),   # 768 B
    spec("layers.0.attn.o.bias", "float32", 3),
    spec("layers.0.mlp.up.weight", "float32", 16, 8),
    spec("layers.0.mlp.down.weight", "float32", 8, 16),
    spec("layers.1.ln.weight", "float32", 8),
    spec("layers.1.mlp.up.weight", "float32", 5, 7),
    spec("lm_head.weight", "float32", 64, 8),         # 2048 B: bigger than a bucket
    spec("final.scale", "float32"),
]
MODEL_BUCKET = 1536    # 5 buckets: an odd count, so the last bucket is in buffer 0


def _model_values(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + version)
    return {s.name: torch.randn(s.shape, generator=g) * version for s in MODEL}


def _make_receiver(layouts):
    params = {s.name: torch.zeros(s.shape, dtype=dtype_from_name(s.dtype)) for s in MODEL}

    def load_fn(items):
        for name, t in items:
            params[name].copy_(t)

    def checksum_fn(names):
        return checksums(params[n] for n in names)

    return params, WeightReceiver(layouts, CPU, load_fn, checksum_fn)


def _dump(params):
    return {n: p.numpy().copy() for n, p in params.items()}


def _broadcast_engine(layouts, port, n_syncs, q):
    """Engine "B": rank 1 of the broadcast group, in its own process."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        params, recv = _make_receiver(layouts)
        recv.join_group("gloo", HOST, port, 1, 2, GROUP_TIMEOUT_S)
        for _ in range(n_syncs):
            sums, timings = recv.receive_broadcast()
            q.put(("ok", sums, _dump(params), sorted(timings)))
        recv.close()
    except BaseException as e:
        q.put(("error", repr(e), None, None))


def _ipc_engine(layouts, conn):
    """Engine "A": receives IPC handles over a pipe, acks each bucket with its checksums."""
    try:
        params, recv = _make_receiver(layouts)
        buffer_ids = set()
        while conn.poll(CHILD_TIMEOUT_S):
            msg = conn.recv()
            if msg[0] == "ipc":
                _, handle, index, version = msg
                buffer_ids.add(handle.buffer_id)
                conn.send(("ok", (index, version, recv.receive_ipc(handle, index))))
            elif msg[0] == "dump":
                conn.send(("ok", (_dump(params), sorted(buffer_ids))))
            else:
                break
        recv.close()
    except BaseException as e:
        conn.send(("error", repr(e)))


def _recv_pipe(conn):
    if not conn.poll(CHILD_TIMEOUT_S):
        raise TimeoutError("ipc engine did not answer")
    status, payload = conn.recv()
    if status != "ok":
        raise AssertionError(f"ipc engine failed: {payload}")
    return payload


def _assert_params_equal(got: dict, want: dict[str, torch.Tensor], who: str):
    assert sorted(got) == sorted(want), who
    for name, t in want.items():
        assert_bit_equal(torch.from_numpy(got[name]), t, f"{who}: {name}")


def test_sender_to_ipc_and_broadcast_receivers_two_syncs():
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    layouts = plan_buckets(MODEL, MODEL_BUCKET)
    assert len(layouts) == 5 and layouts[3].names == ["lm_head.weight"]   # >= 3, odd, one oversize
    port = free_port(HOST)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    parent_conn, child_conn = ctx.Pipe()
    pb = ctx.Process(target=_broadcast_engine, args=(layouts, port, 2, q), daemon=True)
    pa = ctx.Process(target=_ipc_engine, args=(layouts, child_conn), daemon=True)
    pb.start()
    pa.start()
    group = None
    try:
        group = BroadcastGroup("gloo", HOST, port, 0, 2, GROUP_TIMEOUT_S)
        assert group.warmup() == 1.0
        sender = WeightSender(layouts, CPU, ipc_engines=["A"], group=group)
        delivered: list[tuple[str, str, int, int]] = []
        acks: dict[tuple[int, int], list[int]] = {}     # (version, bucket) -> engine A's checksums

        def deliver(engine, handle, index, version):
            delivered.append((engine, handle.buffer_id, index, version))
            parent_conn.send(("ipc", handle, index, version))
            return version, index

        def wait(token):
            # Like a Ray ObjectRef: the token's own answer, whatever order the sender waits in.
            while token not in acks:
                index, version, sums = _recv_pipe(parent_conn)
                acks[(version, index)] = sums
            return acks.pop(token)

        def get_b():
            status, sums, params, timings = q.get(timeout=CHILD_TIMEOUT_S)
            assert status == "ok", f"broadcast engine failed: {sums}"
            assert timings == ["load_s", "total_s"]
            return sums, params

        layout_bytes = sum(b.nbytes for b in layouts)
        buffer_ids = None
        for version in (1, 2):
            values = _model_values(version)
            res = sender.send(iter(list(values.items())), version, deliver, wait)
            assert isinstance(res, SendResult)
            assert res.checksums == checksums(values[s.name] for s in MODEL)
            assert res.bytes == layout_bytes
            assert res.engine_checksums == {"A": res.checksums}

            sums_b, params_b = get_b()
            assert sums_b == res.checksums
            _assert_params_equal(params_b, values, f"engine B v{version}")
            parent_conn.send(("dump",))
            params_a, ids_a = _recv_pipe(parent_conn)
            _assert_params_equal(params_a, values, f"engine A v{version}")

            this = [d for d in delivered if d[3] == version]
            assert [d[2] for d in this] == [b.index for b in layouts]       # every bucket, in order, once
            ids = [d[1] for d in this]
            assert ids[0] != ids[1] and ids[::2] == [ids[0]] * len(ids[::2]) and ids[1::2] == [ids[1]] * len(ids[1::2])
            if buffer_ids is None:
                buffer_ids = set(ids)
            assert set(ids) == buffer_ids and ids_a == sorted(buffer_ids)   # same two buffers on sync 2
        assert len(buffer_ids) == 2

        parent_conn.send(("stop",))
        pa.join(CHILD_TIMEOUT_S)
        pb.join(CHILD_TIMEOUT_S)
        assert pa.exitcode == 0 and pb.exitcode == 0
    finally:
        if group is not None:
            group.destroy()
        stop_children([pa, pb])


# ============================================================================ sender errors / inactive

SMALL = [spec("layer.0.weight", "float32", 4), spec("layer.1.weight", "float32", 300), spec("layer.2.bias", "float32", 2),
         spec("layer.3.weight", "float32", 64)]


def _ipc_sender_and_receiver(bucket_bytes=512):
    layouts = plan_buckets(SMALL, bucket_bytes)
    params = {s.name: torch.zeros(s.shape) for s in SMALL}

    def load_fn(items):
        for n, t in items:
            params[n].copy_(t)

    recv = WeightReceiver(layouts, CPU, load_fn, lambda names: checksums(params[n] for n in names))
    sender = WeightSender(layouts, CPU, ipc_engines=["A"])

    def deliver(engine, handle, index, version):
        return recv.receive_ipc(handle, index)

    return sender, params, deliver, (lambda token: token)


@pytest.mark.parametrize("bucket_bytes,n_buckets", [(4096, 1), (1536, 2), (512, 3), (256, 4)])
def test_sender_in_process_ipc_acks_in_layout_order(bucket_bytes, n_buckets):
    sender, params, deliver, wait = _ipc_sender_and_receiver(bucket_bytes)
    assert len(sender.layouts) == n_buckets
    values = {s.name: torch.randn(s.shape) for s in SMALL}
    res = sender.send(iter(values.items()), 1, deliver, wait)
    # The coordinator compares these lists element by element: both must be in layout order.
    assert res.checksums == checksums(values.values())
    assert res.engine_checksums == {"A": res.checksums}
    assert res.bytes == sum(b.nbytes for b in sender.layouts)
    for n, t in values.items():
        assert_bit_equal(params[n], t, n)
    with pytest.raises(ValueError, match="deliver and wait"):
        sender.send(iter(values.items()), 2)


def test_sender_rejects_wrong_order():
    sender, _, deliver, wait = _ipc_sender_and_receiver()
    t = {s.name: torch.ones(s.shape) for s in SMALL}
    wrong = [("layer.1.weight", t["layer.1.weight"]), ("layer.0.weight", t["layer.0.weight"]),
             ("layer.2.bias", t["layer.2.bias"]), ("layer.3.weight", t["layer.3.weight"])]
    with pytest.raises(WeightSyncError, match=r"'layer\.0\.weight'"):
        sender.send(iter(wrong), 1, deliver, wait)
    # Order wrong only in a later bucket.
    wrong_late = [("layer.0.weight", t["layer.0.weight"]), ("layer.1.weight", t["layer.1.weight"]),
                  ("layer.2.weight", t["layer.2.bias"]), ("layer.3.weight", t["layer.3.weight"])]
    with pytest.raises(WeightSyncError, match=r"layer\.2\.bias"):
        sender.send(iter(wrong_late), 1, deliver, wait)


def test_sender_rejects_too_few_and_too_many_tensors():
    sender, _, deliver, wait = _ipc_sender_and_receiver()
    t = [(s.name, torch.ones(s.shape)) for s in SMALL]
    with pytest.raises(WeightSyncError, match=r"fewer.*layer\.2\.bias"):
        sender.send(iter(t[:2]), 1, deliver, wait)
    with pytest.raises(WeightSyncError, match="fewer"):
        sender.send(iter([]), 1, deliver, wait)
    with pytest.raises(WeightSyncError, match="more tensors"):
        sender.send(iter(t + [("extra", torch.ones(1))]), 1, deliver, wait)


def test_inactive_sender_drains_iterator_and_returns_empty_result():
    layouts = plan_buckets(SMALL, 512)
    sender = WeightSender(layouts, CPU)
    assert sender.active is False
    consumed = []

    def gen():
        for s in SMALL:
            consumed.append(s.name)
            yield s.name, torch.ones(s.shape)

    res = sender.send(gen(), 3)
    assert consumed == [s.name for s in SMALL]
    assert res.checksums == [] and res.engine_checksums == {} and res.bytes == 0 and res.total_s == 0.0


def test_bucket_checksums_match_per_tensor_checksums_for_many_small_tensors():
    from rlhf_orch.weight_sync.buckets import bucket_checksums
    torch.manual_seed(0)
    specs = [ParamSpec(f"e{i}", ["bfloat16", "float32", "float16"][i % 3], (i % 7 + 1, 3)) for i in range(200)]
    big = plan_buckets([ParamSpec("big", "float32", (4096,))], 1 << 20)[0]
    layout = plan_buckets(specs, 1 << 20)[0]
    assert len(layout.slots) == 200
    buf = torch.zeros(max(layout.nbytes, big.nbytes) + 64, dtype=torch.uint8)
    buf.random_()                       # stale bytes from an earlier, larger bucket
    buf[:layout.nbytes].zero_()         # ... but the slot region starts zeroed, as allocated
    tensors = [torch.randn(s.shape).to(getattr(torch, s.dtype)) for s in specs]
    pack(layout, tensors, buf)
    assert bucket_checksums(layout, buf) == checksums(tensors)
