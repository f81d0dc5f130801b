"""A shared-memory mailbox between a trainer rank and one colocated engine: the `ipc` sync without an RPC per bucket.

The sender packs bucket k into ring slot k % SLOTS of its own device buffers (whose IPC handles the receiver opened
once, at setup). Before this module, each bucket then cost a Ray call to the engine actor plus a call into the
engine's worker (~1-2 ms each way), so a sync of 64 buckets paid ~100 ms of round trips for ~10 ms of copying.
Now the receiver runs one long call per sync that loops over the buckets, and the two sides hand buckets over
through a few int64 words in host shared memory (a small file in /dev/shm that both processes map):

    ready[slot]  <- sender: the sequence number of the bucket now in `slot` (its copies are complete)
    done[slot]   <- receiver: the sequence number it finished loading from `slot` (the slot may be refilled)
    sums[i]      <- sender: its checksum of tensor i, written before `ready`, so the receiver verifies each
                    bucket itself and an engine resumes only with verified weights
    failed       <- receiver: non-zero when it gave up (the sender stops waiting at once, not at its deadline)
    pid, sender_pid <- each side's process id: a side whose peer process is gone stops waiting at once

Sequence numbers are `sync_id * 2**20 + bucket + 1`, so a word left over from an earlier sync never matches.
Waiting spins briefly, then sleeps in short steps: a hand-over costs microseconds, not a round trip. Stores of
aligned int64 words are atomic on the hosts we run on, and the writer stores `sums` before `ready`, which x86
keeps in order. The file is a plain mapping, not torch's shared-memory sharing: with that, the creating process
waited at exit until every process that mapped its tensor let go (30 s and more, seen in the benchmark). The
receiver unlinks the file once the sender has mapped it (at its first sync, or when it closes); mappings stay valid.

GPU hand-over (CUDA, both sides with events; the sender chooses per sync and writes `mode` before bucket 0): the
words above then say only that a side has *queued* its work, and each side's CUDA event per slot says when that
work is done on the device. The sender records its event for `slot` after queueing the pack and stores `ready`; the
receiver waits (`wait_event`) until that event has completed, queues the load, records its own event for `slot`
and stores `done`; before refilling `slot` the sender waits until the receiver's event has completed. Neither host
waits for its *own* GPU per bucket, so each keeps its next bucket queued while the other process's kernels run (on
a shared GPU the per-bucket host syncs left the device idle between them). The events are polled from the host,
never waited on by a stream: a stream that waits on the event of a process that is killed first waits forever
(bench/device/probe_ipc_event_kill.py), while a host that polls sees the peer gone (its pid, below) and raises.
Checksums are then kept on the device and compared once per sync: the sender stores every tensor's sum and then
`final` (the sync's last sequence number) after its last pack, and the receiver compares them with its own before it
returns. Each side writes its events' IPC handles here (`put_events`), so no other channel changes.
This module moves no tensor data and knows nothing of engines or Ray.
"""
from __future__ import annotations

import os
import tempfile
import time
import uuid

import numpy as np

from rlhf_orch.errors import WeightSyncError

# Ring depth: buckets the sender may have handed over and not yet had back. 3, not double buffering: colocated
# 8B-shaped syncs into vLLM 30.8-32.6 -> 27.9 ms, 1B 6.2 -> 5.5 ms on one H200; 4 and 8 gained nothing more
# (bench/RESULTS.md, 2026-11-26). Costs one more bucket of the trainer's GPU memory. Both sides must agree, so it
# is read once per process from the environment, which engines inherit from the driver; RLHF_ORCH_SYNC_SLOTS is
# for re-running that benchmark (a receiver given another count of buffers refuses them, naming both).
SLOTS = int(os.environ.get("RLHF_ORCH_SYNC_SLOTS", "3"))
_FAILED, _PID, _SPID, _MODE, _FINAL, _READY = 0, 1, 2, 3, 4, 5
_DONE = _READY + SLOTS
_EVENT_WORDS = 8                        # a cudaIpcEventHandle_t is 64 bytes
_EV_SENDER = _DONE + SLOTS              # the sender's events, one per slot ("packed")
_EV_RECEIVER = _EV_SENDER + SLOTS * _EVENT_WORDS    # the receiver's ("loaded")
_SUMS = _EV_RECEIVER + SLOTS * _EVENT_WORDS
HOST, DEVICE = 0, 1                     # hand-over modes (`mode` word)


PREFIX = "rlhf_orch_mailbox_"
ORPHAN_AGE_S = 600.0   # a file is unlinked seconds after it is made (at the sender's attach); older ones are leftovers


def remove_orphans(root: str, min_age_s: float = ORPHAN_AGE_S) -> list[str]:
    """Unlink the mailbox files of receivers that died before their sender attached (a SIGKILLed engine or trainer
    leaves its file: about 190 had piled up in this machine's /dev/shm over days of fault tests). Only files whose
    creator's process is gone and that are older than `min_age_s`: a process in another pid namespace sharing
    /dev/shm looks dead from here, but its file is unlinked long before that age. Returns the names removed."""
    gone, now = [], time.time()
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return gone
    for name in names:
        pid = name[len(PREFIX):].split("_", 1)[0]
        path = os.path.join(root, name)
        try:
            if not pid.isdigit() or _alive(int(pid)) or now - os.stat(path).st_mtime < min_age_s:
                continue
            os.unlink(path)
            gone.append(name)
        except OSError:   # another sweeper got it first, or not ours to remove
            continue
    return gone


def seq_of(sync_id: int, bucket: int) -> int:
    return sync_id * (1 << 20) + bucket + 1


class Mailbox:
    """One sender -> one receiver. The receiver creates it (`Mailbox.create`) and hands `handle()` to the sender."""

    def __init__(self, path: str, words: np.ndarray, owner: bool):
        self.path, self.w, self.owner = path, words, owner
        self.check = None   # set per sync by its side: raises to end every wait at once (an aborted sync, abort.py)

    @classmethod
    def create(cls, n_tensors: int) -> "Mailbox":
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        remove_orphans(root)
        path = os.path.join(root, f"{PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}")
        words = np.memmap(path, dtype=np.int64, mode="w+", shape=(_SUMS + n_tensors,))   # zero-filled
        words[_PID] = os.getpid()
        return cls(path, words, owner=True)

    def handle(self) -> bytes:
        return f"{self.path}|{self.w.shape[0]}".encode()

    @classmethod
    def attach(cls, handle: bytes) -> "Mailbox":
        """The sender's end: maps the receiver's words and records the sender's process id."""
        box = cls.observe(handle)
        box.w[_SPID] = os.getpid()
        return box

    @classmethod
    def observe(cls, handle: bytes) -> "Mailbox":
        """A third process's end (an engine's actor whose receiver runs in a child process): maps the words only to
        `fail()` a sync the receiver never started. Must be mapped before the receiver's first sync unlinks the file."""
        path, n = bytes(handle).decode().rsplit("|", 1)
        return cls(path, np.memmap(path, dtype=np.int64, mode="r+", shape=(int(n),)), owner=False)

    def unlink(self, only_if_attached: bool = False) -> None:
        """Remove the file (the receiver's end); both mappings stay valid. `only_if_attached`: not before the
        sender has mapped it (it records its pid when it does)."""
        if self.owner and not (only_if_attached and not int(self.w[_SPID])):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    # ---- GPU hand-over ----------------------------------------------------------------------------------
    def put_events(self, sender: bool, handles: list[bytes]) -> None:
        """Store one side's event handles (one per slot) for the other side to open."""
        if len(handles) != SLOTS:
            raise ValueError(f"{len(handles)} event handles for {SLOTS} slots")
        base = _EV_SENDER if sender else _EV_RECEIVER
        raw = np.frombuffer(b"".join(handles), dtype=np.int64)
        self.w[base:base + SLOTS * _EVENT_WORDS] = raw

    def events(self, of_sender: bool) -> list[bytes] | None:
        """The sender's (or the receiver's) event handles, or None where that side made none (a CPU side)."""
        base = _EV_SENDER if of_sender else _EV_RECEIVER
        raw = np.asarray(self.w[base:base + SLOTS * _EVENT_WORDS]).tobytes()
        if not any(raw):
            return None
        step = _EVENT_WORDS * 8
        return [raw[i * step:(i + 1) * step] for i in range(SLOTS)]

    def begin(self, mode: int) -> None:
        """Sender, before the sync's first `publish`: how this sync hands buckets over (HOST or DEVICE)."""
        self.w[_MODE] = mode

    def mode(self) -> int:
        return int(self.w[_MODE])

    def wait_event(self, event, deadline: float, what: str, sender: bool) -> None:
        """Poll the peer's CUDA event (anything with `query()`) until its latest record is done on the device; raises
        if the peer's process is gone or gave up (`sender`: we are the sender, the peer is the receiver)."""
        self._wait(event.query, deadline, what, peer=_PID if sender else _SPID)

    def publish_final(self, seq: int, sums: list[int]) -> None:
        """Sender, after the last bucket of a DEVICE sync: every tensor's checksum, then `final` = `seq`."""
        if sums:
            self.w[_SUMS:_SUMS + len(sums)] = sums
        self.w[_FINAL] = seq

    def wait_final(self, seq: int, deadline: float, what: str) -> None:
        self._wait(lambda: int(self.w[_FINAL]) == seq, deadline, what, peer=_SPID)

    # ---- sender ---------------------------------------------------------------------------------------
    def publish(self, slot: int, seq: int, first: int, sums: list[int]) -> None:
        """Bucket `seq` is complete in `slot`; its tensors' checksums start at tensor index `first`."""
        if sums:
            self.w[_SUMS + first:_SUMS + first + len(sums)] = sums
        self.w[_READY + slot] = seq

    def wait_done(self, slot: int, seq: int, deadline: float, what: str) -> None:
        self._wait(lambda: int(self.w[_DONE + slot]) >= seq, deadline, what, peer=_PID)

    # ---- receiver -------------------------------------------------------------------------------------
    def wait_ready(self, slot: int, seq: int, deadline: float, what: str) -> None:
        self._wait(lambda: int(self.w[_READY + slot]) == seq, deadline, what, peer=_SPID)

    def expected(self, first: int, count: int) -> list[int]:
        return self.w[_SUMS + first:_SUMS + first + count].tolist()

    def ack(self, slot: int, seq: int) -> None:
        self.w[_DONE + slot] = seq

    def fail(self) -> None:
        self.w[_FAILED] = 1

    def reset_failure(self) -> None:
        self.w[_FAILED] = 0

    # ---- both -----------------------------------------------------------------------------------------
    def _wait(self, ready, deadline: float, what: str, peer: int) -> None:
        spins = 0
        while not ready():
            if peer == _PID and int(self.w[_FAILED]):
                raise WeightSyncError(f"{what}: the engine gave up on this sync (see its log)")
            if spins % 256 == 255:
                if self.check is not None:
                    self.check()
                if int(self.w[peer]) and not _alive(int(self.w[peer])):
                    side = "engine" if peer == _PID else "trainer rank"
                    raise WeightSyncError(f"{what}: the {side}'s process {int(self.w[peer])} is gone")
            if time.monotonic() > deadline:
                raise WeightSyncError(f"{what}: no hand-over within the sync deadline (weight_sync.timeout_s)")
            spins += 1
            # ~200 µs of spinning covers a normal hand-over; after that, sleep in 50 µs steps to free the core.
            if spins > 2000:
                time.sleep(5e-5)


def _alive(pid: int) -> bool:
    """False once `pid` has exited, including as a zombie its parent has not reaped yet (Linux /proc)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True
