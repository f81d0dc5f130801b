"""A weight transport added from one module: its two sides and one line in TRANSPORTS, nothing else.

The transport here ("loop") hands buckets between threads of this process: the sender's offer names its ring
buffers, each receiver answers with its inbox, the sender posts (slot, bucket, its checksums) there and waits for the
receiver's acknowledgement before it refills the slot. Everything around it is the product's, unchanged: the plan's
specs (`setup_specs`), the handshake (open, offer / connect, accept), WeightSender's ring, packing and checksums, and
WeightReceiver's loads and comparison with the trainer's checksums.
"""
import itertools
import queue
import threading
import time

import pytest
import torch

from rlhf_orch.errors import WeightSyncError
from rlhf_orch.weight_sync import transports
from rlhf_orch.weight_sync.buckets import checksums, plan_buckets
from rlhf_orch.weight_sync.mailbox import SLOTS
from rlhf_orch.weight_sync.plan import EngineRoute, feeds
from rlhf_orch.weight_sync.receiver import WeightReceiver
from rlhf_orch.weight_sync.sender import WeightSender
from rlhf_orch.weight_sync.transport import ReceiveSide, SendSide
from weight_sync_helpers import CPU, assert_bit_equal, spec

MODEL = [spec("a", "float32", 40), spec("b", "float32", 8, 8), spec("c", "float32", 70), spec("d", "float32", 3)]
_BOARD: dict[int, object] = {}   # what an offer or an answer names (in-process: the object itself)
_ids = itertools.count()


def _post(obj) -> int:
    key = next(_ids)
    _BOARD[key] = obj
    return key


class LoopSend(SendSide):
    name = "loop"
    peers_read_buffers = True   # the receivers read the sender's buffers themselves

    @classmethod
    def specs(cls, routes, facts):
        return {rank: {"engines": engines} for rank, engines in feeds(routes).items()}, {r.engine: {} for r in routes}

    @classmethod
    def open(cls, spec, bufs, device, verify, timeout_s):
        return cls(spec["engines"], [b for _, b in bufs], timeout_s)

    def __init__(self, engines, bufs, timeout_s):
        self.engines, self.bufs, self.timeout_s = list(engines), bufs, timeout_s
        self.inboxes: dict[str, "LoopReceive"] = {}
        self.pending = [[] for _ in range(SLOTS)]

    def offer(self):
        return _post(self.bufs)

    def accept(self, engine, answer):
        self.inboxes[engine] = _BOARD.pop(answer)

    def begin(self, sync_id, check, deadline, on_device):
        missing = set(self.engines) - set(self.inboxes)
        if missing:
            raise WeightSyncError(f"loop engines {sorted(missing)} never connected")
        self.pending = [[] for _ in range(SLOTS)]

    def post(self, slot, layout, first, sums):
        for rx in self.inboxes.values():
            rx.inbox.put((slot, layout.index, first, list(sums)))
            self.pending[slot].append(rx)

    def drain(self, slot):
        for rx in self.pending[slot]:
            if rx.acks.get(timeout=self.timeout_s) == "failed":
                raise WeightSyncError("a loop receiver gave up on the sync")
        self.pending[slot] = []


class LoopReceive(ReceiveSide):
    name = "loop"

    @classmethod
    def open(cls, spec, rx, timeout_s):
        return cls(timeout_s)

    def __init__(self, timeout_s):
        self.timeout_s, self.bufs = timeout_s, None
        self.inbox, self.acks = queue.Queue(), queue.Queue()

    def connect(self, offer):
        self.bufs = _BOARD[offer]   # every receiver of the rank connects with the same offer
        return _post(self)

    def receive(self, rx, sync_id, verify):
        t0, sums = time.perf_counter(), []
        try:
            for k, layout in enumerate(rx.layouts):
                slot, index, first, want = self.inbox.get(timeout=self.timeout_s)
                assert index == k
                got = rx.load_bucket(layout, self.bufs[slot], verify)
                if verify:
                    rx.compare(got, want, first, "loop")
                self.acks.put(k)
                sums.extend(got)
        except BaseException:
            self.acks.put("failed")   # the sender stops waiting for us now, as ipc's mailbox tells it
            raise
        return sums, {"total_s": time.perf_counter() - t0}


def _receiver(layouts, corrupt=None):
    params = {s.name: torch.zeros(s.shape) for s in MODEL}

    def load(named):
        for name, t in named:
            params[name].copy_(t)
            if name == corrupt:
                params[name].view(-1)[0] += 1.0   # a load that changes one value

    return params, WeightReceiver(layouts, CPU, load, lambda names: checksums(params[n] for n in names))


def _connected(monkeypatch, names, corrupt=None):
    """The coordinator's part for a transport it has never heard of: specs from the plan's routes, then rounds 1-3."""
    monkeypatch.setitem(transports.TRANSPORTS, "loop", (LoopSend, LoopReceive))   # its one line in the table
    layouts = plan_buckets(MODEL, 256)
    assert len(layouts) > SLOTS   # the ring wraps: a slot is refilled only after its acknowledgements
    routes = {e: EngineRoute(e, "loop", 0) for e in names}
    specs = transports.setup_specs(routes, "gloo", True, {e: True for e in names},
                                   address_of=lambda rank: pytest.fail("loop has no rendezvous"))
    assert specs.senders == {0: {"loop": {"engines": list(names)}}} and specs.held == set()
    sender = WeightSender(layouts, CPU, specs.senders[0], timeout_s=10)
    engines = {e: _receiver(layouts, corrupt) for e in names}
    offers = sender.offers()
    for e, (_, rx) in engines.items():
        rx.open(*specs.receivers[e], 10)
        sender.accept("loop", e, rx.connect(offers[specs.receivers[e][0]]))
    return sender, engines


def _sync(sender, engines, values, sync_id, got=None):
    got = {} if got is None else got

    def take(e, rx):
        try:
            got[e] = rx.receive(sync_id, True)[0]
        except WeightSyncError as err:
            got[e] = err

    threads = [threading.Thread(target=take, args=(e, rx)) for e, (_, rx) in engines.items()]
    for t in threads:
        t.start()
    try:
        return sender.send(iter([(s.name, values[s.name]) for s in MODEL]), sync_id, sync_id=sync_id), got
    finally:
        for t in threads:
            t.join(10)


def _values(seed):
    return {s.name: torch.randn(s.shape, generator=torch.Generator().manual_seed(seed)) for s in MODEL}


def test_a_transport_from_one_module_runs_the_handshake_and_verified_syncs(monkeypatch):
    sender, engines = _connected(monkeypatch, ["A", "B"])
    for sync_id in (1, 2):
        values = _values(sync_id)
        sent, got = _sync(sender, engines, values, sync_id)
        assert got["A"] == got["B"] == sent.checksums == checksums(values[s.name] for s in MODEL)
        for params, _ in engines.values():
            for s in MODEL:
                assert_bit_equal(params[s.name], values[s.name], s.name)


def test_a_mangled_load_over_the_new_transport_is_refused_and_the_sender_stops(monkeypatch):
    sender, engines = _connected(monkeypatch, ["B"], corrupt="c")
    t0, got = time.monotonic(), {}
    with pytest.raises(WeightSyncError, match="gave up"):
        _sync(sender, engines, _values(1), 1, got)
    assert time.monotonic() - t0 < 5   # told by the receiver, not at its 10 s deadline
    err = got["B"]
    assert isinstance(err, WeightSyncError) and "differ from the trainer's" in str(err) and "'c'" in str(err)
