"""Ending a weight sync on every surviving side at once when one member dies: `AbortFlag` and `SyncAborted`.

Why: a sync's members wait for each other (a receiver for the next broadcast bucket, a sender for an engine's
acknowledgement). When one of them dies, the others used to wait until the sync deadline, which grows with the model
(60 s + 10 s per GB: about 25 minutes for a 70B policy in bf16), with every engine idle. Now whoever learns of the
death first, in practice the coordinator (the dead member's Ray call fails), writes the sync's number into each
survivor's flag, and the survivor's side, polling the flag in every wait it makes during a sync (mailbox hand-overs,
broadcast completions, the device sync at the end), raises `SyncAborted` within milliseconds.

The flag is one int64 word in a small shared-memory file, so the actor that owns it (a rollout or trainer actor,
answering the coordinator's `abort_sync` on another thread) and the process that runs the receiver (the actor
itself, a vLLM worker it started, or a single-GPU SGLang engine's scheduler: engines/sglang_stream.py) see the same
word. SGLang's own broadcast receive (tensor-parallel SGLang engines) reads no flag. The word holds the highest
aborted sync number: an abort that arrives before a side starts that sync still ends it at its first wait, and later
syncs are not affected. Sync number 0 (benchmarks and tests that number no syncs) is never aborted.
This module knows nothing of Ray, engines or transports.
"""
from __future__ import annotations

import os
import tempfile
import uuid

import numpy as np

from rlhf_orch.errors import WeightSyncError


class SyncAborted(WeightSyncError):
    """This side stopped taking part in a sync because another member failed (not a timeout, not a mismatch)."""


class AbortFlag:
    def __init__(self, path: str, word: np.ndarray, owner: bool):
        self.path, self.word, self.owner = path, word, owner

    @classmethod
    def create(cls) -> "AbortFlag":
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(root, f"rlhf_orch_abort_{os.getpid()}_{uuid.uuid4().hex[:12]}")
        return cls(path, np.memmap(path, dtype=np.int64, mode="w+", shape=(1,)), owner=True)

    @classmethod
    def private(cls) -> "AbortFlag":
        """A flag only this process maps (a trainer rank's: its sender runs here): its file is removed at once."""
        flag = cls.create()
        flag.unlink()
        return flag

    @classmethod
    def attach(cls, handle: str) -> "AbortFlag":
        """Another process's view of the flag (a vLLM worker's receiver); map it before the owner unlinks it."""
        return cls(handle, np.memmap(handle, dtype=np.int64, mode="r+", shape=(1,)), owner=False)

    def handle(self) -> str:
        return self.path

    def abort(self, sync_id: int) -> None:
        if sync_id > int(self.word[0]):
            self.word[0] = sync_id

    def aborted(self, sync_id: int) -> bool:
        return sync_id > 0 and int(self.word[0]) >= sync_id

    def checker(self, sync_id: int, who: str):
        """A callable for the waits of sync `sync_id`: raises SyncAborted once that sync is aborted."""
        def check() -> None:
            if self.aborted(sync_id):
                raise SyncAborted(f"{who}: sync {sync_id} aborted (another member of the sync failed)")
        return check

    def unlink(self) -> None:
        """Remove the file once every process that needs it has mapped it; the mappings stay valid."""
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def checker_for(flag: AbortFlag | None, sync_id: int, who: str):
    """`flag.checker(sync_id, who)`, or None where nothing can abort the sync (no flag, or a sync numbered 0): the
    waits then block as before."""
    return flag.checker(sync_id, who) if flag is not None and sync_id else None
