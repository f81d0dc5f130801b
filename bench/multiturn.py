"""Generation throughput of multi-turn tool trajectories against single-turn responses of the same length (issue #29).

    python bench/multiturn.py --engine vllm --out /tmp/multiturn.md            # one GPU: vLLM, Llama-3.2-1B shape
    python bench/multiturn.py --dry-run --repeats 2                            # CPU smoke: hf engine, tiny model

One engine in this process (no Ray, no trainer). Workload: `--prompts` P random prompts of `--prompt-tokens` ids x
`--n` samples, temperature 1, every length forced (ignore_eos):
- multi: rlhf_orch.rollout.agent.AgentRunner with the built-in `calculator` agent and a tool that always answers
  (`=1234 =1234 ...`, cut at max_observation_tokens = `--obs-tokens` O), so every trajectory is exactly `--turns` T
  model turns of `--turn-tokens` L tokens with T-1 observations of O tokens between them; one engine call per turn
  (the runner batches every live trajectory into one call, each turn re-sends its whole context as token ids);
- single: the same P x n in one engine call (n per prompt; the runner sends n requests of n=1 per prompt),
  max_new_tokens = T*L + (T-1)*O: a response as long as a trajectory.
Both end with the same context (prompt + T*L + (T-1)*O tokens per sample). "model tokens" are the tokens the
engine sampled: P*n*T*L in multi, P*n*(T*L + (T-1)*O) in single (observations are the tool's: encoded, never
sampled, but prefilled by the engine in the next turn); "response tokens" count every response token, observations
included (equal for both modes). model tok/s is the headline (what a trainer gets); response tok/s compares the same
final contexts. Each call gets fresh prompts (no prefix-cache hit across calls; within a trajectory vLLM reuses the
previous turn's blocks, as in training). One warm-up of each mode, then `--repeats` interleaved pairs (single, multi,
single, ...); medians with min-max, and the ratio multi/single per pair. "in engine" is the share of the wall time
spent inside the engine's generate calls (the rest: the agents' event loop, tools, tokenizer).
"""
from __future__ import annotations

import argparse
import datetime
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.shapes import SHAPES  # noqa: E402
from rlhf_orch.engines import engine_class  # noqa: E402
from rlhf_orch.engines.base import SamplingParams  # noqa: E402
from rlhf_orch.models import TinyModelSpec, build_tokenizer, ensure_model_dir  # noqa: E402
from rlhf_orch.rollout import agents  # noqa: E402
from rlhf_orch.rollout.agent import AgentRunner  # noqa: E402

WORK = Path("/tmp/rlhf_orch_multiturn_bench")
DRY = dict(prompts=8, n=4, turns=3, turn_tokens=32, obs_tokens=8, prompt_tokens=8)
FULL = dict(prompts=64, n=8, turns=4, turn_tokens=128, obs_tokens=32, prompt_tokens=64)


def model_path(args, context: int) -> str:
    """dry run: the built-in tiny model; else a Llama-3.2-1B-shaped random bf16 model with its real 128,256-id vocabulary
    and our character tokenizer (vLLM decodes ids the tokenizer lacks as "", bench/rollout.py), built on CPU so that
    CUDA stays out of this process until vLLM has started its engine core."""
    if args.dry_run:
        return str(ensure_model_dir("tiny-llama", TinyModelSpec(max_position_embeddings=max(64, context)),
                                    WORK / "models", seed=0))
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    tok = build_tokenizer()
    path = WORK / f"{args.model}-random"
    if not (path / "tokenizer.json").exists():   # written last
        cfg = LlamaConfig(**SHAPES[args.model], max_position_embeddings=4096,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16",
                          architectures=["LlamaForCausalLM"])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        del model
    return str(path)


def build_engine(args, context: int):
    path = model_path(args, context)
    if args.engine == "vllm":
        return engine_class("vllm")(name="vllm", model_path=path, dtype="bfloat16", seed=0,
                                    gpu_memory_utilization=args.gpu_mem, enforce_eager=False,
                                    max_model_len=context + 16,
                                    max_num_seqs=args.prompts * args.n)
    import torch
    cuda = not args.dry_run and torch.cuda.is_available()
    return engine_class("hf")(name="hf", model_path=path, device="cuda" if cuda else "cpu",
                              dtype="bfloat16" if cuda else "float32", seed=0, max_batch_size=args.prompts * args.n)


class Counted:
    """The engine's generate, counting calls and the seconds spent inside them."""

    def __init__(self, engine):
        self.engine, self.calls, self.seconds = engine, 0, 0.0

    def __call__(self, prompts, params):
        t = time.perf_counter()
        try:
            return self.engine.generate(prompts, params)
        finally:
            self.calls += 1
            self.seconds += time.perf_counter() - t


def prompts_for(args, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]


def run_once(mode: str, args, gen: Counted, tok, seed: int) -> dict:
    T, L, O = args.turns, args.turn_tokens, args.obs_tokens
    total = T * L + (T - 1) * O
    prompts = prompts_for(args, seed, len(tok))
    gen.calls, gen.seconds = 0, 0.0
    t0 = time.perf_counter()
    if mode == "single":
        samples = gen(prompts, SamplingParams(temperature=1.0, max_new_tokens=total, n=args.n, ignore_eos=True))
    else:
        obs = "=1234 " * (O + 1)   # at least O tokens whatever the tokenizer: the runner cuts it to O
        runner = AgentRunner(gen, agents.calculator, tok, {"calculator": lambda text: obs}, max_turns=T,
                             max_total_tokens=total, max_observation_tokens=O, tool_timeout_s=60.0)
        samples = runner.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=L, n=args.n,
                                                          ignore_eos=True), [{} for _ in prompts])
    wall = time.perf_counter() - t0
    model = sum(s.trained_tokens for s in samples)
    resp = sum(len(s.response_ids) for s in samples)
    want_model = args.prompts * args.n * (T * L if mode == "multi" else total)
    if len(samples) != args.prompts * args.n or model != want_model or resp != args.prompts * args.n * total or (
            mode == "multi" and any(s.turn_stats["turns"] != T for s in samples)):
        raise SystemExit(f"{mode}: the workload was not the one asked for: {len(samples)} samples, {model} model tokens "
                         f"(want {want_model}), {resp} response tokens (want {args.prompts * args.n * total}), turns "
                         f"{sorted({s.turn_stats.get('turns') for s in samples})}")
    return {"mode": mode, "wall": wall, "model": model, "resp": resp, "calls": gen.calls, "engine_s": gen.seconds}


def spread(xs: list[float], fmt: str) -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def table(rows: list[dict], args) -> str:
    T, L, O = args.turns, args.turn_tokens, args.obs_tokens
    lines = [f"P={args.prompts} prompts of {args.prompt_tokens} tokens x n={args.n}; multi: {T} turns x {L} tokens, "
             f"{T - 1} observations x {O} tokens; single: one response of {T * L + (T - 1) * O} tokens (ignore_eos, "
             f"temperature 1); engine {args.engine}; {args.repeats} interleaved repeats after one warm-up each.", "",
             "| mode | engine calls | wall s median (min-max) | model tokens | model tok/s median (min-max) | "
             "response tokens | response tok/s median (min-max) | in engine |", "|---|---|---|---|---|---|---|---|"]
    by = {m: [r for r in rows if r["mode"] == m] for m in ("single", "multi")}
    for m, rs in by.items():
        lines.append(f"| {m} | {rs[0]['calls']} | {spread([r['wall'] for r in rs], '.2f')} | {rs[0]['model']} | "
                     f"{spread([r['model'] / r['wall'] for r in rs], '.0f')} | {rs[0]['resp']} | "
                     f"{spread([r['resp'] / r['wall'] for r in rs], '.0f')} | "
                     f"{100 * sum(r['engine_s'] for r in rs) / sum(r['wall'] for r in rs):.0f}% |")
    pairs = list(zip(by["single"], by["multi"]))
    model = [(mu["model"] / mu["wall"]) / (s["model"] / s["wall"]) for s, mu in pairs]
    resp = [(mu["resp"] / mu["wall"]) / (s["resp"] / s["wall"]) for s, mu in pairs]
    wall = [mu["wall"] / s["wall"] for s, mu in pairs]
    lines += ["", f"multi / single, per pair (median (min-max) of {len(pairs)}): model tok/s {spread(model, '.3f')}, "
              f"response tok/s {spread(resp, '.3f')}, wall time {spread(wall, '.3f')}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--dry-run", action="store_true", help="hf engine on CPU, the built-in tiny model, a small load")
    for k, v in FULL.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default {v} ({DRY[k]} dry run)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="llama-3.2-1b", help="a bench/shapes.py SHAPES entry (not in a dry run)")
    ap.add_argument("--gpu-mem", type=float, default=0.5, help="vLLM gpu_memory_utilization")
    ap.add_argument("--out", default=None, help="append the table (with the command, machine and date) to this file")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.engine = "hf"
    for k, v in (DRY if args.dry_run else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    context = args.prompt_tokens + args.turns * args.turn_tokens + (args.turns - 1) * args.obs_tokens
    tok = build_tokenizer()
    t0 = time.perf_counter()
    engine = build_engine(args, context)
    print(f"engine {args.engine} up in {time.perf_counter() - t0:.1f} s", flush=True)
    gen, rows = Counted(engine), []
    try:
        for i, mode in enumerate(["single", "multi"] + ["single", "multi"] * args.repeats):
            r = run_once(mode, args, gen, tok, seed=1000 + i)
            print(f"{'warm-up ' if i < 2 else ''}{mode}: {r['wall']:.2f} s, {r['calls']} calls, "
                  f"{r['model'] / r['wall']:.0f} model tok/s", flush=True)
            if i >= 2:
                rows.append(r)
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    text = table(rows, args)
    print(text)
    if args.out:
        import torch
        machine = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        cmd = "python bench/multiturn.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.out, "a") as f:
            f.write(f"\n`{cmd}` ({machine}, {datetime.datetime.now():%Y-%m-%d %H:%M})\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
