"""Weight sync across real processes: zero-copy IPC handles, the sender feeding an ipc stream and a gloo-broadcast
receiver whose loads the coordinator checks, and the sender's error paths. Children are always joined with a timeout
and killed in `finally`."""

import multiprocessing as mp
import os

import pytest
import torch

from rlhf_orch.errors import WeightSyncError
from rlhf_orch.types import dtype_from_name
from rlhf_orch.weight_sync.buckets import checksums, plan_buckets
from rlhf_orch.weight_sync.collective import free_port
from rlhf_orch.weight_sync.ipc import IpcHandle, allocate_shared, export_handle, open_handle
from rlhf_orch.weight_sync.mailbox import SLOTS
from rlhf_orch.weight_sync.receiver import WeightReceiver
from rlhf_orch.weight_sync.sender import SendResult, WeightSender
from weight_sync_helpers import (CPU, HOST, CHILD_TIMEOUT_S, GROUP_TIMEOUT_S, assert_bit_equal, connect_ipc, group_spec,
                                 in_process_streams, ipc_spec, spec, stop_children)


# ============================================================================ ipc across processes

def _ipc_child(handle: IpcHandle, other: IpcHandle, q):
    try:
        t = open_handle(handle)
        other_t = open_handle(other)
        seen = t.clone().tolist()
        t[:] = torch.arange(t.numel(), dtype=torch.uint8) * 3 + 1      # write through the mapping
        other_t.fill_(0x5A)
        q.put(("ok", seen, other_t.data_ptr() != t.data_ptr()))
    except BaseException as e:  # report, never hang the parent
        q.put(("error", repr(e), None))


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
        status, seen, apart = q.get(timeout=CHILD_TIMEOUT_S)
        assert status == "ok", seen
        p.join(CHILD_TIMEOUT_S)
        assert p.exitcode == 0
    finally:
        stop_children([p])
    assert seen == [2 * i for i in range(64)]                 # the child read the parent's bytes
    assert apart is True                                       # two handles, two mappings
    assert buf.tolist() == [(3 * i + 1) % 256 for i in range(64)]   # the parent sees the child's write
    assert buf2.tolist() == [0x5A] * 32


def test_a_handle_opened_in_process_maps_the_same_pages():
    bid, buf = allocate_shared(16, CPU)
    t = open_handle(export_handle(bid, buf))
    t[3] = 77
    assert int(buf[3]) == 77                                       # same pages
    buf[5] = 9
    assert int(t[5]) == 9
    assert int(open_handle(IpcHandle(bid, "cpu", export_handle(bid, buf).payload))[3]) == 77


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
        recv.open("broadcast", group_spec(port, 2, rank=1), GROUP_TIMEOUT_S)
        for _ in range(n_syncs):
            sums, timings = recv.receive(0)
            q.put(("ok", sums, _dump(params), sorted(timings)))
        recv.close()
    except BaseException as e:
        q.put(("error", repr(e), None, None))


def _ipc_engine(layouts, conn):
    """Engine "A": opens the sender's ring buffers once, then takes each sync through its mailbox."""
    try:
        params, recv = _make_receiver(layouts)
        handles, timeout_s = conn.recv()
        recv.open("ipc", {}, timeout_s)
        conn.send(("ok", recv.connect(handles)))
        while conn.poll(CHILD_TIMEOUT_S):
            msg = conn.recv()
            if msg[0] != "sync":
                break
            sums, _ = recv.receive(msg[1])
            conn.send(("ok", (sums, _dump(params), len(recv.transport.bufs))))
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


def test_sender_to_an_ipc_stream_and_a_broadcast_receiver_two_syncs():
    """Rank 0 feeds a colocated engine through its stream and a broadcast engine that gets no checksums (its loads
    are checked by the coordinator, as tensor-parallel SGLang's are): both hold the trainer's exact weights, twice."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    layouts = plan_buckets(MODEL, MODEL_BUCKET)
    assert len(layouts) == 5 and layouts[3].names == ["lm_head.weight"]   # > SLOTS, one oversize
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
        # Opening the broadcast side joins the group and warms it up (a wrong warm-up value raises).
        sender = WeightSender(layouts, CPU, {**ipc_spec("A"), "broadcast": group_spec(port, 2)},
                              timeout_s=CHILD_TIMEOUT_S)
        group = sender.group
        assert group is not None
        handles = sender.offers()["ipc"]
        assert len({h.buffer_id for h in handles}) == SLOTS       # bucket k goes through ring buffer k % SLOTS
        parent_conn.send((handles, CHILD_TIMEOUT_S))
        sender.accept("ipc", "A", _recv_pipe(parent_conn))

        def get_b():
            status, sums, params, timings = q.get(timeout=CHILD_TIMEOUT_S)
            assert status == "ok", f"broadcast engine failed: {sums}"
            assert timings == ["load_s", "total_s"]
            return sums, params

        layout_bytes = sum(b.nbytes for b in layouts)
        for version in (1, 2):
            values = _model_values(version)
            parent_conn.send(("sync", version))
            res = sender.send(iter(list(values.items())), version, sync_id=version)
            assert isinstance(res, SendResult)
            assert res.checksums == checksums(values[s.name] for s in MODEL)
            assert res.bytes == layout_bytes
            sums_a, params_a, opened = _recv_pipe(parent_conn)
            assert sums_a == res.checksums and opened == SLOTS
            _assert_params_equal(params_a, values, f"engine A v{version}")
            sums_b, params_b = get_b()
            assert sums_b == res.checksums
            _assert_params_equal(params_b, values, f"engine B v{version}")

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
    """A sender and a colocated receiver in this process: `sync(named)` sends while a thread receives, and returns
    the sender's result and the receiver's checksums (tests/weight_sync_helpers.in_process_streams)."""
    layouts = plan_buckets(SMALL, bucket_bytes)
    params = {s.name: torch.zeros(s.shape) for s in SMALL}

    def load_fn(items):
        for n, t in items:
            params[n].copy_(t)

    recv = WeightReceiver(layouts, CPU, load_fn, lambda names: checksums(params[n] for n in names))
    sender = WeightSender(layouts, CPU, ipc_spec("A"), timeout_s=CHILD_TIMEOUT_S)
    stream = in_process_streams(sender, {"A": recv})

    def sync(named):
        res, got = stream(named)
        return res, {"sums": got["A"]}

    return sender, params, sync


@pytest.mark.parametrize("bucket_bytes,n_buckets", [(4096, 1), (1536, 2), (512, 3), (256, 4)])
def test_sender_in_process_ipc_acks_in_layout_order(bucket_bytes, n_buckets):
    sender, params, sync = _ipc_sender_and_receiver(bucket_bytes)
    assert len(sender.layouts) == n_buckets
    values = {s.name: torch.randn(s.shape) for s in SMALL}
    res, got = sync(iter(values.items()))
    # The coordinator compares these lists element by element: both must be in layout order.
    assert res.checksums == checksums(values.values())
    assert got == {"sums": res.checksums}
    assert res.bytes == sum(b.nbytes for b in sender.layouts)
    for n, t in values.items():
        assert_bit_equal(params[n], t, n)


def test_an_ipc_engine_without_a_stream_is_refused_before_anything_is_sent():
    layouts = plan_buckets(SMALL, 512)
    sender = WeightSender(layouts, CPU, ipc_spec("A", "B"))
    recv = WeightReceiver(layouts, CPU, lambda items: None)
    connect_ipc(sender, "A", recv, 5.0)
    with pytest.raises(WeightSyncError, match=r"\['B'\] have no stream"):
        sender.send(iter((s.name, torch.ones(s.shape)) for s in SMALL), 1, sync_id=1)
    with pytest.raises(ValueError, match="not an ipc engine"):
        sender.accept("ipc", "C", b"x")
    with pytest.raises(ValueError, match="does not send on"):
        WeightSender(layouts, CPU).accept("ipc", "A", b"x")
    recv.close()


def test_sender_rejects_wrong_order():
    sender, _, sync = _ipc_sender_and_receiver()
    t = {s.name: torch.ones(s.shape) for s in SMALL}
    wrong = [("layer.1.weight", t["layer.1.weight"]), ("layer.0.weight", t["layer.0.weight"]),
             ("layer.2.bias", t["layer.2.bias"]), ("layer.3.weight", t["layer.3.weight"])]
    with pytest.raises(WeightSyncError, match=r"'layer\.0\.weight'"):
        sync(iter(wrong))
    # Order wrong only in a later bucket.
    wrong_late = [("layer.0.weight", t["layer.0.weight"]), ("layer.1.weight", t["layer.1.weight"]),
                  ("layer.2.weight", t["layer.2.bias"]), ("layer.3.weight", t["layer.3.weight"])]
    with pytest.raises(WeightSyncError, match=r"layer\.2\.bias"):
        sync(iter(wrong_late))


def test_sender_rejects_too_few_and_too_many_tensors():
    sender, _, sync = _ipc_sender_and_receiver()
    t = [(s.name, torch.ones(s.shape)) for s in SMALL]
    with pytest.raises(WeightSyncError, match=r"fewer.*layer\.2\.bias"):
        sync(iter(t[:2]))
    with pytest.raises(WeightSyncError, match="fewer"):
        sync(iter([]))
    with pytest.raises(WeightSyncError, match="more tensors"):
        sync(iter(t + [("extra", torch.ones(1))]))


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
    assert res.checksums == [] and res.bytes == 0 and res.total_s == 0.0




# ============================================================================ staged sends (weight_sync.overlap)

def test_a_staged_send_carries_the_weights_of_the_stage_not_later_ones():
    """The trainer stages version 1, then trains on (its live weights change) while the staged copy is sent: the
    engine gets version 1 exactly, and its checksums are version 1's. A replacement sender (a re-plan after a fault)
    keeps the staged copy, so the failed sync can be sent again; a fresh one refuses to send without a stage."""
    sender, params, sync = _ipc_sender_and_receiver(512)
    live = {s.name: torch.randn(s.shape) for s in SMALL}
    v1 = {n: t.clone() for n, t in live.items()}
    stage = sender.stage(iter(live.items()), 1)
    assert sender.staged_version == 1 and stage["stage_gb"] == pytest.approx(sum(t.numel() * 4 for t in v1.values()) / 2**30)
    for t in live.values():
        t.add_(1.0)                                   # the next train step
    res, got = sync(sender.staged())
    assert res.checksums == checksums(v1.values()) == got["sums"]
    for n, t in v1.items():
        assert_bit_equal(params[n], t, n)
    again, _, _ = _ipc_sender_and_receiver(512)
    with pytest.raises(WeightSyncError, match="without a stage"):
        again.staged()
    again.adopt_stage(*sender.kept_stage())
    assert again.staged_version == 1 and [checksums([t])[0] for _, t in again.staged()] == res.checksums
    with pytest.raises(WeightSyncError, match="expects"):   # a stage checks the layout like a send
        sender.stage(iter(reversed(list(live.items()))), 2)


def test_release_takes_the_cpu_buffers_names_out_of_dev_shm_and_a_sync_still_works():
    """A trainer rank about to be killed (the run's end) releases its sender: the ring buffers' /dev/shm names go
    (each run used to leave them there), the mapped pages stay, so a sync in flight or a mapped receiver still works."""
    sender, params, sync = _ipc_sender_and_receiver(1536)
    names = ["/dev/shm/" + b.untyped_storage()._share_filename_cpu_()[1].decode().lstrip("/") for _, b in sender._bufs]
    assert names and all(os.path.exists(n) for n in names)
    sender.release()
    assert not any(os.path.exists(n) for n in names)
    values = {s.name: torch.randn(s.shape) for s in SMALL}
    res, _ = sync(iter(values.items()))
    assert res.checksums == checksums(values.values()) and all(torch.equal(params[n], v) for n, v in values.items())
    sender.release()   # twice: nothing left to remove
