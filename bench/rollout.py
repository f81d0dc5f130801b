"""Rollout throughput: our vLLM engine actor against bare vLLM `LLM.generate`, same prompts and sampling.

    python bench/rollout.py --out bench/RESULTS.md                    # llama-3.2-1b shape, GPU 0
    python bench/rollout.py --prompts 64 --max-tokens 64 --repeats 1  # a quick check
    python bench/rollout.py --dry-run                                 # CPU smoke of the script (hf engine)

Target (issue "rollout tokens/s"): ours within 5% of bare vLLM, i.e. ours/bare >= 0.95.

The model is random ("dummy" weights) in a real shape: a LlamaConfig from bench/shapes.py saved
with our character tokenizer (51 ids). The model's vocabulary stays the real 128,256 by default: vLLM
accepts prompt ids up to the model's vocab size (v1/engine/input_processor.py:483) and detokenizes ids the
tokenizer lacks as "" (tokenizers' DecodeStream returns None for them, detokenizer.py:223), so nothing
breaks; `--vocab tokenizer` shrinks the model to the tokenizer's 51 ids instead.

Each side runs in its own process, one after the other, on the same GPU (GPU memory is freed in between):
  bare - `vllm.LLM(...)` and `llm.generate([TokensPrompt...], SamplingParams(n, temperature, top_p,
         max_tokens, logprobs=0, ignore_eos))`, with the LLM options our engine passes;
  ours - a real Ray cluster (local), `RolloutActor.options(num_gpus=1).remote(name, "vllm", ...)`, timed
         around `ray.get(actor.generate.remote(prompts, params))`: what the driver sees, including Ray
         transfer of the samples and our Sample conversion. The actor's own generate time is reported too.
Both sides ignore EOS (`SamplingParams.ignore_eos`), so both generate the same token count; tokens/s
still uses each side's own count. One warm-up round, then the median of --repeats rounds.
The bare process also times our Sample conversion alone (VLLMEngine._sample on its outputs) and pickling.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlhf_orch.engines.base import SamplingParams  # noqa: E402

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


def our_params(args, ignore_eos: bool) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_tokens, n=args.n,
                          ignore_eos=ignore_eos)


def timed_rounds(fn, repeats: int) -> tuple[list[float], object]:
    """One warm-up call, then `repeats` timed calls; returns the times and the last result."""
    out = fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return ts, out


# ---- the two sides, each in its own process --------------------------------------------------------
def side_bare(args, model_path: str) -> dict:
    prompts = make_prompts(args)
    if args.dry_run:   # the hf engine called in process: checks the script, not vLLM
        from rlhf_orch.engines.hf import HFEngine
        eng = HFEngine(name="bare", device="cpu", **engine_kwargs(args, model_path))
        ts, samples = timed_rounds(lambda: eng.generate(prompts, our_params(args, True)), args.repeats)
        return dict(seconds=ts, tokens=sum(len(s.response_ids) for s in samples), device="cpu", version="hf")
    import torch
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

    def gen():
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    ts, outs = timed_rounds(gen, args.repeats)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    # Our Sample conversion alone, on these outputs (VLLMEngine._sample reads only .name/.weight_version).
    me = SimpleNamespace(name="bench", weight_version=0)
    conv = []
    for _ in range(3):
        t0 = time.perf_counter()
        samples = [VLLMEngine._sample(me, i, p, c) for i, (p, o) in enumerate(zip(prompts, outs))
                   for c in sorted(o.outputs, key=lambda c: c.index)]
        conv.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    blob = pickle.dumps(samples, protocol=pickle.HIGHEST_PROTOCOL)
    pickle_s = time.perf_counter() - t0
    return dict(seconds=ts, tokens=tokens, device=torch.cuda.get_device_name(0), version=vllm.__version__,
                convert_s=statistics.median(conv), pickle_s=pickle_s, pickle_mb=len(blob) / 1e6)


def side_ours(args, model_path: str) -> dict:
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
        kind = "hf" if args.dry_run else "vllm"
        actor = RolloutActor.options(**opts).remote("bench", kind, device, "", engine_kwargs(args, model_path))
        ray.get(actor.weight_version.remote(), timeout=900)   # waits for the engine to start
        prompts, params = make_prompts(args), our_params(args, True)
        inner = []

        def gen():
            samples, stats = ray.get(actor.generate.remote(prompts, params), timeout=900)
            inner.append(stats["seconds"])
            return samples
        ts, samples = timed_rounds(gen, args.repeats)
        return dict(seconds=ts, actor_seconds=inner[1:], tokens=sum(len(s.response_ids) for s in samples),
                    ignore_eos=params.ignore_eos)
    finally:
        ray.shutdown()


# ---- driver ------------------------------------------------------------------------------------------
def gpu_name(gpu: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", gpu],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def wait_gpu_free(gpu: str, limit_mib: int = 2048, timeout_s: float = 60) -> None:
    """Wait until the previous side's processes have released the GPU (vLLM's EngineCore exits last)."""
    end = time.time() + timeout_s
    while time.time() < end:
        try:
            used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", gpu],
                                  capture_output=True, text=True, timeout=30).stdout.strip()
            if not used or int(used.splitlines()[0]) < limit_mib:
                return
        except (OSError, subprocess.SubprocessError, ValueError):
            return
        time.sleep(1)
    print(f"warning: GPU {gpu} still holds memory after {timeout_s:.0f}s", flush=True)


def run_side(side: str, args, model_path: str, result: Path) -> dict:
    cmd = [sys.executable, __file__, "--side", side, "--model-path", model_path, "--result", str(result)] + sys.argv[1:]
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONPATH=os.pathsep.join(
        [p for p in [os.environ.get("PYTHONPATH", ""), str(ROOT)] if p]))
    if not args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = args.gpu
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=env, timeout=args.side_timeout).returncode
    if rc != 0 or not result.exists():
        raise SystemExit(f"{side} side failed (exit {rc}); its output is above")
    out = json.loads(result.read_text())
    out["wall_s"] = time.perf_counter() - t0
    if not args.dry_run:
        wait_gpu_free(args.gpu)
    return out


def table(args, bare: dict, ours: dict) -> str:
    b_s, o_s = statistics.median(bare["seconds"]), statistics.median(ours["seconds"])
    a_s = statistics.median(ours["actor_seconds"])
    b_tps, o_tps, a_tps = bare["tokens"] / b_s, ours["tokens"] / o_s, ours["tokens"] / a_s
    eos = "ignored" if ours["ignore_eos"] else "NOT ignored"
    rows = [("bare vLLM `LLM.generate`", bare["tokens"], b_s, b_tps),
            ("ours: driver `ray.get(RolloutActor.generate)`", ours["tokens"], o_s, o_tps),
            ("ours: inside the actor (`engine.generate`)", ours["tokens"], a_s, a_tps)]
    lines = ["| engine | prompts | n | max tokens | tokens generated | seconds | tokens/s | ours/bare |", "|" + "---|" * 8]
    for name, tok, s, tps in rows:
        lines.append(f"| {name} | {args.prompts} | {args.n} | {args.max_tokens} | {tok} | {s:.3f} | {tps:,.0f} | "
                     f"{tps / b_tps:.3f} |")
    notes = [f"\nmedian of {args.repeats} after 1 warm-up; prompts of {args.min_len}-{args.max_len} random tokens, "
             f"temperature {args.temperature}, top_p {args.top_p}; EOS on our side {eos}; "
             f"round times bare {[round(x, 2) for x in bare['seconds']]}, ours {[round(x, 2) for x in ours['seconds']]}"]
    if "convert_s" in bare:
        notes.append(f"our Sample conversion alone (VLLMEngine._sample on the bare outputs): {bare['convert_s']:.3f} s "
                     f"({100 * bare['convert_s'] / b_s:.1f}% of a bare round); pickling the samples: "
                     f"{bare['pickle_s']:.3f} s, {bare['pickle_mb']:.1f} MB; driver minus actor time (Ray transfer): "
                     f"{o_s - a_s:.3f} s")
    target = "hit" if o_tps / b_tps >= 0.95 else "missed"
    notes.append(f"target ours/bare >= 0.95: {o_tps / b_tps:.3f} ({target})")
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
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", default="0", help="physical GPU index both sides run on")
    ap.add_argument("--gpu-mem", type=float, default=0.6, help="gpu_memory_utilization, both sides")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="fixed KV cache size on both sides (needs VLLMEngine's kv_cache_memory_gb option)")
    ap.add_argument("--enforce-eager", action="store_true", help="default off: CUDA graphs, as in production")
    ap.add_argument("--sleep-mode", action="store_true", help="enable_sleep_mode on both sides (our default is on)")
    ap.add_argument("--side-timeout", type=float, default=420)
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke: tiny model, hf engine on both sides")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    ap.add_argument("--side", choices=["bare", "ours"], help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(k, v)   # NVLink multicast stays off; both sides' processes inherit this
    if args.dry_run:
        args.prompts, args.min_len, args.max_len, args.n, args.max_tokens = min(args.prompts, 4), 4, 8, 2, 8
    args.prompt_vocab = 51 if args.dry_run or args.vocab == "tokenizer" else 128256
    if args.side:
        res = (side_bare if args.side == "bare" else side_ours)(args, args.model_path)
        Path(args.result).write_text(json.dumps(res))
        return
    model_path = build_model(args)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"rlhf_orch_rollout_{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    bare = run_side("bare", args, model_path, work / "bare.json")
    print(f"bare: {bare['tokens']} tokens, rounds {bare['seconds']} (process {bare['wall_s']:.0f} s)", flush=True)
    ours = run_side("ours", args, model_path, work / "ours.json")
    print(f"ours: {ours['tokens']} tokens, rounds {ours['seconds']} (process {ours['wall_s']:.0f} s)", flush=True)
    text = table(args, bare, ours)
    print(text)
    if args.out:
        machine = "cpu (dry run)" if args.dry_run else (gpu_name(args.gpu) or bare["device"])
        with open(args.out, "a") as f:
            f.write(f"\n## Rollout throughput, ours vs bare vLLM {bare['version']} ({time.strftime('%Y-%m-%d')}, "
                    f"{args.model} shape, vocab {args.vocab}, GPU {args.gpu}: {machine})\n\n"
                    f"`python {' '.join(sys.argv)}`\n\n{text}\n")


if __name__ == "__main__":
    main()
