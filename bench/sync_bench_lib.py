"""The receiving side and the reporting of bench/weight_sync.py: receiver processes, the raw receiver, the tables.

`parse_receivers` reads a `--receivers` spec: how many engines receive, and the TP size of each.

Every receiver (an engine, or a plain process that only takes raw floor broadcasts) runs `host_main` in its own
process, which sees only its GPUs (CUDA_VISIBLE_DEVICES), and is driven over a pipe by `Host`: a message names a
`HostState` method and its arguments, the answer is its return value or the traceback. `sync_weights` mirrors
`RolloutActor.sync_weights` (actors/rollout.py: every engine takes a sync in one call) and `commit` its commit (an
engine the coordinator checks, tensor-parallel SGLang, stays paused until then). `RawEngine` is our `WeightReceiver` loading into a dict
of tensors: the "raw" engine, and the one that runs on CPU (gloo, shared memory). `Pool` keeps receiver processes
alive across cases that need the same ones (vLLM takes a minute to start). `markdown`/`as_json` write every table
from the per-round seconds. This module times nothing the tables report except what engines report themselves.
"""
from __future__ import annotations

import gc
import json
import multiprocessing
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.shapes import MODELS
from rlhf_orch.engines.base import Capabilities, checks_over
from rlhf_orch.engines.vllm_worker import pack_arg
from rlhf_orch.types import dtype_from_name
from rlhf_orch.weight_sync import WeightReceiver, checksums
from rlhf_orch.weight_sync.abort import AbortFlag
from rlhf_orch.weight_sync.collective import GROUP_NAME, BroadcastGroup
from rlhf_orch.weight_sync.ipc import open_handle
from rlhf_orch.weight_sync.replay import LoadReplay

HOST = "127.0.0.1"
TIMEOUT_S = 600.0
# NVLink multicast stays off here and in every child (they inherit the environment); vLLM needs pickled RPC args.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def parse_receivers(spec: str) -> list[int]:
    """TP size of each engine: '3' = three TP=1 engines, 'tp2' = one TP=2 engine, '2xtp1+tp2' = two TP=1 and a TP=2."""
    if spec.isdigit() and int(spec) > 0:
        return [1] * int(spec)
    out = []
    for part in spec.split("+"):
        m = re.fullmatch(r"(?:([1-9]\d*)x)?tp([1-9]\d*)", part)
        if m is None:
            raise SystemExit(f"--receivers {spec!r}: use a count (3), tpN (tp2), KxtpN (2xtp1) or several joined by +")
        out += [int(m.group(2))] * int(m.group(1) or 1)
    return out


class RawEngine:
    """Our receiver without an inference engine: loads into its own tensors, checksums what it holds."""
    capabilities = Capabilities()   # a WeightReceiver of ours takes a whole sync in one call, as the hf engine's does

    def __init__(self, model: str, device: torch.device, slot: str):
        self.device, self.slot = device, slot
        self.params = {s.name: torch.zeros(s.shape, dtype=dtype_from_name(s.dtype), device=device) for s in MODELS[model]()}
        self.receiver: WeightReceiver | None = None
        self.weight_version = -1

    def device_ids(self) -> list[str]:
        if self.device.type == "cuda":
            return ["gpu-" + str(torch.cuda.get_device_properties(self.device).uuid)]
        return [self.slot]

    def setup_receiver(self, layouts, transport, spec, verify, timeout_s, replay: bool = True,
                       abort_flag: str | None = None) -> float:
        if self.receiver is not None:
            self.receiver.close()
        p = self.params
        self.receiver = WeightReceiver(layouts, self.device,
                                       lambda named: torch._foreach_copy_([p[n] for n, _ in named], [t for _, t in named]),
                                       lambda names: checksums(p[n] for n in names), LoadReplay(lambda: p))
        self.receiver.abort_flag = AbortFlag.attach(abort_flag) if abort_flag else None
        return self.receiver.open(transport, spec, timeout_s)

    def connect(self, offer):
        return self.receiver.connect(offer)

    def receive(self, sync_id: int, verify: bool = True):
        return self.receiver.receive(sync_id, verify)

    def abort_stream(self) -> None:
        self.receiver.abort_stream()

    def set_replay(self, enabled: bool) -> None:
        self.receiver.set_replay(enabled)

    def pause(self, mode: str = "wait") -> None:
        pass

    def resume(self) -> None:
        pass

    def finish_sync(self, version: int) -> None:
        self.weight_version = version

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()


class HostState:
    """Everything one receiver process holds: raw floor groups and buffers, and at most one engine."""

    def __init__(self, device: torch.device, slot: str):
        self.dev, self.slot = device, slot
        self.groups: dict[str, BroadcastGroup] = {}
        self.bufs: list[torch.Tensor] = []
        self.engine, self.kind, self.specs, self.own = None, "", [], {}
        self.verify, self.ipc_s = True, 0.0

    def _sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    # ---- raw floor -------------------------------------------------------------------------------
    def join(self, key, port, rank, world):
        g = BroadcastGroup("nccl" if self.dev.type == "cuda" else "gloo", HOST, port, rank, world, TIMEOUT_S, self.dev)
        g.warmup()
        self.groups[key] = g

    def floor(self, key, sizes):
        """Receive one raw broadcast per bucket size, into two buffers in turn, all posted at once."""
        if not self.bufs or self.bufs[0].numel() < max(sizes):
            self.bufs = [torch.empty(max(sizes), dtype=torch.uint8, device=self.dev) for _ in range(2)]
        for w in [self.groups[key].broadcast(self.bufs[i % 2][:n], async_op=True) for i, n in enumerate(sizes)]:
            w.wait()
        self._sync()

    def drop(self):
        for g in self.groups.values():
            g.destroy()
        self.groups, self.bufs = {}, []
        gc.collect()

    # ---- the engine ------------------------------------------------------------------------------
    def start(self, kind, model, kw):
        t0 = time.perf_counter()
        self.kind, self.specs = kind, MODELS[model]()
        if kind == "raw":
            self.engine, version = RawEngine(model, self.dev, self.slot), "raw"
        elif kind == "vllm":
            import vllm   # optional (the vllm extra), as is SGLang below: imported with its engine module here
            from rlhf_orch.engines.vllm import VLLMEngine
            self.engine, version = VLLMEngine(**kw), f"vLLM {vllm.__version__}"
        else:
            import sglang
            from rlhf_orch.engines.sglang import SGLangEngine
            self.engine, version = SGLangEngine(**kw), f"SGLang {sglang.__version__}"
        streams = tuple(t for t in ("ipc", "broadcast") if checks_over(self.engine, t))
        return time.perf_counter() - t0, self.engine.device_ids(), version, streams

    def setup(self, layouts, transport, spec, verify):
        """As RolloutActor.setup_receiver: with an abort flag (nothing here aborts), so that numbered syncs wait as a
        run's do: polled."""
        self.verify, self.streamed = verify, False
        flag = AbortFlag.create()
        try:
            return self.engine.setup_receiver(layouts, transport, spec, verify, TIMEOUT_S, abort_flag=flag.handle())
        finally:
            flag.unlink()   # the receiving process has mapped it

    def own_group(self, group, rank):
        """SGLang: join a second group through its own API, for its own calls (one_call, naive), where our receiver in
        its scheduler holds the sync group."""
        self.engine.join_own_group(group, rank)

    def connect(self, offer):
        answer = self.engine.connect(offer)
        self.streamed = answer is not None   # the sender waits on what we answered: tell it when a sync fails here
        return answer

    def sync_weights(self, version, sync_id, hold):
        """RolloutActor.sync_weights: pause -> every bucket (checked by the receiver where the trainer's checksums
        come with them) -> record version -> resume; `hold`: stay paused for `commit`."""
        t0 = time.perf_counter()
        self.engine.pause("wait")
        t1 = time.perf_counter()
        try:
            sums, m = self.engine.receive(sync_id, self.verify)
        except BaseException:
            if self.streamed:
                self.engine.abort_stream()
            raise
        t2 = time.perf_counter()
        if not hold:
            self.commit(version)
        return {"sums": sums, "pause_s": t1 - t0, "receive_s": t2 - t1, "finish_s": time.perf_counter() - t2,
                **{k: float(v) for k, v in m.items() if k != "total_s"}}   # load_s, and wait_s of a stream

    def commit(self, version):
        self.engine.finish_sync(version)
        self.engine.resume()


    def set_replay(self, enabled: bool):
        """Load replay (weight_sync/replay.py) on, or off: the engine's own loader at every sync."""
        self.engine.set_replay(bool(enabled))

    # ---- baselines: SGLang's own calls and the per-parameter paths (untimed set-up, timed by the trainer) --------
    def hook(self, verify: bool):
        """SGLang: (re)install our load hook with or without checksums (SGLang's own calls must not pay for them)."""
        if self.kind == "sglang":
            self.engine._install(verify and self.verify)

    def own_tensors(self):
        """SGLang colocated: tensors of the model's shape on this GPU for its own update_weights_from_tensor."""
        self.own = {s.name: torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device=self.dev).normal_() for s in self.specs}
        self._sync()

    def one_call(self, colocated: bool):
        sg = self.engine.engine
        if colocated:
            self.engine._call("update_weights_from_tensor", sg.update_weights_from_tensor, list(self.own.items()),
                              flush_cache=False)
        else:
            s = self.specs
            self.engine._call("update_weights_from_distributed", sg.update_weights_from_distributed,
                              names=[x.name for x in s], dtypes=[x.dtype for x in s], shapes=[list(x.shape) for x in s],
                              group_name=GROUP_NAME, flush_cache=False)

    def naive(self):
        """Disaggregated: one receive (and for engines one call) per parameter, in the trainer's order."""
        for s in self.specs:
            if self.kind == "raw":
                t = torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device=self.dev)
                self.engine.receiver.group.broadcast(t)
                self.engine.params[s.name].copy_(t)
            elif self.kind == "vllm":
                self.engine._rpc("rlhf_receive_one", s.name, s.dtype, list(s.shape))
            else:
                sg = self.engine.engine
                self.engine._call("update_weights_from_distributed", sg.update_weights_from_distributed, names=[s.name],
                                  dtypes=[s.dtype], shapes=[list(s.shape)], group_name=GROUP_NAME, flush_cache=False)
        self._sync()

    def naive_ipc(self, name, handle, dtype, shape):
        """Colocated: one fresh IPC handle (and for vLLM one call) per parameter."""
        if self.kind == "vllm":
            self.engine._rpc("rlhf_receive_one_ipc", name, pack_arg(handle), dtype, list(shape))
        else:
            self.engine.params[name].copy_(open_handle(handle).view(dtype_from_name(dtype)).view(shape))
            self._sync()

    def naive_local(self):
        """SGLang colocated: one update_weights_from_tensor call per parameter (SGLang's own per-tensor IPC)."""
        for name, t in self.own.items():
            self.engine._call("update_weights_from_tensor", self.engine.engine.update_weights_from_tensor, [(name, t)],
                              flush_cache=False)

    def close(self):
        self.drop()
        if self.engine is not None:
            self.engine.shutdown()
            core = getattr(getattr(getattr(self.engine, "llm", None), "llm_engine", None), "engine_core", None)
            if core is not None:
                core.shutdown()    # stop vLLM's EngineCore (and its workers) now, not at exit
        for p in multiprocessing.active_children():   # the engine's own processes: gone before the GPU is reused
            p.join(60)
            if p.is_alive():
                p.kill()


def visible_gpus(gpus: str, parent: str | None) -> str:
    """The host's CUDA_VISIBLE_DEVICES for `gpus`, indices into the GPUs this benchmark sees (`parent`, the
    inherited CUDA_VISIBLE_DEVICES, if set): with CUDA_VISIBLE_DEVICES=3, host GPU "0" is GPU 3, not GPU 0."""
    if not parent:
        return gpus
    seen = [g.strip() for g in parent.split(",") if g.strip()]
    return ",".join(seen[int(g)] for g in gpus.split(","))


def host_main(conn, gpus: str, device: str, slot: str) -> None:
    if device == "cuda":
        assert not torch.cuda.is_initialized(), "CUDA_VISIBLE_DEVICES must be set before CUDA starts"
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
        torch.cuda.set_device(0)
    st = HostState(torch.device("cuda", 0) if device == "cuda" else torch.device("cpu"), slot)
    while True:
        cmd, args = conn.recv()
        try:
            out = st.close() if cmd == "exit" else getattr(st, cmd)(*args)
            conn.send(("ok", out))
        except Exception:
            conn.send(("error", traceback.format_exc()))
        if cmd == "exit":
            # Everything is shut down explicitly above. On CUDA (H100, torch 2.11) a process that had mapped another
            # process's IPC memory was seen to hang in interpreter teardown until killed, so skip the teardown.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


class Host:
    """The trainer's end of one receiver process."""

    def __init__(self, ctx, gpus: str, device: str, slot: str):
        self.gpus = gpus
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=host_main, args=(child, gpus, device, slot), daemon=False)   # engines fork
        self.proc.start()
        self.info: tuple = ()   # (start seconds, device ids, version, transports it streams) once an engine runs here

    def send(self, cmd: str, *args) -> None:
        self.conn.send((cmd, args))

    def get(self, timeout: float = TIMEOUT_S):
        if not self.conn.poll(timeout):
            raise RuntimeError(f"receiver on {self.gpus}: no answer in {timeout:.0f}s")
        status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"receiver on {self.gpus} failed:\n{out}")
        return out

    def call(self, cmd: str, *args):
        self.send(cmd, *args)
        return self.get()

    def close(self) -> None:
        grace = 60.0
        if self.proc.is_alive():
            try:
                self.call("exit")
                # It has shut everything down and called os._exit. On an H100 (torch 2.11) a process that had mapped
                # another's CUDA IPC memory still did not finish exiting until killed (60 s): do not wait for that.
                grace = 5.0
            except (RuntimeError, OSError, EOFError):
                pass
        self.proc.join(grace)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


class Pool:
    """Receiver processes by key (role, model, GPUs, TP, index): a case reuses the ones it shares with the last."""

    def __init__(self, device: str):
        self.ctx, self.device, self.hosts = multiprocessing.get_context("spawn"), device, {}

    def take(self, keys: list[tuple]) -> list[Host]:
        for k in [k for k in self.hosts if k not in keys]:
            self.hosts.pop(k).close()
        for k in keys:
            if k not in self.hosts:
                self.hosts[k] = Host(self.ctx, k[2], self.device, f"cpu-slot{k[2]}")
        return [self.hosts[k] for k in keys]

    def close(self) -> None:
        self.take([])


# ---- reporting ----------------------------------------------------------------------------------------
LABELS = {"floor1": "floor, first receiving GPU only",
          "shard": "per-shard ideal (1/k of each bucket to each of k GPUs)", "one_call": "SGLang's own one call (unverified)",
          "naive": "per-parameter calls", "sync_loader": "ours, engine's loader every sync (replay off)",
          "loader_load": "its engine load phase (replay off)",
          "sync_host": "ours, host hand-over per bucket (verified)", "host_pack": "its pack phase (host hand-over)",
          "host_wait": "its wait phase (host hand-over)", "host_load": "its engine load phase (host hand-over)"}
PHASES = ["pause", "transfer", "pack", "wait", "load", "verify", "resume", "total"]


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else {}


def _case_name(c: dict) -> str:
    return f"| {c['engine']} | {c['model']} | {c['placement']} | {c['receivers']} ({c['gpus']}) "


def markdown(cases: list[dict]) -> str:
    ok = [c for c in cases if "error" not in c]
    lines = ["| engine | model | placement | receivers (GPUs) | GB | tensors | buckets | measure | median ms | min-max ms "
             "| x floor (median/median) | verified |", "|" + "---|" * 12]
    for c in ok:
        floor = statistics.median(c["measures"]["floor"])
        for m, xs in c["measures"].items():
            label = LABELS.get(m) or {"floor": "floor: device copy" if c["placement"] == "colocated" else "floor: raw broadcast",
                                      "sync": "ours (verified)" if c["verify"] else "ours (no checksums)"}[m]
            ver = f"{c['verified']}/{len(xs)}" if m == "sync" and c["verify"] else ("off" if m == "sync" else "")
            s = summary(xs)
            lines.append(f"{_case_name(c)}| {c['bytes'] / 1e9:.2f} | {c['tensors']} | {c['buckets']} | {label} | "
                         f"{s['median'] * 1e3:.1f} | {s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f} | "
                         f"{s['median'] / floor:.2f}x | {ver} |")
    lines += ["", "Per sync, medians in ms (names of the coordinator's `sync/` metrics; `engine` = what the receivers "
              "report, ms, slowest engine):", "",
              "| engine | model | placement | receivers (GPUs) | " + " | ".join(PHASES) + " | GB/s | engine |",
              "|" + "---|" * (len(PHASES) + 6)]
    for c in ok:
        med = {k: statistics.median(v) for k, v in c["phases"].items()}
        eng = ", ".join(f"{k[:-2]} {v * 1e3:.1f}" if k.endswith("_s") else f"{k} {v:g}"   # seconds as ms; flags
                        for k, v in sorted((k, statistics.median(v)) for k, v in c["receiver"].items()))
        lines.append(_case_name(c) + "| " + " | ".join(f"{med['sync/' + p + '_s'] * 1e3:.1f}" for p in PHASES) +
                     f" | {med['sync/gbps']:.3g} | {eng} |")
    notes = [f"- {c['engine']} {c['model']} {c['placement']} {c['receivers']}: " + "; ".join(
        f"{m} / {base} = {statistics.median(c['measures'][m]) / statistics.median(c['measures'][base]):.2f}x"
        for m, base in (("sync", "floor1"), ("floor", "floor1"), ("shard", "floor"), ("sync", "one_call"))
        if m in c["measures"] and base in c["measures"]) for c in ok if len(c["measures"]) > 2]
    notes += [f"- FAILED {c['engine']} {c['model']} {c['placement']} {c['receivers']}: {c['error']}" for c in cases
              if "error" in c]
    return "\n".join(lines + ([""] + [n for n in notes if not n.endswith(": ")] if notes else []))


def as_json(cases: list[dict]) -> list[dict]:
    """The cases with a summary (seconds) next to every list of per-round seconds."""
    out = []
    for c in cases:
        c = dict(c)
        for key in ("measures", "phases", "receiver"):
            if key in c:
                c[key + "_summary"] = {k: summary(v) for k, v in c[key].items()}
        out.append(c)
    return out


def write_reports(cases: list[dict], machine: str, command: str, args: dict, out: str | None,
                  json_path: str | None) -> str:
    """The markdown tables (returned); appended as a dated section to `out`, and every round with the summaries
    written as JSON to `json_path`, where given."""
    text = markdown(cases)
    label = next((c["engine"] for c in cases if "error" not in c), args["engine"])
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(f"\n## Weight sync, {label} ({time.strftime('%Y-%m-%d')}, {machine})\n\n`{command}`\n\n{text}\n")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine,
                                               "command": command, "args": args, "cases": as_json(cases)}, indent=1))
    return text
