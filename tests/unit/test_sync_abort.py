"""Issue #33: a sync whose member fails ends on every survivor at once, not at the group's timeout.

Real processes and a real gloo group: a broadcast receiver whose sync is aborted through its flag lets go within a
second (its group's timeout is 30 s); a sender whose colocated engine fails mid-sync leaves its group, so a broadcast
receiver with no abort flag at all fails at once instead of waiting for the checksums that never come; a mailbox
wait ends on its check. Elapsed-time bounds here are far below the 30 s timeout they replace: they tell "aborted"
from "timed out", they do not measure speed.
"""
import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from rlhf_orch.errors import WeightSyncError
from rlhf_orch.weight_sync.abort import AbortFlag, SyncAborted
from rlhf_orch.weight_sync.buckets import plan_buckets
from rlhf_orch.weight_sync.collective import BroadcastGroup, free_port
from rlhf_orch.weight_sync.mailbox import Mailbox, seq_of
from rlhf_orch.weight_sync.receiver import WeightReceiver
from rlhf_orch.weight_sync.sender import WeightSender
from weight_sync_helpers import (CHILD_TIMEOUT_S, CPU, GROUP_TIMEOUT_S, HOST, connect_ipc, group_spec, ipc_spec, spec,
                                 stop_children)

MODEL = [spec(f"layers.{i}.weight", "float32", 16, 8) for i in range(5)]   # 512 B each
BUCKET = 1024   # 3 buckets


def _values():
    g = torch.Generator().manual_seed(7)
    return [(s.name, torch.randn(s.shape, generator=g)) for s in MODEL]


def _receiver_child(layouts, port, flag_path, sync_id, expect_sums, q):
    """Rank 1 of the group: receive one sync; report how it ended and after how long."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        params = {s.name: torch.zeros(s.shape) for s in MODEL}

        def load(items):
            for name, t in items:
                params[name].copy_(t)

        recv = WeightReceiver(layouts, CPU, load, None)
        if flag_path:
            recv.abort_flag = AbortFlag.attach(flag_path)
        recv.open("broadcast", group_spec(port, 2, sums=expect_sums, rank=1), GROUP_TIMEOUT_S)
        q.put(("joined", 0.0, ""))
        t0 = time.monotonic()
        try:
            recv.receive(sync_id, verify=False)
            q.put(("finished", time.monotonic() - t0, ""))
        except BaseException as e:
            q.put((type(e).__name__, time.monotonic() - t0, str(e)[:300]))
        t1 = time.monotonic()
        recv.close()   # the abandoned group must not make closing wait
        q.put(("closed", time.monotonic() - t1, str(recv.group)))
    except BaseException as e:
        q.put(("error", 0.0, repr(e)))


def _start_child(*args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receiver_child, args=(*args, q), daemon=True)
    p.start()
    return p, q


def test_abort_flag_counts_syncs_and_is_seen_by_another_mapping():
    flag = AbortFlag.create()
    try:
        other = AbortFlag.attach(flag.handle())
        assert not other.aborted(1)
        flag.abort(3)
        assert other.aborted(3) and other.aborted(2) and not other.aborted(4)
        assert not other.aborted(0)       # syncs numbered 0 (benchmarks) never abort
        flag.abort(2)                     # an older number does not lower the word
        assert other.aborted(3)
        with pytest.raises(SyncAborted, match="sync 3 aborted"):
            other.checker(3, "engine")()
        other.checker(4, "engine")()      # a later sync goes on
        assert issubclass(SyncAborted, WeightSyncError)
    finally:
        flag.unlink()
    assert not os.path.exists(flag.handle())


def test_mailbox_wait_ends_on_its_check():
    box = Mailbox.create(4)
    try:
        calls = []

        def check():
            calls.append(1)
            if len(calls) > 3:
                raise SyncAborted("aborted here")

        box.check = check
        t0 = time.monotonic()
        with pytest.raises(SyncAborted):
            box.wait_ready(0, seq_of(5, 0), time.monotonic() + GROUP_TIMEOUT_S, "bucket 0 of sync 5")
        assert time.monotonic() - t0 < 5
    finally:
        box.unlink()


def test_aborted_broadcast_receiver_lets_go_at_once_and_closes_without_waiting():
    """Rank 0 never sends sync 5's first bucket (as when a colocated engine died before it); the coordinator's
    abort (here: the flag written by this process, the receiver's owner) ends the receive within a second."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    layouts = plan_buckets(MODEL, BUCKET)
    flag = AbortFlag.create()
    port = free_port(HOST)
    p, q = _start_child(layouts, port, flag.handle(), 5, True)
    group = None
    try:
        group = BroadcastGroup("gloo", HOST, port, 0, 2, GROUP_TIMEOUT_S)
        group.warmup()
        assert q.get(timeout=CHILD_TIMEOUT_S)[0] == "joined"
        time.sleep(0.5)
        flag.abort(5)
        how, secs, msg = q.get(timeout=CHILD_TIMEOUT_S)
        assert how == "SyncAborted" and "sync 5 aborted" in msg, (how, msg)
        assert secs < 0.5 + 5 < GROUP_TIMEOUT_S
        how, secs, group_after = q.get(timeout=CHILD_TIMEOUT_S)
        assert how == "closed" and secs < 5 and group_after == "None"
        p.join(CHILD_TIMEOUT_S)
        assert p.exitcode == 0
    finally:
        flag.unlink()
        if group is not None:
            group.destroy()
        stop_children([p])


def test_a_failing_sender_frees_broadcast_receivers_without_any_abort():
    """The colocated engine gives up on the sync (its mailbox says so, as it does when the engine's receive fails), so
    the sender's wait for it raises. Rank 0 then leaves the group, so the broadcast receiver, which has no abort flag and
    waits for the checksums that follow the buckets, fails at once (its group's timeout is 30 s)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    layouts = plan_buckets(MODEL, BUCKET)
    port = free_port(HOST)
    p, q = _start_child(layouts, port, None, 9, True)
    try:
        flag = AbortFlag.create()
        flag.unlink()   # this process's mapping is all the sender needs
        sender = WeightSender(layouts, CPU, {**ipc_spec("colocated"), "broadcast": group_spec(port, 2, sums=True)},
                              abort_flag=flag)
        assert q.get(timeout=CHILD_TIMEOUT_S)[0] == "joined"
        colocated = WeightReceiver(layouts, CPU, lambda named: None)   # connected, then gives up without a receive
        connect_ipc(sender, "colocated", colocated, GROUP_TIMEOUT_S)
        # The broadcast receiver is waiting for the checksums by the time the colocated engine gives up.
        threading.Timer(0.3, colocated.abort_stream).start()

        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="gave up"):
            sender.send(iter(_values()), 1, sync_id=9)
        assert sender.group is None and time.monotonic() - t0 < 5
        how, secs, msg = q.get(timeout=CHILD_TIMEOUT_S)
        assert how in ("RuntimeError", "DistBackendError") and secs < 5, (how, secs, msg)
        assert "closed" in msg.lower() or "reset" in msg.lower(), msg
        p.join(CHILD_TIMEOUT_S)
        assert p.exitcode == 0
    finally:
        stop_children([p])


def test_a_sender_aborted_while_waiting_for_an_engine_raises_sync_aborted():
    """The coordinator's abort reaches a trainer rank waiting for a colocated engine's acknowledgement (the engine
    answers nothing): the wait ends with SyncAborted, not at the sync deadline."""
    layouts = plan_buckets(MODEL, BUCKET)
    flag = AbortFlag.create()
    flag.unlink()
    sender = WeightSender(layouts, CPU, ipc_spec("e"), timeout_s=GROUP_TIMEOUT_S, abort_flag=flag)
    box = Mailbox.create(len(MODEL))
    try:
        sender.accept("ipc", "e", box.handle())

        def abort_soon():
            time.sleep(0.3)
            flag.abort(4)

        threading.Thread(target=abort_soon, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(SyncAborted, match="trainer rank: sync 4 aborted"):
            sender.send(iter(_values()), 1, sync_id=4)
        assert time.monotonic() - t0 < 5
    finally:
        box.unlink()


class _PendingWork:
    """A collective that never completes (an NCCL broadcast whose sender stopped): the seam beside the real gloo
    tests above and the GPU run (bench/device/round9.sh mixed), where the same wait is an NCCL work's end event."""
    def __init__(self):
        self.polls = self.waits = 0

    def is_completed(self):
        self.polls += 1
        return False

    def wait(self):
        self.waits += 1


def test_an_nccl_wait_with_a_check_is_polled_so_an_abort_ends_it():
    """NCCL's work.wait() returns at once (it only orders the stream), so before this the receiver's next host read
    blocked in CUDA, deaf to the abort, until NCCL's watchdog killed the vLLM engine core (2x H100, 2026-11-28)."""
    group = object.__new__(BroadcastGroup)
    group.backend = "nccl"
    flag = AbortFlag.create()
    try:
        work = _PendingWork()
        threading.Timer(0.2, flag.abort, args=(9,)).start()
        t0 = time.monotonic()
        with pytest.raises(SyncAborted, match="sync 9 aborted"):
            group.wait(work, flag.checker(9, "engine"))
        assert 0.15 < time.monotonic() - t0 < 5 and work.polls > 1 and work.waits == 0
        group.wait(work)   # no check: the stream-ordering wait only, as before
        assert work.waits == 1
    finally:
        flag.unlink()
