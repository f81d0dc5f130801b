"""Weight-sync layout and planning: buckets, packing, checksums, digest and the transport plan (no processes)."""


import pytest
import torch

from rlhf_orch.errors import ConfigError
from rlhf_orch.types import ParamSpec, dtype_from_name
from rlhf_orch.weight_sync.buckets import ALIGN, checksums, digest, pack, plan_buckets, unpack
from rlhf_orch.weight_sync.plan import make_plan
from weight_sync_helpers import assert_bit_equal, spec


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


def test_make_plan_never_chooses_ipc_across_nodes():
    # Same device ids (a stand-in that cannot tell nodes apart), different Ray nodes: broadcast, never IPC.
    trainers, engines = ["d0", "d1"], {"same": ["d0"], "other_node": ["d1"]}
    plan = make_plan(trainers, engines, "auto", ["node-a", "node-a"], {"same": "node-a", "other_node": "node-b"})
    assert plan.routes["same"].transport == "ipc" and plan.routes["other_node"].transport == "broadcast"
    assert plan.ipc_targets == {0: ["same"]} and plan.group_world_size == 2
    with pytest.raises(ConfigError) as ei:   # forcing IPC across nodes names both nodes
        make_plan(trainers, engines, "ipc", ["node-a", "node-a"], {"same": "node-a", "other_node": "node-b"})
    assert "other_node" in str(ei.value) and "node-b" in str(ei.value) and "node-a" in str(ei.value)
    # Without node information the device ids decide, as on one machine.
    assert make_plan(trainers, engines).routes["other_node"].transport == "ipc"


def test_make_plan_without_broadcast_engines_has_no_group():
    plan = make_plan(["d0", "d1"], {"a": ["d0"], "b": ["d1"]})
    assert plan.group_world_size == 0 and plan.broadcast_engines == []
    assert make_plan(["d0"], {}).group_world_size == 0


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


def test_sync_deadline_fits_the_bytes_unless_configured():
    from rlhf_orch.weight_sync.plan import sync_deadline_s
    assert sync_deadline_s(0, None) == 60.0
    assert sync_deadline_s(16 * 10**9, None) == 60.0 + 160.0     # an 8B model in bf16
    assert sync_deadline_s(16 * 10**9, 45.0) == 45.0
