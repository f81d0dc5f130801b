"""A sync into a single-GPU SGLang engine in one call: our WeightReceiver runs inside SGLang's scheduler process.

SGLang's own paths take one call per bucket (`update_weights_from_tensor` colocated, `update_weights_from_distributed`
over broadcast): a round trip through the tokenizer manager and the scheduler (~1.5 ms each), then SGLang's
`load_weights` in Python, then our checksum of what it received, bucket after bucket. This module gives a
single-GPU SGLang engine what our vLLM workers have (vllm_worker.py), on both transports:
- colocated (ipc): at setup, one control request (`CONNECT`) makes a `WeightReceiver` in the scheduler that opens the
  trainer rank's ring buffers once and creates the shared-memory mailbox (weight_sync/mailbox.py); per sync, one
  request (`STREAM`) runs the receiver's `receive` there (weight_sync/ipc_stream.py);
- disaggregated (broadcast): at setup, one request (`JOIN`) makes the receiver there and joins our broadcast group
  (rank 0 is the trainer's `BroadcastGroup`; the group's checksums follow the last bucket); per sync, one request
  (`BCAST`) runs `receive` there (weight_sync/broadcast.py): bucket k + 1's receive is posted before bucket k loads.
Either way each bucket is loaded by SGLang's `load_weights` at the first sync and by the recorded copies afterwards
(weight_sync/replay.py), every tensor is compared with the trainer's checksum before the call returns, and the
receiver polls the rollout actor's abort flag (weight_sync/abort.py), so a sync another member abandons ends here at
once instead of at the group's timeout.
Control requests travel as the name of one empty tensor through `update_weights_from_tensor` with our
`custom_weight_loader` (engines/sglang.py's hook), the one entry SGLang 0.5.17 gives into the scheduler
(model_runner_components/weight_updater.py:346); results come back as a JSON report file, as the hook's other
requests do. An exception must never leave the hook: SGLang does not catch it there, and the scheduler, with
the whole engine, would die. So every error is reported and raised on the actor's side as an EngineError.

It does not serve tensor-parallel engines: those take SGLang's own per-bucket broadcast calls (engines/sglang.py). It imports
no SGLang.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from rlhf_orch.engines.base import Capabilities
from rlhf_orch.errors import EngineError
from rlhf_orch.weight_sync.abort import AbortFlag
from rlhf_orch.weight_sync.mailbox import Mailbox
from rlhf_orch.weight_sync.receiver import ReceivedSums, WeightReceiver
from rlhf_orch.weight_sync.replay import LoadReplay

logger = logging.getLogger(__name__)

HOOK = "rlhf_orch.engines.sglang.rlhf_sglang_hook"     # our custom_weight_loader (runs in the schedulers)
CONNECT = "rlhf_orch.connect:"
STREAM = "rlhf_orch.stream:"
JOIN = "rlhf_orch.join:"
BCAST = "rlhf_orch.bcast:"


def write_report(folder: str, name: str, rec: dict) -> None:
    """Replace `folder/name.json` atomically (the actor polls it; see SGLangEngine._reports)."""
    path = os.path.join(folder, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f)
    os.replace(path + ".tmp", path)


# ---- inside the SGLang scheduler (called by the hook with the model and one request name) -----------------
def stream_request(model, name: str) -> bool:
    """Serve `name` if it is a stream request (False otherwise); the result or the error goes to a report."""
    for prefix, serve in ((CONNECT, _connect), (STREAM, _stream), (JOIN, _join), (BCAST, _bcast)):
        if name.startswith(prefix):
            cfg = json.loads(name[len(prefix):])
            state = getattr(model, "_rlhf_state", None) or {}
            try:
                if not state:
                    raise RuntimeError("the weight-load hook is not installed in this scheduler")
                rec = serve(model, state, cfg)
            except Exception as e:   # never raise here (see the module doc)
                logger.exception("rlhf_orch stream request %s failed", prefix.rstrip(":"))
                rec = {"error": f"{type(e).__name__}: {e}"}
            write_report(cfg["dir"], f"stream{state.get('rank', 0)}", {**rec, "seq": cfg["seq"]})
            return True
    return False


def _receiver(model, state: dict, cfg: dict) -> tuple[WeightReceiver, list]:
    """A new receiver for this scheduler's model, and the trainer's buffer handles (ipc; None over broadcast). A
    re-plan lets go of the old receiver's buffers or group first."""
    with open(cfg["args"], "rb") as f:
        layouts, handles = pickle.load(f)
    os.unlink(cfg["args"])
    old = state.pop("stream", None)
    if old is not None:   # a re-plan (an engine replaced beside this one): let go of the old trainer buffers or group
        old.close()
    params = dict(model.named_parameters())   # the same Parameter objects for the engine's life
    device = next(iter(params.values())).device
    received = ReceivedSums(state["orig"])    # SGLang's own load_weights, not our recording wrapper
    rec = WeightReceiver(layouts, device, received.load, received.checksums,
                         LoadReplay(lambda: params, bool(cfg["replay"])))
    abort = cfg.get("abort") or {}
    if abort.get("link") and state.get("abort_path") != abort["path"]:   # mapped once, through the actor's link
        state["abort"], state["abort_path"] = AbortFlag.attach(abort["link"]), abort["path"]
        Path(abort["link"]).unlink(missing_ok=True)
    rec.abort_flag = state.get("abort")   # the coordinator's abort_sync ends this sync's waits at once (#33)
    return rec, handles


def _connect(model, state: dict, cfg: dict) -> dict:
    rec, handles = _receiver(model, state, cfg)
    box = rec.connect_stream(handles, float(cfg["timeout_s"]))
    state["stream"], state["transport"] = rec, "ipc"
    return {"mailbox": box.decode()}


def _join(model, state: dict, cfg: dict) -> dict:
    rec, _ = _receiver(model, state, cfg)
    g = cfg["group"]
    secs = rec.join_group(g["backend"], g["host"], int(g["port"]), int(cfg["rank"]), int(g["world_size"]),
                          float(cfg["timeout_s"]), g.get("local_host"), expect_sums=True)
    state["stream"], state["transport"] = rec, "broadcast"
    return {"join_s": secs}


def _current(state: dict, transport: str) -> WeightReceiver:
    rec = state.get("stream")
    if rec is None or state.get("transport") != transport:
        first = "connect_stream" if transport == "ipc" else "setup_receiver with a broadcast group"
        raise RuntimeError(f"no {transport} stream in this scheduler: {first} first")
    return rec


def _stream(model, state: dict, cfg: dict) -> dict:
    rec = _current(state, "ipc")
    rec.set_replay(bool(cfg["replay"]))
    sums, m = rec.receive(int(cfg["sync_id"]), bool(cfg["verify"]))
    return {"sums": sums, **m}


def _bcast(model, state: dict, cfg: dict) -> dict:
    rec = _current(state, "broadcast")
    rec.set_replay(bool(cfg["replay"]))
    sums, m = rec.receive(int(cfg["sync_id"]), bool(cfg["verify"]))   # an aborted one leaves the group
    return {"sums": sums, **m}


# ---- in the engine's actor (mixed into SGLangEngine) ---------------------------------------------------
class SchedulerStream:
    """SGLangEngine's side of the stream: `connect_stream` / `receive_stream` (ipc), `join_stream_group` /
    `receive_broadcast_stream` (broadcast), `abort_stream`, `set_replay`, and the abort flag (`keep_abort_flag`) the
    scheduler's receiver polls."""

    _stream_seq = 0
    _box: Mailbox | None = None
    _ipc_stream = False   # connect_stream made this engine's transport ipc (SGLangEngine.receive)
    _replay = True
    _abort: dict | None = None   # {"path": the rollout actor's flag, "link": a name of it the scheduler maps}

    generation = Capabilities()   # what its generate can do (the streaming kind: more)

    @property
    def capabilities(self) -> Capabilities:
        """A single-GPU engine takes a sync in one call over either transport (our receiver in its scheduler, which
        polls the rollout actor's abort flag, weight_sync/abort.py); a tensor-parallel one is fed bucket by bucket
        through SGLang's own calls, and its broadcast receive ends at its group's timeout or when rank 0 leaves."""
        one = self.tensor_parallel_size == 1
        return replace(self.generation, own_receivers=True,
                       checks_loads=frozenset({"ipc", "broadcast"}) if one else frozenset(), aborts_syncs=one)

    def keep_abort_flag(self, path: str) -> None:
        """At setup_receiver, before the rollout actor unlinks its flag file: a second name of the same shared memory,
        which the scheduler maps (and removes) when its receiver is made. A re-plan reuses the mapping (same path)."""
        link = None
        if os.path.exists(path):
            link = f"{path}.sglang"
            Path(link).unlink(missing_ok=True)
            os.link(path, link)
        self._abort = {"path": path, "link": link}

    def drop_abort_link(self) -> None:
        """Remove a link no scheduler took (a tensor-parallel engine makes no receiver there)."""
        link = (self._abort or {}).get("link")
        if link:
            Path(link).unlink(missing_ok=True)

    def connect_stream(self, handles, timeout_s: float) -> bytes:
        """Have the scheduler open the trainer rank's ring buffers; returns its mailbox's handle for the trainer."""
        self._need_weights_awake("connect_stream")
        rec = self._stream_call("connecting the ipc stream", CONNECT, args=self._args_file("stream", handles),
                                timeout_s=float(timeout_s), replay=self._replay, abort=self._abort)
        handle = rec["mailbox"].encode()
        self._box = Mailbox.observe(handle)   # before the first sync unlinks it: abort_stream writes through it
        self._ipc_stream = True
        return handle

    def join_stream_group(self, group: dict, rank: int, timeout_s: float) -> float:
        """Have the scheduler make its receiver and join our broadcast group as `rank` (returns seconds; blocks until
        every member joined and warmed up, as the trainer's side does)."""
        rec = self._stream_call("joining the weight-sync group", JOIN, args=self._args_file("join", None),
                                group=dict(group), rank=int(rank), timeout_s=float(timeout_s), replay=self._replay,
                                abort=self._abort)
        logger.info("engine %s: joined the weight-sync group as rank %d of %d (our receiver in its scheduler)",
                    self.name, rank, group["world_size"])
        return float(rec["join_s"])

    def receive_stream(self, sync_id: int, verify: bool = True) -> tuple[list[int], dict[str, float]]:
        """One ipc sync, every bucket checked in the scheduler against the trainer's checksums."""
        self._need_weights_awake("receive_stream")
        return self._synced(STREAM, sync_id, verify, ("load_s", "wait_s", "total_s", "on_device"))

    def receive_broadcast_stream(self, sync_id: int, verify: bool = True) -> tuple[list[int], dict[str, float]]:
        """One broadcast sync, received, loaded and checked in the scheduler (the trainer's checksums follow the last
        bucket)."""
        self._need_weights_awake("receive_broadcast")
        return self._synced(BCAST, sync_id, verify, ("load_s", "total_s"))

    def _synced(self, prefix: str, sync_id: int, verify: bool, keys: tuple) -> tuple[list[int], dict[str, float]]:
        rec = self._stream_call(f"sync {sync_id}", prefix, sync_id=int(sync_id), verify=bool(verify),
                                replay=self._replay)
        sums = [int(x) for x in rec["sums"]]
        if verify:
            self._sums.update(zip((n for lay in self._layouts for n in lay.names), sums))
        return sums, {k: float(rec.get(k, 0.0)) for k in keys}

    def _args_file(self, what: str, handles) -> str:
        """The layouts (and ipc handles) for the scheduler, in a file: handles are bytes and layouts dataclasses,
        too much for the request's name."""
        if self.tensor_parallel_size != 1:
            raise EngineError(f"engine {self.name}: a sync in one call needs a single-GPU engine "
                              "(tensor_parallel_size 1)")
        path = os.path.join(self._dir, f"{what}_args_{self._stream_seq + 1}.pkl")
        with open(path, "wb") as f:
            pickle.dump((list(self._layouts), None if handles is None else list(handles)), f)
        return path

    def set_replay(self, enabled: bool) -> None:
        """Load replay on or off for later syncs (the benchmark's --compare-loads)."""
        self._replay = bool(enabled)

    def abort_stream(self) -> None:
        """Tell the trainer rank this sync will not be taken (it stops waiting at once)."""
        if self._box is not None:
            self._box.fail()

    def _stream_call(self, what: str, prefix: str, **cfg: Any) -> dict:
        self._stream_seq += 1
        cfg.update(dir=self._dir, seq=self._stream_seq)
        self._call(what, self.engine.update_weights_from_tensor, [(prefix + json.dumps(cfg), torch.empty(0))],
                   load_format=HOOK, flush_cache=False)
        rec = self._reports(self._stream_seq, prefix="stream")[0]
        if "error" in rec:
            raise EngineError(f"engine {self.name}: {what} failed in SGLang's scheduler: {rec['error']}")
        return rec
