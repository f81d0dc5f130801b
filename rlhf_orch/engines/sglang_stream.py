"""A sync into a single-GPU SGLang engine in one call: our WeightReceiver runs inside SGLang's scheduler process.

SGLang's own paths take one call per bucket (`update_weights_from_tensor` colocated, `update_weights_from_distributed`
over broadcast): a round trip through the tokenizer manager and the scheduler (~1.5 ms each), then SGLang's
`load_weights` in Python, then our checksum of what it received, bucket after bucket. This module gives a
single-GPU SGLang engine what our vLLM workers have (vllm_worker.py), over any transport (weight_sync/transport.py):
- at setup, one control request (`OPEN`) makes a `WeightReceiver` in the scheduler and opens its side of the
  transport (broadcast: joins our group, whose rank 0 is the trainer's and whose checksums follow the last bucket), and
  one (`CONNECT`) connects it with the trainer rank's offer (ipc: it opens the rank's ring buffers once and makes the
  shared-memory mailbox, weight_sync/mailbox.py, which is its answer);
- per sync, one request (`RECEIVE`) runs the receiver's `receive` there (ipc_stream.py, broadcast.py).
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

import base64
import json
import logging
import os
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from rlhf_orch.engines.base import Capabilities
from rlhf_orch.errors import EngineError
from rlhf_orch.weight_sync.abort import AbortFlag
from rlhf_orch.weight_sync.receiver import ReceivedSums, WeightReceiver
from rlhf_orch.weight_sync.replay import LoadReplay
from rlhf_orch.weight_sync.transports import sides

logger = logging.getLogger(__name__)

HOOK = "rlhf_orch.engines.sglang.rlhf_sglang_hook"     # our custom_weight_loader (runs in the schedulers)
OPEN = "rlhf_orch.open:"
CONNECT = "rlhf_orch.connect:"
RECEIVE = "rlhf_orch.receive:"


def write_report(folder: str, name: str, rec: dict) -> None:
    """Replace `folder/name.json` atomically (the actor polls it; see SGLangEngine._reports)."""
    path = os.path.join(folder, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f)
    os.replace(path + ".tmp", path)


# ---- inside the SGLang scheduler (called by the hook with the model and one request name) -----------------
def stream_request(model, name: str) -> bool:
    """Serve `name` if it is a stream request (False otherwise); the result or the error goes to a report."""
    for prefix, serve in ((OPEN, _open), (CONNECT, _connect), (RECEIVE, _receive)):
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


def _args(cfg: dict) -> Any:
    """The request's pickled arguments (layouts and handles are too much for a request's name); the file goes."""
    with open(cfg["args"], "rb") as f:
        args = pickle.load(f)
    os.unlink(cfg["args"])
    return args


def _open(model, state: dict, cfg: dict) -> dict:
    """A new receiver for this scheduler's model, its side of the transport opened. A re-plan lets go of the old
    receiver's buffers or group first."""
    layouts, transport, spec = _args(cfg)
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
    secs = rec.open(transport, spec, float(cfg["timeout_s"]))
    state["stream"] = rec
    return {"open_s": secs}


def _current(state: dict) -> WeightReceiver:
    rec = state.get("stream")
    if rec is None:
        raise RuntimeError("no receiver in this scheduler: setup_receiver first")
    return rec


def _connect(model, state: dict, cfg: dict) -> dict:
    answer = _current(state).connect(_args(cfg))
    return {"answer": base64.b64encode(pickle.dumps(answer)).decode()}


def _receive(model, state: dict, cfg: dict) -> dict:
    rec = _current(state)
    rec.set_replay(bool(cfg["replay"]))
    sums, m = rec.receive(int(cfg["sync_id"]), bool(cfg["verify"]))   # an aborted broadcast leaves the group
    return {"sums": sums, **m}


# ---- in the engine's actor (mixed into SGLangEngine) ---------------------------------------------------
class SchedulerStream:
    """SGLangEngine's side of the stream: `open_stream` / `connect_stream` / `receive_stream` (setup's handshake and a
    sync, over whichever transport), `abort_stream`, `set_replay`, and the abort flag (`keep_abort_flag`) the
    scheduler's receiver polls."""

    _stream_seq = 0
    _transport: str | None = None       # the transport our receiver in the scheduler opened (None: not opened there)
    _abort_side: Callable[[], None] | None = None   # fails the sync from here while the scheduler is busy receiving
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

    def open_stream(self, transport: str, spec: dict, timeout_s: float) -> float:
        """Have the scheduler make its receiver and open its side of `transport` (returns seconds; a broadcast group
        blocks until every member joined and warmed up, as the trainer's side does)."""
        self._transport, self._abort_side = None, None
        rec = self._stream_call(f"opening the {transport} side of the weight sync", OPEN,
                                args=self._args_file("open", (list(self._layouts), transport, dict(spec))),
                                timeout_s=float(timeout_s), replay=self._replay, abort=self._abort)
        self._transport = transport
        logger.info("engine %s: opened its %s side of the weight sync in its scheduler%s", self.name, transport,
                    f" as rank {spec['rank']}" if "rank" in spec else "")
        return float(rec["open_s"])

    def connect_stream(self, offer: Any) -> Any:
        """Setup's second round, in the scheduler: the trainer rank's offer -> our answer (ipc: the mailbox)."""
        self._need_weights_awake("connect")
        if self._transport is None:
            raise EngineError(f"engine {self.name}: connect before setup_receiver opened a transport in the scheduler")
        rec = self._stream_call(f"connecting its {self._transport} side", CONNECT, args=self._args_file("connect", offer))
        answer = pickle.loads(base64.b64decode(rec["answer"]))
        # Before the first sync unlinks what it answered with: abort_stream fails the sync through it from here.
        self._abort_side = None if answer is None else sides(self._transport)[1].watch(answer)
        return answer

    def receive_stream(self, sync_id: int, verify: bool = True) -> tuple[list[int], dict[str, float]]:
        """One sync, every bucket checked in the scheduler against the trainer's checksums."""
        self._need_weights_awake("receive")
        if self._transport is None:
            raise EngineError(f"engine {self.name}: no receiver in the scheduler: setup_receiver first")
        rec = self._stream_call(f"sync {sync_id}", RECEIVE, sync_id=int(sync_id), verify=bool(verify),
                                replay=self._replay)
        sums = [int(x) for x in rec["sums"]]
        if verify:
            self._sums.update(zip((n for lay in self._layouts for n in lay.names), sums))
        return sums, {k: float(v) for k, v in rec.items() if k not in ("sums", "seq")}

    def _args_file(self, what: str, args: Any) -> str:
        """Arguments for the scheduler, in a file: handles are bytes and layouts dataclasses, too much for the
        request's name."""
        if self.tensor_parallel_size != 1:
            raise EngineError(f"engine {self.name}: a sync in one call needs a single-GPU engine "
                              "(tensor_parallel_size 1)")
        path = os.path.join(self._dir, f"{what}_args_{self._stream_seq + 1}.pkl")
        with open(path, "wb") as f:
            pickle.dump(args, f)
        return path

    def set_replay(self, enabled: bool) -> None:
        """Load replay on or off for later syncs (the benchmark's --compare-loads)."""
        self._replay = bool(enabled)

    def abort_stream(self) -> None:
        """Tell the trainer rank this sync will not be taken (it stops waiting at once, where it waits on our answer;
        a broadcast sender hears of it from the coordinator)."""
        if self._abort_side is not None:
            self._abort_side()

    def _stream_call(self, what: str, prefix: str, **cfg: Any) -> dict:
        self._stream_seq += 1
        cfg.update(dir=self._dir, seq=self._stream_seq)
        self._call(what, self.engine.update_weights_from_tensor, [(prefix + json.dumps(cfg), torch.empty(0))],
                   load_format=HOOK, flush_cache=False)
        rec = self._reports(self._stream_seq, prefix="stream")[0]
        if "error" in rec:
            raise EngineError(f"engine {self.name}: {what} failed in SGLang's scheduler: {rec['error']}")
        return rec
