"""Trainer throughput: padded micro-batches vs token budgets vs packed (padding-free) training, and the
chunked LM head on a 152k vocabulary. One GPU, one DeepSpeed rank, the real `DeepSpeedTrainer.train_step`.

    python bench/trainer_throughput.py --out $OUT/RESULTS_trainer.md       # one GPU (nvidia-h200)
    python bench/trainer_throughput.py --dry-run                           # CPU smoke of the script

Policy: the Llama-3.2-1B-like shape of issue #12 (hidden 2048, MLP 8192, 16 layers, 32/8 heads), random
weights, bf16, ZeRO-2, gradient checkpointing, AdamW at lr 0 (the weights stay put, so every step of every
mode does the same work). The trainer is fed synthetic RL batches whose response lengths are the quantiles
of a lognormal, so every step has the same multiset of lengths, the tail included:
- `rl65`:  512 samples, responses of mean ~65 tokens up to 1,024 (what random weights gave in the issue);
- `rl300`: 128 samples, responses of median ~300 up to 2,048.
Prompts are 24 tokens.

Modes (one trainer per model; a mode only changes the trainer's micro-batching and attention):
- `padded`: 16 sequences per micro-batch, each padded to its longest (sdpa): the trainer before issue #12;
- `budget`: token-budget micro-batches, sorted by length, still padded (sdpa);
- `packed`: the same budget as one packed row per micro-batch, varlen attention (torch's flash kernel);
  `packed@N` (with --extra-budgets): the same with a budget of N tokens.
Repeats are interleaved (padded, budget, packed, padded, ...) after one warm-up step each; each mode reports
the median training tokens/s over repeats, the spread (min-max), and MFU (rlhf_orch/metrics/flops.py).

Vocabulary section: the same shape with a 151,936-token vocabulary, packed, with the full-vocabulary logits
(`logprob_chunk_tokens` 0) vs chunks of 4,096 positions: tokens/s and peak GPU memory per micro-batch budget.
A budget whose full logits do not fit shows as out of memory.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8)
SHAPE_DRY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
WORKLOADS = {"rl65": dict(n=512, median=30, sigma=1.25, cap=1024), "rl300": dict(n=128, median=300, sigma=0.6, cap=2048)}
PROMPT = 24


def lognormal_lengths(n: int, median: float, sigma: float, cap: int) -> list[int]:
    """The n quantiles (i + 0.5) / n of a lognormal, capped: the same multiset of lengths every step, in a
    fixed shuffled order (a real batch is not sorted: sorted rows would flatter the padded path)."""
    nd = statistics.NormalDist()
    out = [max(1, min(cap, round(median * math.exp(sigma * nd.inv_cdf((i + 0.5) / n))))) for i in range(n)]
    random.Random(0).shuffle(out)
    return out


def make_batch(lengths: list[int], vocab: int, seed: int = 0):
    import torch
    from rlhf_orch.trainer.batch import build_train_batch
    from rlhf_orch.types import Sample
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(lengths):
        ids = torch.randint(4, vocab, (PROMPT + n,), generator=g).tolist()
        samples.append(Sample(i, ids[:PROMPT], ids[PROMPT:], (-torch.rand(n, generator=g)).tolist(), "stop", 0))
    return build_train_batch(samples, torch.randn(len(lengths), generator=g), pad_id=0)


def build_model(path: Path, shape: dict, vocab: int, max_len: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, **shape)
    torch.manual_seed(0)
    with torch.device("meta"):
        LlamaForCausalLM(cfg)   # fail fast on a bad shape before the real allocation
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_trainer(model_path: str, device: str, budget: int):
    from rlhf_orch.trainer.deepspeed_trainer import DeepSpeedTrainer
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), LOCAL_RANK="0")
    return DeepSpeedTrainer(model_path, 0, 1, device=device, zero_stage=2, lr=0.0, bf16=device == "cuda",
                            gradient_checkpointing=True, max_tokens_per_micro_batch=budget, packing=True,
                            attn="varlen", micro_batch_size=16)


def set_mode(tr, mode: str, budget: int, chunk: int = 0) -> None:
    """Switch one trainer between the modes (the model object is the same; only attention and micro-batching
    change). `packed@N` is packed with a budget of N tokens."""
    from rlhf_orch.trainer.packing import resolve_attn
    tr.chunk = chunk
    if mode.startswith("packed@"):
        mode, budget = "packed", int(mode.split("@")[1])
    if mode == "padded":
        tr.budget, tr.packing, tr.attn = 0, False, None
        tr.engine.module.set_attn_implementation("sdpa")
    elif mode == "budget":
        tr.budget, tr.packing, tr.attn = budget, False, None
        tr.engine.module.set_attn_implementation("sdpa")
    else:
        tr.budget, tr.packing, tr.attn = budget, True, resolve_attn("varlen", tr.device.type)
        tr.engine.module.set_attn_implementation(tr.attn)


def one_step(tr, batch) -> dict:
    import torch
    tokens = float(batch.response_mask.sum())
    if tr.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    m = tr.train_step(batch, tokens)
    if tr.device.type == "cuda":
        torch.cuda.synchronize()
    m["wall_s"] = time.perf_counter() - t0
    return m


def run_modes(tr, batch, budget: int, repeats: int, log, extra_budgets: list[int]) -> dict[str, list[dict]]:
    modes = ["padded", "budget", "packed"] + [f"packed@{b}" for b in extra_budgets]
    out: dict[str, list[dict]] = {m: [] for m in modes}
    for mode in modes:              # warm-up: kernels, allocator, autotuning
        set_mode(tr, mode, budget)
        one_step(tr, batch)
    for r in range(repeats):
        for mode in modes:
            set_mode(tr, mode, budget)
            m = one_step(tr, batch)
            out[mode].append(m)
            log(f"  repeat {r + 1}/{repeats} {mode:12s} {m['wall_s']:.3f} s  {m['train/tokens_per_s']:,.0f} tok/s  "
                f"mfu {m.get('train/mfu', float('nan')):.3f}  padding {m['train/padding_frac']:.3f}  "
                f"micro-batches {m['train/micro_batches']:.0f}")
    return out


def _stat(vals: list[float]) -> str:
    return f"{statistics.median(vals):,.0f} ({min(vals):,.0f}-{max(vals):,.0f})"


def table(name: str, lengths: list[int], res: dict[str, list[dict]]) -> list[str]:
    from rlhf_orch.trainer.packing import balance_rows, imbalance
    base = statistics.median(m["train/tokens_per_s"] for m in res["padded"])
    tokens = sum(lengths) + PROMPT * len(lengths)
    ranks = balance_rows([n + PROMPT for n in lengths], 2)
    imb = imbalance([sum(lengths[i] + PROMPT for i in r) for r in ranks])
    rows = [f"### {name}: {len(lengths)} samples, {tokens:,} tokens per step (responses: median "
            f"{statistics.median(lengths):.0f}, mean {statistics.mean(lengths):.0f}, max {max(lengths)}); "
            f"token imbalance of 2 balanced ranks {imb:.2%}", "",
            "| mode | tokens/s median (min-max) | vs padded | MFU median | padding | micro-batches | step s median |",
            "|---|---|---|---|---|---|---|"]
    for mode, ms in res.items():
        tps = [m["train/tokens_per_s"] for m in ms]
        mfu = [m["train/mfu"] for m in ms if "train/mfu" in m]
        rows.append(f"| {mode} | {_stat(tps)} | {statistics.median(tps) / base:.2f}x | "
                    f"{statistics.median(mfu):.1%} | {ms[0]['train/padding_frac']:.1%} | {ms[0]['train/micro_batches']:.0f} | "
                    f"{statistics.median(m['wall_s'] for m in ms):.2f} |" if mfu else
                    f"| {mode} | {_stat(tps)} | {statistics.median(tps) / base:.2f}x | n/a | "
                    f"{ms[0]['train/padding_frac']:.1%} | {ms[0]['train/micro_batches']:.0f} | "
                    f"{statistics.median(m['wall_s'] for m in ms):.2f} |")
    return rows + [""]


def vocab_section(tr, batch, budgets: list[int], chunk: int, repeats: int, log) -> list[str]:
    import torch
    rows = ["### 151,936-token vocabulary (packed, varlen): full logits vs chunked LM head", "",
            "| budget (tokens per micro-batch) | logits | tokens/s median (min-max) | peak GPU memory GiB |", "|---|---|---|---|"]
    for budget in budgets:
        for c in (0, chunk):
            label = "full" if c == 0 else f"chunks of {c}"
            set_mode(tr, "packed", budget, c)
            tps, peak = [], float("nan")
            try:
                for r in range(repeats + 1):
                    if tr.device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    m = one_step(tr, batch)
                    if r:   # the first is warm-up
                        tps.append(m["train/tokens_per_s"])
                    if tr.device.type == "cuda":
                        peak = torch.cuda.max_memory_allocated() / 2**30
                log(f"  vocab budget {budget} {label}: {statistics.median(tps):,.0f} tok/s, peak {peak:.1f} GiB")
                rows.append(f"| {budget:,} | {label} | {_stat(tps)} | {peak:.1f} |")
            except torch.OutOfMemoryError:
                tr.engine.zero_grad()
                gc.collect()
                torch.cuda.empty_cache()
                log(f"  vocab budget {budget} {label}: out of memory")
                rows.append(f"| {budget:,} | {label} | out of memory | - |")
    return rows + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="Markdown results file (default: print only).")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=int, default=16384, help="Tokens per micro-batch for budget/packed.")
    ap.add_argument("--workloads", default="rl65,rl300")
    ap.add_argument("--extra-budgets", default="", help="Also run packed with these budgets (comma-separated).")
    ap.add_argument("--vocab-budgets", default="16384,32768")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--skip-vocab", action="store_true")
    ap.add_argument("--only-vocab", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, small batches: checks the script runs.")
    args = ap.parse_args(argv)
    import tempfile
    import torch
    device = "cpu" if args.dry_run else "cuda"
    shape = SHAPE_DRY if args.dry_run else SHAPE_1B
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    lines = [f"## Trainer throughput ({time.strftime('%Y-%m-%d')}, {name}, torch {torch.__version__})", "",
             f"`python bench/trainer_throughput.py {' '.join(argv if argv is not None else sys.argv[1:])}`; "
             f"1 rank, {'bf16' if device == 'cuda' else 'fp32'}, ZeRO-2, gradient checkpointing; budget {args.budget} tokens; {args.repeats} interleaved repeats.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        if not args.only_vocab:
            workloads = {k: dict(WORKLOADS[k]) for k in args.workloads.split(",")}
            if args.dry_run:
                for w in workloads.values():
                    w.update(n=16, cap=min(w["cap"], 64), median=min(w["median"], 20))
            max_len = PROMPT + max(w["cap"] for w in workloads.values()) + 8
            log(f"building the policy {shape}")
            tr = make_trainer(build_model(Path(tmp) / "small_vocab", shape, 64, max_len), device, args.budget)
            for wname, w in workloads.items():
                lengths = lognormal_lengths(w["n"], w["median"], w["sigma"], w["cap"])
                log(f"{wname}: {len(lengths)} samples, {sum(lengths) + PROMPT * len(lengths):,} tokens")
                extra = [int(b) for b in args.extra_budgets.split(",") if b]
                res = run_modes(tr, make_batch(lengths, 64), args.budget, args.repeats, log, extra)
                lines += table(wname, lengths, res)
        if args.only_vocab:
            vocab = 151936 if not args.dry_run else 4096
            log("building the 152k-vocabulary policy")
            budgets = [int(b) for b in args.vocab_budgets.split(",")] if not args.dry_run else [256]
            lengths = lognormal_lengths(*([128, 300, 0.6, 2048] if not args.dry_run else [16, 20, 0.6, 64]))
            tr = make_trainer(build_model(Path(tmp) / "big_vocab", shape, vocab, PROMPT + max(lengths) + 8),
                              device, budgets[0])
            lines = vocab_section(tr, make_batch(lengths, vocab), budgets, args.chunk if not args.dry_run else 64,
                                  max(1, args.repeats // 2), log)
        elif not args.skip_vocab:
            # Its own process: DeepSpeed keeps process-group state that a second trainer in this one trips on.
            import subprocess
            part = Path(tmp) / "vocab.md"
            cmd = [sys.executable, __file__, "--only-vocab", "--out", str(part), "--repeats", str(args.repeats),
                   "--vocab-budgets", args.vocab_budgets, "--chunk", str(args.chunk)] + (["--dry-run"] if args.dry_run else [])
            rc = subprocess.call(cmd)
            lines += part.read_text().splitlines() if rc == 0 and part.exists() else [f"(vocabulary section failed: exit {rc})", ""]
    text = "\n".join(lines)
    if not args.only_vocab:
        print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
