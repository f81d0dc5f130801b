"""The SGLang 0.5.17 rollout engine: an in-process `sglang.Engine` behind the RolloutEngine Protocol.

Why in-process `sglang.Engine` and not an HTTP server the actor owns: the Engine already runs the
scheduler (one process per TP rank) and detokenizer as children of the actor, and exposes every call we
need (generate from token ids, init_weights_update_group, update_weights_from_distributed/_tensor,
release/resume_memory_occupation, flush_cache) as blocking methods; a server would add an HTTP hop,
JSON/base64 round trips for every IPC payload and a port to guard, and nothing we use.

Generation is one `Engine.generate(input_ids=..., return_logprob=True)` call; each prompt is repeated
`n` times (n=1 per request) so outputs come back in request order. The sampled token's logprob is
`log(softmax(logits / T))` over the full vocabulary unless SGLANG_RETURN_ORIGINAL_LOGPROB is set
(srt/layers/sampler.py:189-227): the trainer's log_softmax(logits / T); top-p/top-k only shape the sampling,
not the returned logprob. Greedy (T=0) returns log_softmax(logits). We refuse to start with that variable set.

Weight sync (docs/sglang_api_notes.md): a single-GPU engine takes a whole sync in one call on either transport, with
our receiver running in the scheduler (sglang_stream.py). A tensor-parallel one, always fed by broadcast (plan.py),
goes through SGLang's own API inside the same one call (`receive`), bucket by bucket:
- `init_weights_update_group` joins our group (rank = rank_offset + TP rank), then one
  `update_weights_from_distributed(load_format="flattened_bucket")` call per bucket. SGLang packs its
  receive buffer tightly in request order (weight_sync/tensor_bucket.py:50-72); our buckets have 256-byte
  aligned slots, so each request lists uint8 padding entries for the gaps and the buffer is byte-identical
  to ours. The trainer end is our `BroadcastGroup`, whose store keys follow the chain SGLang builds.
- Verification: at setup we register `rlhf_sglang_hook` as a `custom_weight_loader` and call it once per
  TP scheduler; it wraps the model's `load_weights`, which every update path calls with the received
  tensors (views into the flat bucket). The wrapper drops our padding/warm-up entries, loads, checksums
  what it received (mode "received", as vLLM: fused qkv/gate_up parameters have no per-HF-tensor twin) and
  writes {seq, checksums, timings, GPU uuid} to a per-rank JSON file the engine reads. Not covered: a name
  SGLang's loader silently skips (its Llama loader ignores unknown names, unlike vLLM's).

It does not support data parallelism, pipeline parallelism, speculative decoding or quantized models, and
does not save its sampling RNG (resume is not bit-exact).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from functools import partial
from typing import Any, Sequence

import torch

from rlhf_orch.engines.base import WAKE_TAGS, EngineLifecycle, per_prompt_params
from rlhf_orch.engines.sglang_stream import HOOK, SchedulerStream, stream_request, write_report
from rlhf_orch.errors import EngineError
from rlhf_orch.types import Sample
from rlhf_orch.weight_sync.buckets import BucketLayout, checksums
from rlhf_orch.weight_sync.collective import GROUP_NAME

logger = logging.getLogger(__name__)

_RESERVED = "rlhf_orch."                                # names with this prefix never reach the model
_INSTALL = "rlhf_orch.install:"
_PAD = "rlhf_orch.pad."
_WARMUP = "rlhf_orch.warmup"


# ---- inside every SGLang scheduler process ----------------------------------------------------------
def rlhf_sglang_hook(model, named_tensors) -> None:
    """custom_weight_loader entry (weight_updater.py:346-348), called with one empty tensor whose name is the request:
    "rlhf_orch.install:<json config>" installs the recording load_weights wrapper; "rlhf_orch.connect:...",
    "rlhf_orch.join:..." and the per-sync requests serve a sync in one call (sglang_stream.py); anything else is
    refused."""
    for name, _ in named_tensors:
        if name.startswith(_INSTALL):
            from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank
            uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
            install(model, json.loads(name[len(_INSTALL):]), get_tensor_model_parallel_rank(), uuid)
        elif not stream_request(model, name):
            raise RuntimeError(f"{HOOK} only serves rlhf_orch's own requests; got tensor {name!r}")


def install(model, cfg: dict, rank: int, uuid: str) -> None:
    """Shadow `model.load_weights` with `_load_and_record` (re-installing keeps the original method)."""
    old = getattr(model, "_rlhf_state", None)
    orig = old["orig"] if old else model.load_weights
    state = {"orig": orig, "dir": cfg["dir"], "verify": bool(cfg["verify"]), "seq": 0, "rank": rank, "uuid": uuid}
    for key in ("stream", "transport", "abort", "abort_path"):   # our receiver and its abort flag outlive a
        if old and key in old:                                     # re-install (a re-plan makes a new receiver)
            state[key] = old[key]
    object.__setattr__(model, "_rlhf_state", state)
    object.__setattr__(model, "load_weights", partial(_load_and_record, state))
    _report(state, {"sums": [], "load_s": 0.0, "verify_s": 0.0})


def _load_and_record(state: dict, weights):
    t0 = time.perf_counter()
    named, warm = [], None
    for name, t in weights:
        if name.startswith(_RESERVED):
            if name == _WARMUP:
                warm = t
            continue
        named.append((name, t))
    result = state["orig"](named) if named else None
    t1 = time.perf_counter()
    sums: list[int] = []
    if state["verify"] and named:
        sums = checksums(t for _, t in named)       # its host read also waits for the load's copies
    elif any(t.is_cuda for _, t in named):
        torch.cuda.synchronize()                    # an IPC sender refills the buffer once we return
    rec = {"sums": sums, "load_s": t1 - t0, "verify_s": time.perf_counter() - t1}
    if warm is not None:
        rec["warmup_ok"] = bool((warm == 1).all())
    state["seq"] += 1
    _report(state, rec)
    return result


def _report(state: dict, rec: dict) -> None:
    rec.update(seq=state["seq"], rank=state["rank"], uuid=state["uuid"])
    write_report(state["dir"], f"tp{state['rank']}", rec)


# ---- trainer side ------------------------------------------------------------------------------------
def bucket_request(layout: BucketLayout) -> tuple[list[str], list[str], list[list[int]]]:
    """names/dtypes/shapes whose tight packing (SGLang's) reproduces `layout` byte for byte (gaps -> uint8 pads)."""
    names, dtypes, shapes, pos = [], [], [], 0
    for s in layout.slots:
        if s.offset > pos:
            names.append(f"{_PAD}{len(names)}")
            dtypes.append("uint8")
            shapes.append([s.offset - pos])
        names.append(s.name)
        dtypes.append(s.dtype)
        shapes.append(list(s.shape))
        pos = s.offset + s.nbytes
    if pos != layout.nbytes:
        raise ValueError(f"bucket {layout.index}: slots end at {pos}, layout says {layout.nbytes} bytes")
    return names, dtypes, shapes


# ---- the engine (in the rollout actor) ---------------------------------------------------------------
class SGLangEngine(SchedulerStream, EngineLifecycle):
    checksums_mode = "received"   # checksums describe received tensors (see the module doc)
    weight_loaders: tuple[str, ...] = (HOOK,)   # SGLang's custom_weight_loader allow-list

    def __init__(self, name: str, model_path: str, device: str = "cuda", device_id: str = "",
                 dtype: str = "bfloat16", seed: int = 0, mem_fraction_static: float = 0.5,
                 tensor_parallel_size: int = 1, disable_cuda_graph: bool = False, enable_memory_saver: bool = False,
                 enable_weights_cpu_backup: bool = False, context_length: int | None = None,
                 load_format: str = "auto", report_timeout_s: float = 60.0, **_ignored: Any):
        if _ignored:
            logger.debug("engine %s: ignoring options %s", name, sorted(_ignored))
        self.name = name
        self.weight_version = -1
        self.tensor_parallel_size = tensor_parallel_size
        self.disable_cuda_graph = disable_cuda_graph
        self.enable_memory_saver = enable_memory_saver
        self.enable_weights_cpu_backup = enable_weights_cpu_backup
        self.report_timeout_s = report_timeout_s
        self._init_lifecycle()
        self._released: list[str] = []
        self._stale = False               # weights dropped by sleep(2): a sync must come before generate
        self._layouts: list[BucketLayout] = []
        self._requests: list[tuple] = []
        self._group = False               # joined our group through SGLang's own API (bucket by bucket)
        self._verify = True
        self._loads = 0                   # load_weights calls since the hook was (re)installed
        self._sums: dict[str, int] = {}
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").strip().lower() in ("1", "true", "yes", "on"):
            raise EngineError(f"engine {name}: SGLANG_RETURN_ORIGINAL_LOGPROB is set, so SGLang would return logprobs "
                              "before temperature; unset it (the trainer compares log_softmax(logits / T))")
        try:
            import sglang  # noqa: F401  (installed? the error below says how to get it)
        except ImportError as e:
            raise EngineError(f"engine {name}: SGLang is not installed (pip install 'rlhf_orch[sglang]' or set the "
                              f"engine's python_path): {e}") from e
        self._dir = tempfile.mkdtemp(prefix=f"rlhf_orch_sglang_{name}_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            self.engine = self._start_engine(
                model_path=model_path, tp_size=tensor_parallel_size, dtype=dtype, mem_fraction_static=mem_fraction_static,
                random_seed=seed, disable_cuda_graph=disable_cuda_graph, enable_memory_saver=enable_memory_saver,
                enable_weights_cpu_backup=enable_weights_cpu_backup, context_length=context_length,
                load_format=load_format, custom_weight_loader=list(self.weight_loaders))
        except Exception as e:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise EngineError(f"engine {name}: SGLang failed to start from {model_path!r}: {type(e).__name__}: {e}") from e
        self._install(True)
        self._ids = ["gpu-" + r["uuid"] for r in self._reports(0)]
        logger.info("engine %s: SGLang up (tp=%d, dtype=%s, memory_saver=%s) on %s", name, tensor_parallel_size, dtype,
                    enable_memory_saver, self._ids)

    def _start_engine(self, **kw):
        """The `sglang.Engine` (a subclass may build it elsewhere; see sglang_async.py)."""
        import sglang
        return sglang.Engine(**kw)

    # ---- helpers ----------------------------------------------------------------------------------
    def _call(self, what: str, fn, *args, **kwargs):
        try:
            out = fn(*args, **kwargs)
        except Exception as e:
            raise EngineError(f"engine {self.name}: {what} failed: {type(e).__name__}: {e}") from e
        if isinstance(out, tuple) and len(out) == 2 and out[0] is False:
            raise EngineError(f"engine {self.name}: {what} failed in SGLang: {out[1]}")
        return out

    def _install(self, verify: bool) -> None:
        """(Re)install the load wrapper in every TP scheduler through our custom_weight_loader."""
        cfg = json.dumps({"dir": self._dir, "verify": bool(verify)})
        self._call("installing the weight-load hook", self.engine.update_weights_from_tensor,
                   [(_INSTALL + cfg, torch.empty(0))], load_format=HOOK, flush_cache=False)   # empty: no fd to share
        self._verify, self._loads = bool(verify), 0

    def _reports(self, seq: int, prefix: str = "tp") -> list[dict]:
        """Every TP rank's report of load number `seq` (update_weights_from_distributed answers before
        ranks > 0 finish loading, so wait for them). `prefix`: the report file's name (sglang_async uses another)."""
        out, deadline = [], time.monotonic() + self.report_timeout_s
        for rank in range(self.tensor_parallel_size):
            path = os.path.join(self._dir, f"{prefix}{rank}.json")
            while True:
                try:
                    with open(path) as f:
                        rec = json.load(f)
                    if rec["seq"] >= seq:
                        break
                except (FileNotFoundError, json.JSONDecodeError):
                    pass
                if time.monotonic() > deadline:
                    raise EngineError(f"engine {self.name}: TP rank {rank} reported no weight load #{seq} within "
                                      f"{self.report_timeout_s:.0f} s (is {HOOK} importable in the scheduler?)")
                time.sleep(0.0005)
            if rec["seq"] != seq:
                raise EngineError(f"engine {self.name}: TP rank {rank} reports load #{rec['seq']}, expected #{seq}")
            out.append(rec)
        return out

    def _after_load(self, names: list[str], verify: bool) -> tuple[list[int], list[dict]]:
        self._loads += 1
        recs = self._reports(self._loads)
        if not (verify and self._verify):
            return [], recs
        sums = recs[0]["sums"]
        for r in recs[1:]:
            if r["sums"] != sums:
                raise EngineError(f"engine {self.name}: TP rank {r['rank']} received different bytes than rank 0")
        if len(sums) != len(names):
            raise EngineError(f"engine {self.name}: {len(sums)} checksums for {len(names)} tensors")
        self._sums.update(zip(names, sums))
        return sums, recs

    def device_ids(self) -> list[str]:
        """GPU UUID of every TP scheduler, as each scheduler reported it (rank order)."""
        return list(self._ids)

    # ---- generation -------------------------------------------------------------------------------
    def _prompt_requests(self, prompts: Sequence[Sequence[int]], params) -> tuple[list[list[int]], list[dict], int]:
        """(one prompt per sample, SGLang sampling params per sample, n): each prompt repeated n times, n=1 each,
        so outputs come back in request order. Checks first that the engine may generate."""
        self._check_can_generate()
        if self._stale:
            raise EngineError(f"engine {self.name}: weights were dropped by sleep(level=2); sync new weights first")
        prompt_ids = [[int(t) for t in p] for p in prompts]
        each = per_prompt_params(params, len(prompt_ids)) if prompt_ids else []
        n = each[0].n if each else 1   # n, temperature and top_p are shared; length and ignore_eos may differ per prompt
        flat = [p for p in prompt_ids for _ in range(n)]
        sp = [{"temperature": e.temperature, "top_p": e.top_p, "max_new_tokens": e.max_new_tokens, "n": 1,
               "ignore_eos": bool(e.ignore_eos), **({} if e.seed is None else {"sampling_seed": e.seed + j})}
              for e in each for j in range(n)]   # a seeded request (evaluation): seed + j for its sample j, as vLLM
        return flat, sp, n

    def generate(self, prompts: Sequence[Sequence[int]], params) -> list[Sample]:
        flat, sp, n = self._prompt_requests(prompts, params)
        if not flat:
            return []
        with self._lock:
            outs = self._call("generate", self.engine.generate, input_ids=flat, sampling_params=sp, return_logprob=True)
        outs = [outs] if isinstance(outs, dict) else list(outs)
        if len(outs) != len(flat):
            raise EngineError(f"engine {self.name}: SGLang returned {len(outs)} outputs for {len(flat)} requests")
        return [self._sample(i // n, flat[i], out) for i, out in enumerate(outs)]

    def _sample(self, prompt_index: int, prompt: list[int], out: dict) -> Sample:
        meta = out["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason not in ("stop", "length"):
            raise EngineError(f"engine {self.name}: a request finished with {meta.get('finish_reason')!r}")
        resp = [int(t) for t in out["output_ids"]]
        # (logprob, token_id, text) per generated token (tokenizer_manager.py:2499-2510)
        lp = meta.get("output_token_logprobs") or []
        if len(lp) != len(resp) or any(int(t) != r for (_, t, *_), r in zip(lp, resp)):
            raise EngineError(f"engine {self.name}: SGLang's output_token_logprobs do not match the output tokens")
        return Sample(prompt_index=prompt_index, prompt_ids=prompt, response_ids=resp, logprobs=[float(v) for v, *_ in lp],
                      finish_reason=reason, weight_version=self.weight_version, engine=self.name, text=out.get("text") or "")

    # ---- weight sync (the actor shell forwards these) --------------------------------------------------
    def setup_receiver(self, layouts, transport: str, spec: dict, verify: bool, timeout_s: float,
                       replay: bool = True, abort_flag: str | None = None) -> float:
        """Install the hook and open this engine's side of `transport` (weight_sync/transport.py). Returns seconds. A
        single-GPU engine takes every transport with our receiver in its scheduler (sglang_stream.py), provided over
        broadcast that the trainer's checksums follow the buckets (the spec's `sums`); a tensor-parallel one joins the
        broadcast group through SGLang's own API (TP rank k as the spec's rank + k). `replay` applies to our
        receiver. `abort_flag`: the rollout actor's (`aborts_syncs`), which that receiver polls."""
        self._need_weights_awake("setup_receiver")
        t0 = time.perf_counter()
        if abort_flag:
            self.keep_abort_flag(abort_flag)
        self.report_timeout_s = max(self.report_timeout_s, float(timeout_s))
        self._layouts = list(layouts)
        self._replay = bool(replay)
        self._requests = [bucket_request(lay) for lay in self._layouts]
        self.close()
        self._install(verify)
        self._transport = self._abort_side = None
        if self.tensor_parallel_size == 1 and (transport != "broadcast" or spec.get("sums")):
            # The coordinator streams to us (capabilities.checks_loads): our receiver in the scheduler, one call per sync.
            self.open_stream(transport, spec, timeout_s)
        elif transport == "broadcast":
            self.join_own_group(spec, int(spec["rank"]))
        else:
            raise EngineError(f"engine {self.name}: a tensor-parallel SGLang engine takes weights over broadcast only "
                              f"(SGLang's own group), not {transport}")
        return time.perf_counter() - t0

    def connect(self, offer):
        """Setup's second round: our receiver in the scheduler connects (ipc: it opens the trainer rank's buffers and
        answers with its mailbox); SGLang's own group answers nothing."""
        return self.connect_stream(offer) if self._transport is not None else None

    def join_own_group(self, group: dict, rank_offset: int) -> None:
        """Join `group` through SGLang's own `init_weights_update_group` (TP rank k as rank_offset + k) and warm it up:
        the bucket-by-bucket path, and SGLang's own calls that the benchmark compares with."""
        if group["backend"] != "nccl":
            raise EngineError(f"engine {self.name}: SGLang receives weights over nccl only, not {group['backend']!r}")
        self._call("init_weights_update_group", self.engine.init_weights_update_group, master_address=group["host"],
                   master_port=int(group["port"]), rank_offset=int(rank_offset), world_size=int(group["world_size"]),
                   group_name=GROUP_NAME, backend="nccl")
        self._group = True
        # First collective on a fresh communicator pays NCCL setup: do it now, through SGLang's own path.
        self._call("warm-up broadcast", self.engine.update_weights_from_distributed, names=[_WARMUP],
                   dtypes=["uint8"], shapes=[[8]], group_name=GROUP_NAME, flush_cache=False, load_format="flattened_bucket")
        _, recs = self._after_load([], False)
        if not all(r.get("warmup_ok") for r in recs):
            raise EngineError(f"engine {self.name}: the warm-up broadcast delivered wrong bytes")
        logger.info("engine %s: joined the weight-sync group as ranks %d..%d of %d", self.name, rank_offset,
                    rank_offset + self.tensor_parallel_size - 1, group["world_size"])

    def receive(self, sync_id: int, verify: bool = True) -> tuple[list[int], dict[str, float]]:
        """One whole sync over the transport set up; returns (checksums, seconds per phase). Our receiver in the
        scheduler: one call (it polls the abort flag of sync `sync_id`). SGLang's own group: one
        update_weights_from_distributed call per bucket (`sync_id` unused: SGLang's own receive ends at its group's
        timeout, or when rank 0 leaves)."""
        if self._transport is not None:
            return self.receive_stream(sync_id, verify)
        self._need_weights_awake("receive")
        if not self._group:
            raise EngineError(f"engine {self.name}: receive before setup_receiver")
        if verify and not self._verify:
            self._install(True)
        t0 = time.perf_counter()
        sums: list[int] = []
        m = {"call_s": 0.0, "load_s": 0.0, "verify_s": 0.0, "report_s": 0.0}
        for layout, (names, dtypes, shapes) in zip(self._layouts, self._requests):
            t1 = time.perf_counter()
            self._call(f"update_weights_from_distributed (bucket {layout.index})", self.engine.update_weights_from_distributed,
                       names=names, dtypes=dtypes, shapes=shapes, group_name=GROUP_NAME, flush_cache=False,
                       load_format="flattened_bucket")
            t2 = time.perf_counter()
            got, recs = self._after_load(layout.names, verify)
            sums.extend(got)
            m["call_s"] += t2 - t1
            m["report_s"] += time.perf_counter() - t2
            m["load_s"] += max(r["load_s"] for r in recs)
            m["verify_s"] += max(r["verify_s"] for r in recs)
        m["transfer_s"] = max(0.0, m["call_s"] - m["load_s"] - m["verify_s"])   # SGLang's alloc + broadcast
        m["total_s"] = time.perf_counter() - t0
        return sums, m

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Load (hf_name, tensor) pairs with one update_weights_from_tensor call (tests, small models)."""
        self._need_weights_awake("load_weights")
        named = [(n, t.detach().cpu().contiguous()) for n, t in named]
        self._call("update_weights_from_tensor", self.engine.update_weights_from_tensor, named, flush_cache=False)
        self._after_load([n for n, _ in named], True)

    def checksums(self, names: list[str]) -> list[int]:
        """Checksums of the most recently received tensors of `names` (mode "received")."""
        missing = [n for n in names if n not in self._sums]
        if missing:
            raise EngineError(f"engine {self.name}: no received checksum for {missing[:5]} (sync with verify=True first)")
        return [self._sums[n] for n in names]

    # ---- lifecycle --------------------------------------------------------------------------------
    def finish_sync(self, version: int) -> None:
        """New weights are loaded: drop the radix (prefix) cache computed with the old ones, record `version`."""
        out = self._call("flush_cache", self.engine.flush_cache)
        if not getattr(out, "success", False):
            raise EngineError(f"engine {self.name}: SGLang could not flush its cache: {getattr(out, 'message', out)}")
        self.weight_version = version
        self._stale = False

    def sleep(self, level: int = 1) -> None:
        """Release GPU memory: KV cache and weights (level 1 keeps a CPU copy of the weights, level 2 drops them)."""
        if not self.enable_memory_saver:
            raise EngineError(f"engine {self.name}: sleep needs enable_memory_saver: true")
        if level not in (1, 2):
            raise EngineError(f"engine {self.name}: sleep level must be 1 or 2, got {level}")
        if level == 1 and not self.enable_weights_cpu_backup:
            raise EngineError(f"engine {self.name}: sleep(level=1) keeps weights in CPU memory, which needs "
                              "enable_weights_cpu_backup: true; use level 2 or enable it")
        tags = [t for t in ("kv_cache", "weights", "cuda_graph") if t != "cuda_graph" or not self.disable_cuda_graph]
        tags = [t for t in tags if t not in self._released]
        with self._lock:
            if tags:
                self._call("release_memory_occupation", self.engine.release_memory_occupation, tags=tags)
            self._released += tags
            self._asleep = set(WAKE_TAGS)
            self._stale = self._stale or level == 2

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate `tags` (["weights"], then ["kv_cache"]; None: both). After level 2, sync before generating."""
        want = self._tags_to_wake(tags)
        sg = [t for t in self._released if t in want or (t == "cuda_graph" and "weights" in want)]
        if sg:
            self._call("resume_memory_occupation", self.engine.resume_memory_occupation, tags=sg)
            self._released = [t for t in self._released if t not in sg]
        self._asleep -= set(want)


    def close(self) -> None:
        """Leave the weight-sync group (the receiver side of a shutdown; SGLang keeps running)."""
        if self._group:
            self._group = False
            try:
                self._call("destroy_weights_update_group", self.engine.destroy_weights_update_group, group_name=GROUP_NAME)
            except EngineError:
                logger.warning("engine %s: leaving the weight-sync group failed", self.name, exc_info=True)

    def shutdown(self) -> None:
        """Stop SGLang's scheduler and detokenizer processes and remove the report folder."""
        self.close()
        self.drop_abort_link()
        try:
            self.engine.shutdown()
        except Exception:
            logger.warning("engine %s: SGLang shutdown failed", self.name, exc_info=True)
        shutil.rmtree(self._dir, ignore_errors=True)
