"""How long a weight sync's pause takes with requests in flight (issue #27): vLLM streaming runner, the streaming
SGLang engine, or the hf engine.

    python bench/pause_latency.py --engine vllm --model llama-3.2-1b --running 0 64 256 512 --max-tokens 2048
    PYTHONPATH=/tmp/site-sglang:$PWD python bench/pause_latency.py --engine sglang --running 0 64 256 512
    python bench/pause_latency.py --engine hf --running 0 8 32 --max-tokens 64          # CPU dry run

For each count of running requests (each one prompt, n=1, ignore_eos, long responses) and each pause mode:
- keep: requests park between two decode steps and continue after `resume()`; measured `--rounds` times on the
  same running set, one pause every ~0.5 s of decoding;
- abort: running requests end at once with finish_reason "abort" (the caller re-queues them); a fresh set per
  measurement.
vLLM is measured with and without vLLM's incremental detokenization (interleaved: each running count starts one
set per variant, which goes first alternates): "detok" (vLLM detokenizes every token in its output processing, on
the runner's event loop, as before this round) and "end" (`detokenize=False`, the text decoded once per sample at
the end), and "flat" ("end" with `flat_logprobs=True`: vLLM keeps a request's logprobs in flat lists instead of a
dict and a Logprob object per token; what StreamingVLLMEngine asks for since the eleventh session); abort rounds
also run "final" (FINAL_ONLY, flat: one output per request at its end, what rollout.final_outputs asks for). Every
garbage collection of this process is timed (gc.callbacks): the `gc` column is the collections' time inside each
pause, and the collections of each generation are summed up after the table. The pause is the runner's own
(`AsyncVLLMRunner.pause`: the engine core's pause, no drain; `resume()` drains) and is split into: loop lag (until
our coroutine runs on the runner's event loop), the engine core's pause, and the outputs still queued from the
engine when it returned.
`resume_s` includes the drain. Our engines (SGLang, hf) are measured as a sync drives them: pause, `finish_sync`
(`finish_s`: no weights are loaded here; SGLang retracts a "keep" pause's requests there, or flushes its cache after an
abort), resume. SGLang's keep pauses run three variants, interleaved: in place with the retraction after the load in
bulk (engines/sglang_sched.py) or by SGLang's own retract, and "retract-pause" (SGLang's retract inside the pause, as
before the sixteenth session); its abort pauses two: "drop" (in place, every request dropped by the scheduler in one
pass) and "abort-retract" (SGLang's retract pause and abort_all, as before the seventeenth session).
Prints a markdown table (median and max) and writes it to --out. `--sample-stacks` (vLLM): during each abort pause a
thread samples every other thread's innermost frames every 2 ms (sys._current_frames; it needs the GIL too, so a
long gap between samples is a C call that held it) from the pause's call until the aborted generate call has
returned its rows, and the table is followed by the stacks seen most while the pausing thread waited after the
engine core had paused (the `return` part) and the longest gaps.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from transformers import LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.shapes import SHAPES  # noqa: E402
from rlhf_orch.engines.base import SamplingParams  # noqa: E402
from rlhf_orch.engines.hf import HFEngine  # noqa: E402
# neither imports vLLM or SGLang at its top: their engines start them
from rlhf_orch.engines.sglang_async import StreamingSGLangEngine  # noqa: E402
from rlhf_orch.engines.vllm_async import AsyncVLLMRunner  # noqa: E402
from rlhf_orch.models import TinyModelSpec, build_tokenizer, ensure_model_dir  # noqa: E402


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(32)] for _ in range(n)]


class GcClock:
    """Times every garbage collection of this process (gc.callbacks: a start and a stop per collection)."""

    def __init__(self):
        self.spans: list[tuple[float, float, int]] = []
        self._t = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.spans.append((self._t, time.perf_counter(), info["generation"]))

    def within(self, t0: float, t1: float) -> float:
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b, _ in self.spans)

    def summary(self) -> str:
        lines = []
        for g in (0, 1, 2):
            d = [b - a for a, b, gen in self.spans if gen == g]
            if d:
                lines.append(f"generation {g}: {len(d)} collections, {1e3 * sum(d):.0f} ms in all, median "
                             f"{1e3 * statistics.median(d):.2f} ms, max {1e3 * max(d):.1f} ms")
        return "\n".join(lines)


GC = GcClock()


class StackSampler:
    """Every `every_s`, the innermost `depth` frames of every thread but this one, with the time and thread name."""

    def __init__(self, every_s: float = 0.002, depth: int = 4):
        self.every_s, self.depth, self.samples = every_s, depth, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            t = time.perf_counter()
            names = {th.ident: th.name for th in threading.enumerate()}
            for tid, f in sys._current_frames().items():
                if tid == me:
                    continue
                stack = []
                while f is not None and len(stack) < self.depth:
                    stack.append(f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}")
                    f = f.f_back
                self.samples.append((t, names.get(tid, str(tid)), " < ".join(stack)))
            time.sleep(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def report(self, t0: float, t1: float, top: int = 6) -> dict:
        """The most frequent (thread, stack) pairs sampled in [t0, t1] and the longest gaps between samples there."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        times = sorted({s[0] for s in inside})
        gaps = sorted((b - a for a, b in zip(times, times[1:])), reverse=True)[:3]
        counts = collections.Counter((name, stack) for _, name, stack in inside
                                     if not any(w in stack for w in ("wait (threading", "select (selectors",
                                                                     "_worker (thread")))
        return {"window_ms": 1e3 * (t1 - t0), "looks": len(times), "gaps_ms": [round(1e3 * g, 1) for g in gaps],
                "top": [(n, name, stack) for (name, stack), n in counts.most_common(top)]}


class Vllm:
    def __init__(self, args):
        path, self.vocab = _random_model(args)
        self.runner = AsyncVLLMRunner(path, load_format="dummy", dtype="bfloat16", seed=0,
                                      gpu_memory_utilization=args.gpu_mem, max_model_len=args.max_tokens + 64,
                                      max_num_seqs=max(max(args.running), 1), gc_freeze=not args.no_gc_freeze)
        self.runner.weight_version = 0
        self.sample_stacks, self.stacks = args.sample_stacks, []

    def start(self, n: int, args, variant: str):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        sp = SamplingParams(n=1, temperature=1.0, max_tokens=args.max_tokens, logprobs=0, ignore_eos=True,
                            detokenize=variant == "detok", flat_logprobs=variant in ("flat", "final"))
        if variant == "final":   # one output per request at its end (no keep pause allowed)
            sp.output_kind = RequestOutputKind.FINAL_ONLY
        out: dict = {}
        prompts = _prompts(n, self.vocab, args.seed + n)
        t = threading.Thread(target=lambda: out.update(rows=self.runner.generate(prompts, sp),
                                                       t_rows=time.perf_counter()), daemon=True)
        t.start()
        return t, out

    def pause(self, mode: str, job=None) -> dict:
        r = self.runner
        sampler = StackSampler() if job is not None and self.sample_stacks else None
        if sampler:
            sampler.__enter__()
        t0 = time.perf_counter()
        r.pause(mode)
        t_back = time.perf_counter()
        if sampler:   # until the aborted call has its rows (decoded) back in its thread
            job[0].join(600)
            sampler.__exit__(None)
            t_core = t_back - r.last_pause["return_s"]
            self.stacks.append({"return_window": sampler.report(t_core, t_back),
                                "after_return": sampler.report(t_back, job[1].get("t_rows", t_back)),
                                "rows_after_return_ms": 1e3 * (job[1].get("t_rows", t_back) - t_back)})
        m = {"pause_s": t_back - t0, "gc_s": GC.within(t0, t_back), "loop_lag_s": r.last_pause["loop_lag_s"],
             "engine_s": r.last_pause["core_s"], "return_s": r.last_pause["return_s"]}
        q = getattr(r._llm.engine_core, "outputs_queue", None)
        m["queued"] = q.qsize() if q is not None else -1
        t3 = time.perf_counter()
        r.resume()
        m["resume_s"] = time.perf_counter() - t3
        return m

    def close(self):
        self.runner.shutdown()


def _random_model(args, suffix: str = "") -> tuple[str, int]:
    """A config-only folder of `args.model`'s shape with the built-in tokenizer (engines load dummy weights)."""
    tok = build_tokenizer()
    path = Path("/tmp/rlhf_orch_pause_bench") / (args.model + suffix)
    LlamaConfig(**{**SHAPES[args.model], "vocab_size": len(tok)}, architectures=["LlamaForCausalLM"],  # SGLang reads it
                max_position_embeddings=4096, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16").save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), len(tok)


class Engine:
    """One of our engines (generate, pause, resume) measured from outside: the pause's whole call, the garbage
    collections inside it, and the resume."""

    def start(self, n: int, args, variant: str):
        out: dict = {}
        sp = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True, temperature=1.0)
        prompts = _prompts(n, self.vocab, args.seed + n)
        t = threading.Thread(target=lambda: out.update(rows=self.engine.generate(prompts, sp)), daemon=True)
        t.start()
        return t, out

    def pause(self, mode: str) -> dict:
        """pause, finish_sync (what follows the weight load of a sync; no load here), resume: each timed."""
        t0 = time.perf_counter()
        self.engine.pause(mode)
        t1 = time.perf_counter()
        m = {"pause_s": t1 - t0, "gc_s": GC.within(t0, t1)}
        self.engine.finish_sync(self.engine.weight_version)
        t2 = time.perf_counter()
        m["finish_s"] = t2 - t1
        self.engine.resume()
        m["resume_s"] = time.perf_counter() - t2
        parts = getattr(getattr(self.engine, "runner", None), "last_pause", {})   # SGLang's split of the pause
        m.update({k: parts.get(k, 0.0) for k in SGLANG_PARTS} if isinstance(self, Sglang) else {})
        return m


# AsyncSGLangRunner's split: the pause's census of the paused scheduler ("keep": the GPU step launched before the
# pause waited for, counts read); in finish_sync, the retraction's round trip and its time in the scheduler; in
# resume, the wait for every token generated before the pause to reach our streams through the detokenizer
SGLANG_PARTS = ("census_s", "settle_s", "retract_hook_s", "drain_s", "drop_s", "drop_hook_s")
# keep variants: (StreamingSGLangEngine.keep_pause, .retract). "retract-pause": the pause before the sixteenth session
# (SGLang retracts inside the pause; finish_sync's SGLang retract finds nothing left and evicts the tree, as before)
SGLANG_KEEP = {"bulk": ("in_place", "bulk"), "sglang": ("in_place", "sglang"), "retract-pause": ("retract", "sglang")}
# abort variants: StreamingSGLangEngine.abort_pause. "drop": in place, the scheduler drops every request in one pass
# (op "drop", the seventeenth session); "abort-retract": SGLang's retract pause and abort_request(abort_all), before
SGLANG_ABORT = {"drop": "in_place", "abort-retract": "retract"}


class Sglang(Engine):
    """rlhf_orch's StreamingSGLangEngine (kind sglang, streaming) with dummy weights of `--model`'s shape; the pause
    split into SGLANG_PARTS (results: bench/RESULTS.md, "One GPU, thirteenth session")."""

    def __init__(self, args):
        path, self.vocab = _random_model(args, "-sglang")
        self.engine = StreamingSGLangEngine(name="s", model_path=path, dtype="bfloat16", seed=0,
                                            mem_fraction_static=args.gpu_mem, context_length=args.max_tokens + 64,
                                            load_format="dummy")
        self.engine.weight_version = 0

    def start(self, n: int, args, variant: str):
        if variant in SGLANG_KEEP:   # SGLang's pause for keep, and how its requests are retracted after the load
            self.engine.keep_pause, self.engine.retract = SGLANG_KEEP[variant]
        if variant in SGLANG_ABORT:  # SGLang's pause for abort (the drop in bulk where it applies)
            self.engine.abort_pause, self.engine.retract = SGLANG_ABORT[variant], "bulk"
        return super().start(n, args, variant)

    def close(self):
        self.engine.shutdown()


class Hf(Engine):
    def __init__(self, args):
        path = ensure_model_dir("tiny-llama", TinyModelSpec(), Path("/tmp/rlhf_orch_pause_bench"), seed=0)
        self.engine = HFEngine(name="hf", model_path=str(path), device="cpu", seed=0,
                               max_batch_size=max(max(args.running), 1))
        self.vocab = 40

    def close(self):
        pass


def measure(eng, args) -> list[dict]:
    rows = _Rows()
    variants = {"vllm": ["end", "flat", "detok"], "sglang": list(SGLANG_KEEP)}.get(args.engine, ["-"])
    # FINAL_ONLY requests refuse a keep pause: abort rounds only; SGLang's retraction variants are keep's alone
    abort_variants = {"vllm": variants + ["final"], "sglang": list(SGLANG_ABORT)}.get(args.engine, ["-"])
    for j, n in enumerate(args.running):
        for v in (variants if j % 2 == 0 else variants[::-1]):   # keep: one running set per variant
            job = eng.start(n, args, v) if n else None
            time.sleep(args.warm_s if n else 0.1)
            for _ in range(args.rounds):
                rows.append({"running": n, "mode": "keep", "variant": v, **eng.pause("keep")})
                time.sleep(args.gap_s)
            if job is not None:
                eng.pause("abort")                  # end the keep set
                job[0].join(600)
        for k in range(args.abort_rounds):         # abort: a fresh running set each time
            for v in (abort_variants if k % 2 == 0 else abort_variants[::-1]):
                job = eng.start(n, args, v) if n else None
                time.sleep(args.warm_s if n else 0.1)
                m = eng.pause("abort", job) if args.engine == "vllm" else eng.pause("abort")
                if getattr(eng, "stacks", None) and "running" not in eng.stacks[-1]:
                    eng.stacks[-1].update(running=n, variant=v)
                if job is not None:
                    job[0].join(600)
                    m["aborted"] = sum(r[5] == "abort" if isinstance(r, tuple) else r.finish_reason == "abort"
                                       for r in job[1].get("rows", []))
                rows.append({"running": n, "mode": "abort", "variant": v, **m})
        print(f"running {n}: done", flush=True)
    return rows


class _Rows(list):
    """The measurements, each also printed as one JSON line when taken: a run cut short by its time limit still
    leaves every pause it measured in the log."""

    def append(self, row: dict) -> None:
        super().append(row)
        print("row", json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def table(rows: list[dict], args) -> str:
    keys = (["pause_s", "gc_s", "loop_lag_s", "engine_s", "return_s", "resume_s"] if args.engine == "vllm"
            else ["pause_s", "gc_s", "finish_s", *SGLANG_PARTS, "resume_s"] if args.engine == "sglang"
            else ["pause_s", "gc_s", "finish_s", "resume_s"])
    lines = ["| running | mode | text | n | " + " | ".join(f"{k} median (max)" for k in keys) +
             (" | queued at return (median) |" if args.engine == "vllm" else " |"),
             "|" + "---|" * (len(keys) + 4 + (args.engine == "vllm"))]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["running"], r["mode"], r["variant"]), []).append(r)
    for (n, mode, v), rs in sorted(groups.items()):
        cells = [f"{1e3 * statistics.median(r[k] for r in rs):.1f} ({1e3 * max(r[k] for r in rs):.1f})" for k in keys]
        extra = f" | {statistics.median(r['queued'] for r in rs):.0f}" if args.engine == "vllm" else ""
        lines.append(f"| {n} | {mode} | {v} | {len(rs)} | " + " | ".join(cells) + extra + " |")
    return "\n".join(lines) + "\n\n(milliseconds)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["vllm", "sglang", "hf"], default="vllm")
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--running", type=int, nargs="+", default=[0, 64, 256, 512])
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=10, help="keep pauses per running count and variant")
    ap.add_argument("--abort-rounds", type=int, default=3)
    ap.add_argument("--warm-s", type=float, default=3.0, help="decoding before the first pause of a running set")
    ap.add_argument("--gap-s", type=float, default=0.5, help="decoding between two keep pauses")
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-gc-freeze", action="store_true", help="vLLM: leave the runner's objects to the collector")
    ap.add_argument("--sample-stacks", action="store_true", help="vLLM: what every thread does during abort pauses")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    eng = {"vllm": Vllm, "sglang": Sglang, "hf": Hf}[args.engine](args)
    try:
        rows = measure(eng, args)
    finally:
        eng.close()
    text = table(rows, args) + "\n\nGarbage collections in this process:\n" + GC.summary()
    if getattr(eng, "stacks", None):
        text += "\n\nStacks during abort pauses (in measurement order):\n" + "\n".join(
            json.dumps(st) for st in eng.stacks)
    print(text)
    if args.out:
        Path(args.out).write_text(f"`python bench/pause_latency.py {' '.join(argv or sys.argv[1:])}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
