"""Rollout throughput: our vLLM engine actor against bare vLLM `LLM.generate`, same prompts and sampling.

    python bench/rollout.py --out bench/RESULTS.md                    # llama-3.2-1b shape, GPU 0, 10 pairs
    python bench/rollout.py --prompts 64 --max-tokens 64 --repeats 5  # a quick check
    python bench/rollout.py --dry-run --repeats 3                     # CPU smoke of the script (hf engine)

Target 7 of issue #16 ("rollout overhead"): our engine actor's tokens/s >= 0.97x bare vLLM on the same
batch, over >= 5 interleaved repeats with the spread reported. Rounds of bare vLLM alone spread 12.5-16.7 s on an
H200, far more than the 3% effect, so the two sides' rounds are interleaved: a drift of the machine hits both.

The model is random ("dummy" weights) in a real shape: a LlamaConfig from bench/shapes.py saved
with our character tokenizer (51 ids). The model's vocabulary stays the real 128,256 by default: vLLM
accepts prompt ids up to the model's vocab size (v1/engine/input_processor.py:483) and detokenizes ids the
tokenizer lacks as "" (tokenizers' DecodeStream returns None for them, detokenizer.py:223), so nothing
breaks; `--vocab tokenizer` shrinks the model to the tokenizer's 51 ids instead.

Each side is a long-lived process of its own (`--side bare|ours`), both alive at once on the same GPU:
  bare - `vllm.LLM(...)` and `llm.generate([TokensPrompt...], SamplingParams(n, temperature, top_p,
         max_tokens, logprobs=0, ignore_eos))`, with the LLM options our engine passes;
  ours - a real Ray cluster (local), `RolloutActor.options(num_gpus=1).remote(name, "vllm", ...)`, timed
         around `ray.get(actor.generate.remote(prompts, params))`: what the driver sees, including Ray
         transfer of the samples and our Sample conversion. The actor's own generate time is reported too.
A side builds its engine, runs one warm-up round and says ready; then each "round" on its stdin runs one
timed round, and "stop" makes it report its extras and exit. Its answers are stdout lines that start with
MARK (JSON after it); its other output is vLLM/Ray logs, which the driver passes on. The driver starts bare,
then ours (the second must fit next to the first: a fixed --kv-cache-gb and --gpu-mem 0.35, since vLLM checks
at start that free memory >= gpu_memory_utilization x total), then runs --repeats pairs of rounds, bare first
in pairs 1, 3, ... and ours first in pairs 2, 4, ...; one side generates while the other idles. Reported: each
side's median round and min-max, the per-pair ratio ours/bare (median, min-max) and each side's spread
(max-min)/median, to be read against the 3% effect.
Both sides ignore EOS (`SamplingParams.ignore_eos`), so both generate the same token count; tokens/s
still uses each side's own count. The bare side also times our Sample conversion alone (VLLMEngine._sample
on its last outputs) and pickling.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlhf_orch.engines.base import SamplingParams  # noqa: E402

MARK = "@@bench "   # starts a side's protocol line on its stdout; everything else there is logs
TARGET = 0.97


def make_prompts(args) -> list[list[int]]:
    """Deterministic random token-id prompts (ids 4.. avoid pad/bos/eos/unk)."""
    rng = random.Random(args.seed)
    return [[rng.randrange(4, args.prompt_vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
            for _ in range(args.prompts)]


def build_model(args) -> str:
    root = Path(os.environ.get("TMPDIR", "/tmp")) / "rlhf_orch_rollout_bench"
    if args.dry_run:
        from rlhf_orch.models import TinyModelSpec, ensure_model_dir
        return str(ensure_model_dir("tiny-llama", TinyModelSpec(), root / "tiny", seed=0))
    from transformers import LlamaConfig
    from bench.shapes import SHAPES
    from rlhf_orch.models import build_tokenizer
    tok = build_tokenizer()
    shape = dict(SHAPES[args.model])
    if args.vocab == "tokenizer":
        shape["vocab_size"] = len(tok)
    path = root / f"{args.model}-{args.vocab}"
    LlamaConfig(**shape, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                torch_dtype="bfloat16").save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def engine_kwargs(args, model_path: str) -> dict:
    if args.dry_run:   # the hf engine takes only these
        return dict(model_path=model_path, dtype="float32", seed=args.seed)
    kw = dict(model_path=model_path, dtype="bfloat16", seed=args.seed, gpu_memory_utilization=args.gpu_mem,
              enable_sleep_mode=args.sleep_mode, enforce_eager=args.enforce_eager,
              max_model_len=args.max_model_len, load_format="dummy")
    if args.kv_cache_gb:   # our engine's option; the bare side passes vLLM's kv_cache_memory_bytes instead
        kw["kv_cache_memory_gb"] = args.kv_cache_gb
    return kw


def engine_section(args):
    """Our side's engine, as a config names it (the same options engine_kwargs gives the bare side)."""
    from rlhf_orch.config.engines.hf import HFEngineConfig
    from rlhf_orch.config.engines.vllm import VLLMEngineConfig
    if args.dry_run:
        return HFEngineConfig(kind="hf")
    return VLLMEngineConfig(kind="vllm", gpu_memory_utilization=args.gpu_mem, enable_sleep_mode=args.sleep_mode,
                            enforce_eager=args.enforce_eager, max_model_len=args.max_model_len, load_format="dummy",
                            kv_cache_memory_gb=args.kv_cache_gb or None)


def our_params(args, ignore_eos: bool) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_tokens, n=args.n,
                          ignore_eos=ignore_eos)


# ---- the two sides, each a long-lived process ------------------------------------------------------
def emit(msg: dict) -> None:
    sys.stdout.write(MARK + json.dumps(msg) + "\n")   # one write: a log thread cannot split the line
    sys.stdout.flush()


def serve(one_round, extras) -> None:
    """The side's loop: a warm-up round, "ready", then "round" -> one timed round's dict, "stop" -> `extras()`."""
    one_round()
    emit({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if line.strip() == "round":
            emit(one_round())
        elif line.strip() == "stop":
            return emit(extras())
        else:
            raise ValueError(f"unknown command {line!r}")


def side_bare(args, model_path: str) -> None:
    import torch
    prompts = make_prompts(args)
    if args.dry_run:   # the hf engine called in process: checks the script, not vLLM
        from rlhf_orch.engines.hf import HFEngine
        torch.set_num_threads(1)   # as in the actor (actor_env sets OMP_NUM_THREADS=1 on CPU)
        eng = HFEngine(name="bare", device="cpu", **engine_kwargs(args, model_path))

        def hf_round() -> dict:
            t0 = time.perf_counter()
            samples = eng.generate(prompts, our_params(args, True))
            return {"seconds": time.perf_counter() - t0, "tokens": sum(len(s.response_ids) for s in samples)}
        return serve(hf_round, lambda: dict(device="cpu", version="hf"))
    import vllm
    from vllm import LLM, SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt
    from rlhf_orch.engines.vllm import VLLMEngine
    kw = engine_kwargs(args, model_path)
    if "kv_cache_memory_gb" in kw:
        kw["kv_cache_memory_bytes"] = int(kw.pop("kv_cache_memory_gb") * 2**30)
    # The same LLM options as rlhf_orch/engines/vllm.py, less our worker extension (it only adds methods).
    llm = LLM(model=kw.pop("model_path"), tensor_parallel_size=1, logprobs_mode="processed_logprobs", **kw)
    sp = VSamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                         logprobs=0, seed=None, detokenize=True, ignore_eos=True)
    last = {}

    def one_round() -> dict:
        t0 = time.perf_counter()
        outs = last["outs"] = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return {"seconds": time.perf_counter() - t0, "tokens": sum(len(c.token_ids) for o in outs for c in o.outputs)}

    def extras() -> dict:
        # Our Sample conversion alone, on the last outputs (VLLMEngine._sample reads only .name/.weight_version).
        me, outs, conv = SimpleNamespace(name="bench", weight_version=0), last["outs"], []
        for _ in range(3):
            t0 = time.perf_counter()
            samples = [VLLMEngine._sample(me, i, p, c) for i, (p, o) in enumerate(zip(prompts, outs))
                       for c in sorted(o.outputs, key=lambda c: c.index)]
            conv.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        blob = pickle.dumps(samples, protocol=pickle.HIGHEST_PROTOCOL)
        return dict(convert_s=statistics.median(conv), pickle_s=time.perf_counter() - t0, pickle_mb=len(blob) / 1e6,
                    device=torch.cuda.get_device_name(0), version=vllm.__version__)
    serve(one_round, extras)


def side_ours(args, model_path: str) -> None:
    import ray
    from actors.common import actor_env
    from actors.rollout import RolloutActor
    device = "cpu" if args.dry_run else "cuda"
    ray.init(num_cpus=max(2, os.cpu_count() or 2), num_gpus=0 if args.dry_run else 1, include_dashboard=False,
             log_to_driver=True)
    try:
        opts = {"runtime_env": {"env_vars": actor_env(device)}}
        if not args.dry_run:
            opts["num_gpus"] = 1
        actor = RolloutActor.options(**opts).remote("bench", engine_section(args), device, "", model_path,
                                                    "float32" if args.dry_run else "bfloat16", args.seed)
        ray.get(actor.weight_version.remote(), timeout=args.side_timeout)   # waits for the engine to start
        prompts, params = make_prompts(args), our_params(args, True)

        def one_round() -> dict:
            t0 = time.perf_counter()
            samples, stats = ray.get(actor.generate.remote(prompts, params), timeout=args.side_timeout)
            return {"seconds": time.perf_counter() - t0, "actor_seconds": stats["seconds"],
                    "tokens": sum(len(s.response_ids) for s in samples)}
        serve(one_round, dict)
    finally:
        ray.shutdown()


# ---- driver ------------------------------------------------------------------------------------------
class Side:
    """One side's process: commands go to its stdin; a reader thread queues its MARK lines (None at its end of
    output) and passes every other line of its stdout on, prefixed with the side's name."""

    def __init__(self, name: str, args, model_path: str):
        self.name, self.lines, self.stopped = name, queue.Queue(), False
        cmd = [sys.executable, __file__, "--side", name, "--model-path", model_path] + sys.argv[1:]
        env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
            [p for p in [os.environ.get("PYTHONPATH", ""), str(ROOT)] if p]))
        if not args.dry_run:
            env["CUDA_VISIBLE_DEVICES"] = args.gpu
        # Its own session, so that a failed run can end the whole group (vLLM's EngineCore, Ray's daemons).
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            head, mark, body = line.partition(MARK)   # MARK mid-line: another process left half a line before it
            try:
                msg = json.loads(body) if mark else None
            except ValueError:
                head, msg = line, None
            if head.strip():
                print(f"[{self.name}] {head.rstrip()}", flush=True)
            if msg is not None:
                self.lines.put(msg)
        self.lines.put(None)

    def reply(self, what: str, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            alive = self.proc.poll() is None
            try:   # once it has exited, allow a moment for its last lines
                msg = self.lines.get(timeout=1 if alive else 5)
            except queue.Empty:
                if alive:
                    continue
                msg = None
            if msg is None:
                raise SystemExit(f"{self.name} side ended (exit code {self.proc.poll()}) while the driver waited for "
                                 f"{what}; its output is above")
            return msg
        raise SystemExit(f"{self.name} side: no {what} within --side-timeout {timeout:.0f} s; its output is above")

    def ask(self, command: str, timeout: float) -> dict:
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except OSError:   # BrokenPipeError: it has exited
            raise SystemExit(f"{self.name} side is gone (exit code {self.proc.poll()}); its output is above") from None
        msg = self.reply(f"its answer to {command!r}", timeout)
        self.stopped = command == "stop"
        return msg

    def close(self) -> None:
        """After "stop" let it exit by itself; then end its group: SIGTERM while it still runs (its finally blocks
        shut Ray and vLLM down), then SIGKILL for whatever is left (Ray's agents ignore SIGTERM)."""
        if self.stopped:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(10)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:   # the whole group is gone
            pass


def gpu_name(gpu: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", gpu],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_pairs(args, model_path: str) -> tuple[dict, dict]:
    """Start bare, then ours; --repeats pairs of rounds, alternating which side goes first.
    Returns ({side: [round dicts]}, bare's extras)."""
    sides = {}
    try:
        for name in ("bare", "ours"):   # one after the other: vLLM's memory profiling wants a quiet GPU
            t0 = time.perf_counter()
            sides[name] = Side(name, args, model_path)
            sides[name].reply("its ready line (engine start and warm-up round)", args.side_timeout)
            print(f"{name} side ready after {time.perf_counter() - t0:.0f} s (start + warm-up round)", flush=True)
        rounds = {"bare": [], "ours": []}
        for i in range(args.repeats):
            for name in ("bare", "ours") if i % 2 == 0 else ("ours", "bare"):
                rounds[name].append(sides[name].ask("round", args.side_timeout))
            b, o = rounds["bare"][-1], rounds["ours"][-1]
            print(f"pair {i + 1}/{args.repeats}: bare {b['seconds']:.3f} s, ours {o['seconds']:.3f} s, "
                  f"ours/bare {tps(o) / tps(b):.3f}", flush=True)
        extras = {name: side.ask("stop", args.side_timeout) for name, side in sides.items()}
        return rounds, extras["bare"]
    finally:
        for side in sides.values():
            side.close()


def tps(r: dict) -> float:
    return r["tokens"] / r["seconds"]


def col(rs: list[dict], key: str) -> list[float]:
    return [r[key] for r in rs]


def spread(xs: list[float]) -> str:
    return f"{100 * (max(xs) - min(xs)) / statistics.median(xs):.1f}%"


def table(args, rounds: dict, bare_x: dict) -> str:
    bare, ours = rounds["bare"], rounds["ours"]
    rows = [("bare vLLM `LLM.generate`", "bare", bare, "seconds"),
            ("ours: driver `ray.get(RolloutActor.generate)`", "ours", ours, "seconds"),
            ("ours: inside the actor (`engine.generate`)", "inside the actor", ours, "actor_seconds")]
    med = {label: statistics.median(col(rs, key)) for _, label, rs, key in rows}
    tokens = {label: statistics.median(col(rs, "tokens")) for _, label, rs, _ in rows}
    b_tps = tokens["bare"] / med["bare"]
    lines = ["| engine | prompts | n | max tokens | tokens generated | median s | min-max s | tokens/s | ours/bare |",
             "|" + "---|" * 9]
    for name, label, rs, key in rows:
        tok, secs = tokens[label], col(rs, key)
        lines.append(f"| {name} | {args.prompts} | {args.n} | {args.max_tokens} | {tok:.0f} | {med[label]:.3f} | "
                     f"{min(secs):.3f}-{max(secs):.3f} | {tok / med[label]:,.0f} | {tok / med[label] / b_tps:.3f} |")
    ratios = [tps(o) / tps(b) for b, o in zip(bare, ours)]
    ratio = statistics.median(ratios)
    notes = [f"\n{len(ratios)} interleaved pairs of rounds (bare first in pairs 1, 3, ..., ours first in 2, 4, ...), "
             f"each side after 1 warm-up round, both engines alive on one device; prompts of {args.min_len}-"
             f"{args.max_len} random tokens, temperature {args.temperature}, top_p {args.top_p}, EOS ignored; same "
             f"token count on both sides: {'yes' if tokens['bare'] == tokens['ours'] else 'NO'}",
             f"round seconds bare {[round(x, 3) for x in col(bare, 'seconds')]}, "
             f"ours {[round(x, 3) for x in col(ours, 'seconds')]}",
             "steadiness, spread (max-min)/median of the rounds: "
             + ", ".join(f"{label} {spread(col(rs, key))}" for _, label, rs, key in rows)
             + f"; of the pair ratios {spread(ratios)} (the effect to measure: {100 * (1 - TARGET):.0f}%)"]
    if "convert_s" in bare_x:
        notes.append(f"our Sample conversion alone (VLLMEngine._sample on the bare outputs): {bare_x['convert_s']:.3f} "
                     f"s ({100 * bare_x['convert_s'] / med['bare']:.1f}% of a bare round); pickling the samples: "
                     f"{bare_x['pickle_s']:.3f} s, {bare_x['pickle_mb']:.1f} MB; driver minus actor time (Ray "
                     f"transfer): {med['ours'] - med['inside the actor']:.3f} s")
    notes.append(f"target ours/bare >= {TARGET}: {ratio:.3f} ({'hit' if ratio >= TARGET else 'missed'}), "
                 f"pairs min-max {min(ratios):.3f}-{max(ratios):.3f}")
    return "\n".join(lines) + "\n" + "\n".join(notes)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b", choices=["llama-3.2-1b", "llama-3.1-8b"])
    ap.add_argument("--vocab", default="model", choices=["model", "tokenizer"],
                    help="model: the real vocab size; tokenizer: shrink the model to the tokenizer's 51 ids")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=10, help="interleaved pairs of rounds (target 7 asks for >= 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", default="0", help="physical GPU index both sides run on")
    ap.add_argument("--gpu-mem", type=float, default=0.35,
                    help="gpu_memory_utilization, both sides (both engines share the GPU; vLLM checks at start "
                         "that this share of the GPU is free)")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--kv-cache-gb", type=float, default=16,
                    help="fixed KV cache size on both sides (our engine's kv_cache_memory_gb, bare vLLM's "
                         "kv_cache_memory_bytes); 0: vLLM sizes it from --gpu-mem")
    ap.add_argument("--enforce-eager", action="store_true", help="default off: CUDA graphs, as in production")
    ap.add_argument("--sleep-mode", action="store_true", help="enable_sleep_mode on both sides (our default is on)")
    ap.add_argument("--side-timeout", type=float, default=420,
                    help="seconds a side may take to start (with its warm-up round), and then per round")
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke: tiny model, hf engine on both sides")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    ap.add_argument("--side", choices=["bare", "ours"], help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # `timeout` and the driver stop us: run the finally blocks
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(k, v)   # NVLink multicast stays off; both sides' processes inherit this
    if args.dry_run:
        args.prompts, args.min_len, args.max_len, args.n, args.max_tokens = min(args.prompts, 4), 4, 8, 2, 8
    args.prompt_vocab = 51 if args.dry_run or args.vocab == "tokenizer" else 128256
    if args.side:
        return (side_bare if args.side == "bare" else side_ours)(args, args.model_path)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    rounds, bare_x = run_pairs(args, build_model(args))
    text = table(args, rounds, bare_x)
    print(text)
    if args.out:
        machine = "cpu (dry run)" if args.dry_run else (gpu_name(args.gpu) or bare_x["device"])
        with open(args.out, "a") as f:
            f.write(f"\n## Rollout throughput, ours vs bare vLLM {bare_x['version']}, interleaved "
                    f"({time.strftime('%Y-%m-%d')}, {args.model} shape, vocab {args.vocab}, GPU {args.gpu}: {machine})"
                    f"\n\n`python {' '.join(sys.argv)}`\n\n{text}\n")


if __name__ == "__main__":
    main()
