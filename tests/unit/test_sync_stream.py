"""The one-call sync paths across real processes: a colocated receiver fed through the shared-memory mailbox
(weight_sync/mailbox.py) and a broadcast receiver that checks the trainer's checksums itself; their failures
(a corrupted load, a dead engine process) stop the sender at once, not at its deadline."""

import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from rlhf_orch.errors import WeightSyncError
from rlhf_orch.types import dtype_from_name
from rlhf_orch.weight_sync.buckets import checksums, plan_buckets
from rlhf_orch.weight_sync.collective import free_port
from rlhf_orch.weight_sync.mailbox import ORPHAN_AGE_S, PREFIX, Mailbox, remove_orphans, seq_of
from rlhf_orch.weight_sync.receiver import WeightReceiver
from rlhf_orch.weight_sync.sender import WeightSender
from weight_sync_helpers import (CPU, HOST, CHILD_TIMEOUT_S, GROUP_TIMEOUT_S, assert_bit_equal, group_spec, ipc_spec, spec,
                                 stop_children)

MODEL = [spec("embed.weight", "float32", 32, 8), spec("layers.0.w", "float32", 24, 8), spec("layers.0.b", "float32", 3),
         spec("layers.1.w", "float32", 16, 8), spec("lm_head.weight", "float32", 64, 8), spec("scale", "float32")]
BUCKET = 1536    # 4 buckets, one of them oversize


def _values(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(77 + version)
    return {s.name: torch.randn(s.shape, generator=g) * version for s in MODEL}


def _receiver(layouts, corrupt: str | None = None):
    params = {s.name: torch.zeros(s.shape, dtype=dtype_from_name(s.dtype)) for s in MODEL}

    def load_fn(items):
        for name, t in items:
            params[name].copy_(t)
            if name == corrupt:
                params[name].view(-1)[0] += 1.0     # a load that silently changes one value

    return params, WeightReceiver(layouts, CPU, load_fn, lambda names: checksums(params[n] for n in names))


def _stream_engine(layouts, conn, n_syncs, corrupt):
    try:
        params, recv = _receiver(layouts, corrupt)
        handles, timeout_s = conn.recv()
        recv.open("ipc", {}, timeout_s)
        conn.send(("ok", recv.connect(handles)))
        for sync_id in range(1, n_syncs + 1):
            try:
                sums, timings = recv.receive(sync_id)
            except WeightSyncError as e:
                conn.send(("refused", str(e)))
                return
            conn.send(("ok", (sums, {n: p.clone() for n, p in params.items()}, sorted(timings))))
        conn.recv()    # the parent's "stop"
    except BaseException as e:
        conn.send(("error", repr(e)))


def _broadcast_engine(layouts, port, n_syncs, q, corrupt):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        params, recv = _receiver(layouts, corrupt)
        recv.open("broadcast", group_spec(port, 2, sums=True, rank=1), GROUP_TIMEOUT_S)
        for _ in range(n_syncs):
            try:
                sums, _ = recv.receive(0)
            except WeightSyncError as e:
                q.put(("refused", str(e)))
                return
            q.put(("ok", (sums, {n: p.clone() for n, p in params.items()})))
        recv.close()
    except BaseException as e:
        q.put(("error", repr(e)))


def _answer(conn):
    assert conn.poll(CHILD_TIMEOUT_S), "the engine process did not answer"
    return conn.recv()


def _start(layouts, n_syncs, corrupt_a=None, corrupt_b=None):
    ctx = mp.get_context("spawn")
    port = free_port(HOST)
    q = ctx.Queue()
    parent, child = ctx.Pipe()
    pa = ctx.Process(target=_stream_engine, args=(layouts, child, n_syncs, corrupt_a), daemon=True)
    pb = ctx.Process(target=_broadcast_engine, args=(layouts, port, n_syncs, q, corrupt_b), daemon=True)
    pa.start(), pb.start()
    sender = WeightSender(layouts, CPU, {**ipc_spec("A"), "broadcast": group_spec(port, 2, sums=True)},
                          timeout_s=CHILD_TIMEOUT_S)
    parent.send((sender.offers()["ipc"], CHILD_TIMEOUT_S))
    status, box = _answer(parent)
    assert status == "ok", box
    sender.accept("ipc", "A", box)
    return sender, sender.group, parent, q, [pa, pb]


def test_stream_and_self_verifying_broadcast_two_syncs_without_a_call_per_bucket():
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    layouts = plan_buckets(MODEL, BUCKET)
    assert len(layouts) == 4
    sender, group, parent, q, procs = _start(layouts, 2)
    try:
        for sync_id, version in ((1, 5), (2, 6)):
            values = _values(version)
            # No call per bucket: the stream engine is fed through its mailbox only.
            res = sender.send(iter(list(values.items())), version, sync_id=sync_id)
            want = checksums(values[s.name] for s in MODEL)
            assert res.checksums == want
            status, (sums_a, params_a, timings) = _answer(parent)
            assert status == "ok" and sums_a == want and timings == ["load_s", "on_device", "total_s", "wait_s"]
            status, (sums_b, params_b) = q.get(timeout=CHILD_TIMEOUT_S)
            assert status == "ok" and sums_b == want
            for name, t in values.items():
                assert_bit_equal(params_a[name], t, f"stream engine {name} v{version}")
                assert_bit_equal(params_b[name], t, f"broadcast engine {name} v{version}")
        parent.send("stop")
    finally:
        group.destroy()
        stop_children(procs)


def test_a_corrupt_stream_load_is_refused_by_the_engine_and_the_sender_stops_at_once():
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    layouts = plan_buckets(MODEL, BUCKET)
    sender, group, parent, q, procs = _start(layouts, 1, corrupt_a="layers.1.w")
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="gave up"):
            sender.send(iter(list(_values(1).items())), 1, sync_id=1)
        assert time.monotonic() - t0 < CHILD_TIMEOUT_S / 2     # told by the engine, not by the deadline
        status, msg = _answer(parent)
        assert status == "refused" and "layers.1.w" in msg and "ipc" in msg
    finally:
        group.destroy()
        stop_children(procs)


def test_a_corrupt_broadcast_load_is_refused_by_the_engine():
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    layouts = plan_buckets(MODEL, BUCKET)
    sender, group, parent, q, procs = _start(layouts, 1, corrupt_b="scale")
    try:
        sender.send(iter(list(_values(1).items())), 1, sync_id=1)
        assert _answer(parent)[0] == "ok"
        status, msg = q.get(timeout=CHILD_TIMEOUT_S)
        assert status == "refused" and "scale" in msg and "broadcast" in msg
        parent.send("stop")
    finally:
        group.destroy()
        stop_children(procs)


def _connect_then_hang(layouts, conn):
    _, recv = _receiver(layouts)
    handles, timeout_s = conn.recv()
    recv.open("ipc", {}, timeout_s)
    conn.send(("ok", recv.connect(handles)))
    time.sleep(600)    # never takes the sync; the test kills this process


def test_sender_stops_when_the_engine_process_dies():
    layouts = plan_buckets(MODEL, BUCKET)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_connect_then_hang, args=(layouts, child), daemon=True)
    p.start()
    try:
        sender = WeightSender(layouts, CPU, ipc_spec("A"), timeout_s=CHILD_TIMEOUT_S)
        parent.send((sender.offers()["ipc"], CHILD_TIMEOUT_S))
        status, box = _answer(parent)
        sender.accept("ipc", "A", box)
        threading.Timer(0.5, p.kill).start()    # a real process killed mid-sync
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="is gone"):
            sender.send(iter(list(_values(1).items())), 1, sync_id=1)
        assert time.monotonic() - t0 < CHILD_TIMEOUT_S / 2
    finally:
        stop_children([p])
        if os.path.exists(box.decode().split("|")[0]):   # a killed engine leaves its (tiny) file behind
            os.unlink(box.decode().split("|")[0])


def test_mailbox_sequence_numbers_never_match_an_earlier_sync():
    box = Mailbox.create(3)
    peer = Mailbox.attach(box.handle())
    assert seq_of(2, 0) > seq_of(1, (1 << 20) - 2)
    peer.publish(1, seq_of(4, 1), 0, [7, -8, 9])
    assert box.expected(0, 3) == [7, -8, 9]
    box.wait_ready(1, seq_of(4, 1), time.monotonic() + 1, "here")
    with pytest.raises(WeightSyncError, match="deadline"):
        box.wait_ready(1, seq_of(5, 1), time.monotonic() + 0.05, "a later sync's bucket")
    box.ack(1, seq_of(4, 1))
    peer.wait_done(1, seq_of(4, 1), time.monotonic() + 1, "here")
    box.unlink(only_if_attached=True)          # the sender has mapped it: the file goes, the mappings stay
    assert not os.path.exists(box.path)
    peer.publish(0, seq_of(6, 0), 0, [])       # the mappings still work after the unlink
    box.wait_ready(0, seq_of(6, 0), time.monotonic() + 1, "after unlink")



def test_mailbox_carries_the_gpu_handover_words_and_both_sides_event_handles():
    """The GPU hand-over's host words (mailbox.py): each side's 64-byte event handles (one per slot), the mode
    the sender chose for a sync, and its final checksums after the last bucket. The events themselves need CUDA
    (tests/gpu/test_gpu_handover.py); on CPU every sync is a host hand-over."""
    from rlhf_orch.weight_sync.mailbox import DEVICE, HOST, SLOTS
    box = Mailbox.create(4)
    peer = Mailbox.attach(box.handle())
    assert box.events(of_sender=True) is None and peer.events(of_sender=False) is None   # none made yet
    mine = [bytes([i + 1]) * 64 for i in range(SLOTS)]
    theirs = [bytes(range(i, i + 64)) for i in range(SLOTS)]
    box.put_events(False, mine)
    peer.put_events(True, theirs)
    assert peer.events(of_sender=False) == mine and box.events(of_sender=True) == theirs
    with pytest.raises(ValueError, match="slots"):
        box.put_events(False, mine[:1])
    peer.begin(DEVICE)
    assert box.mode() == DEVICE
    peer.begin(HOST)
    assert box.mode() == HOST
    with pytest.raises(WeightSyncError, match="deadline"):
        box.wait_final(seq_of(3, 2), time.monotonic() + 0.05, "final sums")
    peer.publish_final(seq_of(3, 2), [1, -2, 3, 2**63 - 1])
    box.wait_final(seq_of(3, 2), time.monotonic() + 1, "final sums")
    assert box.expected(0, 4) == [1, -2, 3, 2**63 - 1]


def test_a_cpu_sender_hands_over_on_the_host():
    """Without CUDA there are no events: the sender keeps the per-bucket host hand-over, so CPU runs are unchanged."""
    layouts = plan_buckets(MODEL, BUCKET)
    sender = WeightSender(layouts, CPU, ipc_spec("A"))
    assert sender.gpu_handover is False


def test_mailbox_files_of_dead_receivers_are_swept_when_a_new_one_is_made(tmp_path):
    """A receiver SIGKILLed before its sender attached leaves its file; the next Mailbox.create on the machine removes
    files whose creator is gone and that are older than a sync's set-up could be, and nothing else."""
    dead = subprocess_pid_that_exited()
    old, young, live, other = (tmp_path / f"{PREFIX}{dead}_a", tmp_path / f"{PREFIX}{dead}_b",
                               tmp_path / f"{PREFIX}{os.getpid()}_c", tmp_path / "unrelated_file")
    for p in (old, young, live, other):
        p.write_bytes(b"x")
    long_ago = time.time() - 2 * ORPHAN_AGE_S
    os.utime(old, (long_ago, long_ago))
    os.utime(live, (long_ago, long_ago))
    assert remove_orphans(str(tmp_path)) == [old.name]
    assert not old.exists() and young.exists() and live.exists() and other.exists()


def subprocess_pid_that_exited() -> int:
    p = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    p.start()
    p.join()
    return p.pid
