"""The GPU hand-over of a colocated stream (weight_sync/mailbox.py): a trainer and an engine process on one GPU hand
buckets over through shared CUDA events instead of host waits, and every tensor is still checked. Run on the
lent device:

    python -m pytest -q -m gpu tests/gpu/test_gpu_handover.py

The ring of 3 buffers wraps many times per sync here (24 buckets), so an engine that read a buffer before the
trainer's pack of it finished, or a trainer that refilled a buffer the engine still read, would show as a
checksum mismatch or as wrong bytes in the engine's parameters (both checked after every sync).
"""
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from rlhf_orch.errors import WeightSyncError  # noqa: E402
from rlhf_orch.weight_sync.buckets import checksums, plan_buckets  # noqa: E402
from rlhf_orch.weight_sync.receiver import WeightReceiver  # noqa: E402
from rlhf_orch.weight_sync.replay import LoadReplay  # noqa: E402
from rlhf_orch.weight_sync.sender import WeightSender  # noqa: E402
from weight_sync_helpers import CHILD_TIMEOUT_S, assert_bit_equal, ipc_spec, spec, stop_children  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

# 24 tensors of 4 MiB (bf16) and 8 small ones: one bucket each at 4 MiB buckets, the small ones packed together.
MODEL = [spec(f"layers.{i}.w", "bfloat16", 1024, 2048) for i in range(24)] + \
        [spec(f"layers.{i}.norm", "float32", 2048) for i in range(8)]
BUCKET = 4 << 20


def _values(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1000 + version)
    return {s.name: torch.randn(s.shape, generator=g, device="cuda").to(getattr(torch, s.dtype)) for s in MODEL}


def _die_with_a_load_queued(recv: WeightReceiver, bucket: int) -> None:
    """Fault seam: after queueing bucket `bucket`'s load (at the second sync: replayed, no host wait), queue ~2 s of
    GPU spinning behind it and SIGKILL this process 0.3 s later, so the trainer has seen the bucket acknowledged
    while the engine's event for it can never complete."""
    load, count = recv.load_bucket, [0]   # the seam every transport loads a bucket through

    def wrapped(layout, buf, verify, out=None):
        got = load(layout, buf, verify, out)
        if layout.index == bucket:
            count[0] += 1
            if count[0] == 2:
                torch.cuda._sleep(int(4e9))
                threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return got

    recv.load_bucket = wrapped


def _engine(layouts, conn, replay: bool, corrupt: str | None, die_at: int | None = None):
    try:
        dev = torch.device("cuda", 0)
        params = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device=dev) for s in MODEL}

        def load_fn(items):
            for name, t in items:
                params[name].copy_(t)
                if name == corrupt:
                    params[name].view(-1)[7] += 1   # a load that silently changes one value

        recv = WeightReceiver(layouts, dev, load_fn, lambda names: checksums(params[n] for n in names),
                              LoadReplay(lambda: params) if replay else None)
        if die_at is not None:
            _die_with_a_load_queued(recv, die_at)
        handles, timeout_s = conn.recv()
        recv.open("ipc", {}, timeout_s)
        conn.send(("ok", recv.connect(handles)))
        while True:
            msg = conn.recv()
            if msg == "stop":
                return
            try:
                sums, timings = recv.receive(msg)
            except WeightSyncError as e:
                conn.send(("refused", str(e)))
                continue
            conn.send(("ok", (sums, {n: p.cpu() for n, p in params.items()}, timings)))
    except BaseException as e:
        conn.send(("error", repr(e)))


def _start(replay=True, corrupt=None, die_at=None):
    layouts = plan_buckets(MODEL, BUCKET)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine, args=(layouts, child, replay, corrupt, die_at), daemon=True)
    proc.start()
    sender = WeightSender(layouts, torch.device("cuda", 0), ipc_spec("E"), timeout_s=CHILD_TIMEOUT_S)
    parent.send((sender.offers()["ipc"], CHILD_TIMEOUT_S))
    assert parent.poll(CHILD_TIMEOUT_S), "the engine process did not start"
    status, box = parent.recv()
    assert status == "ok", box
    sender.accept("ipc", "E", box)
    return layouts, sender, parent, proc


def _sync(sender, parent, sync_id, values):
    parent.send(sync_id)
    res = sender.send(iter(list(values.items())), sync_id, sync_id=sync_id)
    assert parent.poll(CHILD_TIMEOUT_S), f"the engine did not answer sync {sync_id}"
    return res, parent.recv()


def test_device_and_host_handover_alternate_and_every_sync_is_exact():
    os.environ.pop("RLHF_ORCH_SYNC_HANDOVER", None)
    layouts, sender, parent, proc = _start()
    try:
        assert len(layouts) >= 24 and sender.gpu_handover
        for sync_id in range(1, 9):   # 1: the loader records the plans; then replay; hand-over mode alternates
            sender.gpu_handover = sync_id % 3 != 0
            values = _values(sync_id)
            res, (status, answer) = _sync(sender, parent, sync_id, values)
            assert status == "ok", answer
            sums, params, timings = answer
            want = checksums(values[s.name] for s in MODEL)
            assert res.checksums == want and sums == want, f"sync {sync_id}"
            assert timings["on_device"] == float(sender.gpu_handover), f"sync {sync_id}: {timings}"
            for name, t in values.items():
                assert_bit_equal(params[name], t.cpu(), f"{name} after sync {sync_id}")
        parent.send("stop")
    finally:
        stop_children([proc])


def test_a_corrupt_load_is_refused_at_the_end_of_a_device_handover():
    layouts, sender, parent, proc = _start(replay=False, corrupt="layers.5.w")
    try:
        assert sender.gpu_handover
        # The engine compares every tensor once, after the trainer's final checksums (which the sender publishes
        # after its last pack), so the sender has returned by then and the engine refuses the sync.
        _, (status, answer) = _sync(sender, parent, 1, _values(1))
        assert status == "refused" and "layers.5.w" in answer, answer
        parent.send("stop")
    finally:
        stop_children([proc])


def test_an_engine_killed_with_a_load_queued_stops_the_sync_and_leaves_the_trainer_working():
    """The hand-over's fault case (bench/device/probe_ipc_event_kill.py): a stream that waited on the event of a
    process killed before the GPU reached it would wait forever. The sender polls the engine's events from the host
    instead, so it sees the engine's process gone, raises, and its own stream and context still work."""
    layouts, sender, parent, proc = _start(die_at=6)
    try:
        res, (status, answer) = _sync(sender, parent, 1, _values(1))
        assert status == "ok", answer
        parent.send(2)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="gone"):
            sender.send(iter(list(_values(2).items())), 2, sync_id=2)
        assert time.monotonic() - t0 < 20, "the sender took its deadline, not the engine's death, to stop"
        x = torch.ones(4, device="cuda")
        x += 1
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + 20
        while not done.query():
            assert time.monotonic() < deadline, "the trainer's stream hangs after the engine died"
            time.sleep(0.01)
        assert x.sum().item() == 8
    finally:
        stop_children([proc])
