"""A colocated sync into SGLang in one call: our WeightReceiver runs inside SGLang's scheduler process.

SGLang's own colocated path is one `update_weights_from_tensor` call per bucket: a round trip through the
tokenizer manager and the scheduler (~1.5 ms each), then SGLang's `load_weights` in Python, then our checksum of
what it received. This module gives a single-GPU SGLang engine what our vLLM workers have (vllm_worker.py):
- at setup, one control request (`CONNECT`) makes a `WeightReceiver` in the scheduler that opens the trainer
  rank's ring buffers once and creates the shared-memory mailbox (weight_sync/mailbox.py);
- per sync, one control request (`STREAM`) runs `receive_stream` there: every bucket is taken through the
  mailbox, loaded by SGLang's `load_weights` at the first sync and by the recorded copies afterwards
  (weight_sync/replay.py), and each tensor is compared with the trainer's checksum before the call returns.
Control requests travel as the name of one empty tensor through `update_weights_from_tensor` with our
`custom_weight_loader` (engines/sglang.py's hook), the one entry SGLang 0.5.17 gives into the scheduler
(model_runner_components/weight_updater.py:346); results come back as a JSON report file, as the hook's other
requests do. An exception must never leave the hook: SGLang does not catch it there, and the scheduler, with
the whole engine, would die. So every error is reported and raised on the actor's side as an EngineError.

It does not serve tensor-parallel engines (a colocated engine is single-GPU, weight_sync/plan.py) nor broadcast
(SGLang receives that through its own `update_weights_from_distributed`, bucket by bucket). It imports no SGLang.
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


def write_report(folder: str, name: str, rec: dict) -> None:
    """Replace `folder/name.json` atomically (the actor polls it; see SGLangEngine._reports)."""
    path = os.path.join(folder, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f)
    os.replace(path + ".tmp", path)


# ---- inside the SGLang scheduler (called by the hook with the model and one request name) -----------------
def stream_request(model, name: str) -> bool:
    """Serve `name` if it is a stream request (False otherwise); the result or the error goes to a report."""
    for prefix, serve in ((CONNECT, _connect), (STREAM, _stream)):
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


def _connect(model, state: dict, cfg: dict) -> dict:
    with open(cfg["args"], "rb") as f:
        layouts, handles = pickle.load(f)
    os.unlink(cfg["args"])
    old = state.pop("stream", None)
    if old is not None:   # a re-plan (an engine replaced beside this one): let go of the old trainer buffers
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
    box = rec.connect_stream(handles, float(cfg["timeout_s"]))
    state["stream"] = rec
    return {"mailbox": box.decode()}


def _stream(model, state: dict, cfg: dict) -> dict:
    rec = state.get("stream")
    if rec is None:
        raise RuntimeError("no ipc stream in this scheduler: connect_stream first")
    rec.set_replay(bool(cfg["replay"]))
    sums, m = rec.receive_stream(int(cfg["sync_id"]), bool(cfg["verify"]))
    return {"sums": sums, **m}


# ---- in the engine's actor (mixed into SGLangEngine) ---------------------------------------------------
class ColocatedStream:
    """SGLangEngine's side of the stream: `connect_stream`, `receive_stream`, `abort_stream`, `set_replay`, and the
    abort flag (`keep_abort_flag`) the scheduler's receiver polls."""

    _stream_seq = 0
    _box: Mailbox | None = None
    _replay = True
    _abort: dict | None = None   # {"path": the rollout actor's flag, "link": a name of it the scheduler maps}

    generation = Capabilities()   # what its generate can do (the streaming kind: more)

    @property
    def capabilities(self) -> Capabilities:
        """A single-GPU engine takes a sync in one call over ipc (our stream's receiver in its scheduler, which polls
        the rollout actor's abort flag, weight_sync/abort.py); SGLang's own broadcast receive (and tensor parallel
        engines) is fed bucket by bucket and ends at its group's timeout or when rank 0 leaves the group."""
        one = self.tensor_parallel_size == 1
        return replace(self.generation, own_receivers=True, streams=frozenset({"ipc"}) if one else frozenset(),
                       aborts_syncs=one)

    def keep_abort_flag(self, path: str) -> None:
        """At setup_receiver, before the rollout actor unlinks its flag file: a second name of the same shared memory,
        which the scheduler maps (and removes) at connect_stream. A re-plan reuses the mapping (same path)."""
        link = None
        if os.path.exists(path):
            link = f"{path}.sglang"
            Path(link).unlink(missing_ok=True)
            os.link(path, link)
        self._abort = {"path": path, "link": link}

    def drop_abort_link(self) -> None:
        """Remove a link no scheduler took (a broadcast engine never connects a stream)."""
        link = (self._abort or {}).get("link")
        if link:
            Path(link).unlink(missing_ok=True)

    def connect_stream(self, handles, timeout_s: float) -> bytes:
        """Have the scheduler open the trainer rank's ring buffers; returns its mailbox's handle for the trainer."""
        self._need_weights_awake("connect_stream")
        if self.tensor_parallel_size != 1:
            raise EngineError(f"engine {self.name}: an ipc stream needs a single-GPU engine (tensor_parallel_size 1)")
        path = os.path.join(self._dir, f"stream_args_{self._stream_seq + 1}.pkl")
        with open(path, "wb") as f:   # handles are bytes, layouts dataclasses: a file, not the request's name
            pickle.dump((list(self._layouts), list(handles)), f)
        rec = self._stream_call("connecting the ipc stream", CONNECT, args=path, timeout_s=float(timeout_s),
                                replay=self._replay, abort=self._abort)
        handle = rec["mailbox"].encode()
        self._box = Mailbox.observe(handle)   # before the first sync unlinks it: abort_stream writes through it
        return handle

    def receive_stream(self, sync_id: int, verify: bool = True) -> tuple[list[int], dict[str, float]]:
        """One sync, every bucket checked in the scheduler against the trainer's checksums."""
        self._need_weights_awake("receive_stream")
        rec = self._stream_call(f"sync {sync_id}", STREAM, sync_id=int(sync_id), verify=bool(verify),
                                replay=self._replay)
        sums = [int(x) for x in rec["sums"]]
        if verify:
            self._sums.update(zip((n for lay in self._layouts for n in lay.names), sums))
        return sums, {k: float(rec.get(k, 0.0)) for k in ("load_s", "wait_s", "total_s", "on_device")}

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
