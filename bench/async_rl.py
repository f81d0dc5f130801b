"""Whole-step throughput of streaming rollouts: the synchronous loop vs max_staleness 1 vs 1 + partial rollouts vs 1
with every weight sync on the trainer's path (k1s: weight_sync.overlap off; k1 and k1p overlap it, the default) vs 1
with running requests aborted at each sync (k1a; k1's running_requests auto waits for them, its sync being overlapped);
k1pl is k1p with rollout.partial_extra_lag 1 (a late group may be trained a step later, its first tokens two versions
old; k1p's default 0 keeps every token within max_staleness, so a step waits for its longest group); syncf / k1f
are sync / k1 with rollout.final_outputs: true (vLLM hands back each request only at its end, as the default does
without partial rollouts); syncd / k1d stream every token (final_outputs: false).

    python bench/async_rl.py --out bench/RESULTS_async.md     # nvidia-h200-x2: trainer GPU 0, streaming vLLM GPU 1
    python bench/async_rl.py --colocated                      # one GPU: vLLM beside the trainer, CUDA IPC sync
    python bench/async_rl.py --dry-run                        # CPU smoke of the script (tiny model, hf engine)

One cluster (launch.py's own actors and `rl_step`), one workload, the modes run in interleaved segments
(sync, k1, k1p, k1s, sync, k1, ...), each `--warmup` steps (pipeline fill, not measured) + `--steps` measured.
Workload: a Llama-3.2-1B-shaped policy with random bf16 weights, `--prompts` x `--group` samples per step, response
lengths per prompt from a lognormal (median `--median`, sigma `--sigma`, capped at `--cap`) enforced with
per-request max_tokens and ignore_eos. The dataset is exactly one step of prompts whose lengths are the lognormal's
quantiles, so every step of every mode generates the same multiset of lengths (the tail included).

Per mode: steps/s and trained tokens/s (median over segments, and the spread), each GPU's idle fraction (trainer: not
training, so waiting for batches, pauses and syncs is idle; engine: no generate call in flight), and the share of the
sync on the critical path (all of it when the next step's groups were dispatched after it, as in the synchronous loop;
otherwise the part that ran after the next step's batch was ready, i.e. while the trainer could have trained).

The bound (issue #27): a step cannot take less than max(its tokens at the engines' steady throughput, train + the sync's
unhidden part). Steady throughput is measured in the same run: the most tokens per second of engine busy time any
segment reached (where the engines were kept loaded, k1p usually). Each mode is reported against its own bound (its train
time and unhidden sync). Targets: k1 >= 0.9 of its bound, k1p >= k1, trainer idle < 10% of its step. That bound has
no latency term: a step's batch waits for its longest group, L (the sync mode's generate), and at staleness k its
groups are admitted about k train steps ahead, so "x latency bound" also counts L / k seconds per step.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402
from driver.cluster import Cluster  # noqa: E402
from driver.ray_session import stop_ray  # noqa: E402
from bench.shapes import SHAPES  # noqa: E402
from rlhf_orch.config import load_config  # noqa: E402
from rlhf_orch.data import PromptDataset, load_rows  # noqa: E402
from rlhf_orch.engines import HOOKS_ENV  # noqa: E402
from rlhf_orch.metrics.timeline import Timeline  # noqa: E402
from rlhf_orch.models import TinyModelSpec, build_tokenizer, ensure_model_dir  # noqa: E402
from rlhf_orch.models.tiny import CHARS  # noqa: E402

MODES = {"sync": dict(max_staleness=0, partial_rollouts=False), "k1": dict(max_staleness=1, partial_rollouts=False),
         "k1p": dict(max_staleness=1, partial_rollouts=True),
         # k1p whose late groups may be trained a step later (rollout.partial_extra_lag 1): their first tokens lag 2
         "k1pl": dict(max_staleness=1, partial_rollouts=True, partial_extra_lag=1),
         # two train steps of cover for a step's longest responses (the latency term k1 cannot hide, RESULTS.md)
         "k2": dict(max_staleness=2, partial_rollouts=False), "k2p": dict(max_staleness=2, partial_rollouts=True),
         # k1 with every sync on the trainer's path (weight_sync.overlap off): what the overlap buys, same run
         "k1s": dict(max_staleness=1, partial_rollouts=False, overlap=False),
         # k1 whose syncs abort the running requests and re-queue them (running_requests auto waits where, as in k1,
         # the sync overlaps training; k1s aborts: its sync is on the trainer's path)
         "k1a": dict(max_staleness=1, partial_rollouts=False, running_requests="abort"),
         # rollout.final_outputs: vLLM hands back each request at its end (FINAL_ONLY), nothing per token on its loop
         # (the default without partial rollouts since the twelfth session); syncd / k1d stream every token's delta
         "syncf": dict(max_staleness=0, partial_rollouts=False, final_outputs=True),
         "k1f": dict(max_staleness=1, partial_rollouts=False, final_outputs=True),
         "syncd": dict(max_staleness=0, partial_rollouts=False, final_outputs=False),
         "k1d": dict(max_staleness=1, partial_rollouts=False, final_outputs=False)}


def reward(response: str, row: dict) -> float:
    """A deterministic 0/1 reward from the text (random-weight models write noise; GRPO needs some spread)."""
    return float(zlib.crc32((row["prompt"] + response).encode()) % 2)


def lengths(n: int, median: float, sigma: float, cap: int) -> list[int]:
    z = [statistics.NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
    return [max(1, min(cap, round(median * math.exp(sigma * x)))) for x in z]


def build(args, out: Path):
    """Model folder, dataset rows and config for the run."""
    import random
    tok = build_tokenizer()
    if args.dry_run:
        model_path = str(ensure_model_dir("tiny-llama", TinyModelSpec(), out / "models", seed=0))
    else:
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig
        model_path = str(out / "llama-3.2-1b-random")
        if not (Path(model_path) / "config.json").exists():
            cfg = LlamaConfig(**SHAPES["llama-3.2-1b"], max_position_embeddings=args.cap + 64, bos_token_id=1,
                              eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16", architectures=["LlamaForCausalLM"])
            torch.manual_seed(0)
            with torch.device("cuda"):
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
            model.save_pretrained(model_path)
            tok.save_pretrained(model_path)
            del model
            torch.cuda.empty_cache()
    rng = random.Random(0)
    letters = [c for c in CHARS if c.strip()]
    rows = [{"prompt": "".join(rng.choice(letters) for _ in range(rng.randint(8, 16))), "max_new_tokens": n,
             "ignore_eos": True} for n in lengths(args.prompts, args.median, args.sigma, args.cap)]
    data = out / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    total = len(args.modes.split(",")) * args.segments * (args.warmup + args.steps)
    placement = "colocated" if args.colocated else "dedicated"
    if args.dry_run and args.decode_delay:   # the hf engine's test hook (rlhf_orch.engines.hooks_from_env)
        os.environ[HOOKS_ENV] = json.dumps({"engines.0": {"decode_delay_s": args.decode_delay}})
    engine = {"kind": "hf", "name": "hf", "placement": placement} if args.dry_run else {
        "kind": "vllm", "name": "vllm", "placement": placement, "streaming": True,
        "gpu_memory_utilization": 0.45 if args.colocated else 0.85,
        "max_model_len": args.cap + 64, "kv_cache_memory_gb": args.kv_cache_gb}   # bounds the blocks a cache reset walks
    engine["sampling"] = {"temperature": 1.0, "max_new_tokens": args.cap}
    cfg = {
        "experiment": {"name": "async_rl", "output_dir": str(out), "steps": total, "log_samples_every": 0},
        "model": {"path": "builtin:tiny-llama" if args.dry_run else model_path,
                  "dtype": "float32" if args.dry_run else "bfloat16"},
        "data": {"source": str(data), "prompts_per_step": args.prompts, "max_prompt_tokens": 32},
        "algorithm": {"name": "grpo", "group_size": args.group, "kl_coef": 0.0},
        "trainer": {"num_ranks": 1, "device": "cpu" if args.dry_run else "cuda", "zero_stage": 0 if args.dry_run else 1,
                    "bf16": not args.dry_run, "lr": 1e-6, "micro_batch_size": args.micro_batch, "export_hf": False},
        "engines": [engine],
        # validated once with the most demanding mode; modes switch per segment (Cluster.start_rollouts overrides)
        "rollout": {"max_staleness": 1, "partial_rollouts": True, "dispatch_groups": args.dispatch_groups},
        "weight_sync": {"bucket_size_mb": 1 if args.dry_run else 512},
        "reward": {"function": "bench.async_rl:reward", "num_workers": 2},
        "metrics": {"trackers": ["jsonl"], "ray_metrics": False, "plots": True},
        "ray": {"num_cpus": 2} if args.dry_run else {},
    }
    path = out / "async_rl.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return model_path, path


def analyze(cluster, mode: str, recs: list[dict], windows: list[tuple[float, float]]) -> dict:
    t0, t1 = windows[0][0], windows[-1][1]
    wall = t1 - t0
    tl = Timeline(0.0)
    tl.extend(cluster.timeline.events)
    engines = sorted({e["actor"] for e in cluster.timeline.events if e["actor"].startswith("engine:")})
    syncs = {e["version"]: (e["start"], e["end"]) for e in cluster.timeline.events
             if e["actor"] == "weight-sync" and "version" in e}
    crit, total, share = 0.0, 0.0, None
    overlapped = [r for r in recs if r.get("sync/overlapped")]
    if overlapped:   # weight_sync.overlap: the trainer's sync phase (staging, waiting for the previous transfer) is
        crit = sum(r["perf/sync_s"] for r in overlapped)   # all it waited; the transfers ran under its next steps
        total = sum(syncs[r["step"]][1] - syncs[r["step"]][0] for r in overlapped if r["step"] in syncs)
        share = sum(r.get("sync/finish_wait_s", 0.0) for r in overlapped) / total if total else float("nan")
    for a, b in zip(recs, recs[1:]) if not overlapped else ():   # sync of step a vs when step b's batch was ready
        s0, s1 = syncs[a["step"]]
        if b["perf/batch_dispatch_t"] >= s1:   # step b's groups needed this sync (max_staleness 0): all of it waits
            crit += s1 - s0
        else:                                  # only the part after step b's batch was ready held the trainer back
            crit += max(0.0, s1 - max(s0, b["perf/batch_ready_t"]))
        total += s1 - s0
    med = lambda k: statistics.median(r[k] for r in recs)
    return {"mode": mode, "steps": len(recs), "wall_s": wall, "steps_per_s": len(recs) / wall,
            "tokens_per_s": sum(r["rollout/tokens"] for r in recs) / wall,
            "tokens_per_step": statistics.mean(r["rollout/tokens"] for r in recs),
            # busy = training only: waiting for a batch, a pause or a sync is idle (the sync spans used to count)
            "trainer_busy": tl.busy_fraction("trainer", t0, t1),
            "trainer_idle_frac": statistics.median(r["perf/trainer_idle_frac"] for r in recs),
            "engine_busy_s": statistics.mean(tl.busy_fraction(e, t0, t1) for e in engines) * wall if engines else 0.0,
            "unhidden_sync_s": crit / len(recs),
            "engine_busy": statistics.mean(tl.busy_fraction(e, t0, t1) for e in engines) if engines else 0.0,
            # the part of the transfers the trainer waited for (overlapped: only the wait for the previous one)
            "sync_critical_share": share if share is not None else crit / total if total else float("nan"),
            "generate_s": med("perf/generate_s"), "train_s": med("perf/train_s"), "sync_s": med("perf/sync_s"),
            "step_s": med("perf/step_s"), "lag1_frac": sum(r.get("staleness/lag_1", 0.0) for r in recs) / sum(r["rollout/tokens"] for r in recs),
            # tokens two or more versions old: at k1p, the first tokens of the late groups partial_extra_lag lets through
            "lag2_frac": sum(v for r in recs for k, v in r.items() if k.startswith("staleness/lag_") and
                             int(k.rsplit("_", 1)[1]) >= 2) / sum(r["rollout/tokens"] for r in recs),
            "spanning_frac": statistics.mean(r["staleness/spanning_frac"] for r in recs)}


def table(per_mode: dict[str, list[dict]], args) -> str:
    med = lambda xs: statistics.median(xs)
    sync = per_mode.get("sync")
    bound = None
    if sync:
        g, t, s = (med([x[k] for x in sync]) for k in ("generate_s", "train_s", "sync_s"))
        bound = (g + t + s) / max(g, t + s)
    base = med([x["steps_per_s"] for x in sync]) if sync else None
    where = "colocated on one GPU (CUDA IPC)" if args.colocated else "trainer GPU 0, vLLM GPU 1 (NCCL)"
    lines = [f"{where}; workload: {args.prompts} prompts x {args.group}, lognormal lengths median {args.median} sigma {args.sigma} "
             f"cap {args.cap}, {args.segments} segments x ({args.warmup} warm-up + {args.steps} measured steps) per mode, interleaved",
             "", "| mode | steps/s (median; min-max) | tokens/s | x sync | x its bound (bound steps/s) | x latency bound | "
             "trainer GPU idle "
             "(per-step metric) | engine GPU idle | "
             "sync on critical path | gen / train / sync s (median) | lag-1 tokens | lag-2+ tokens | spanning |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    # A step's batch is done when its longest group is: L, the sync mode's generate (from an idle engine). At
    # staleness k a step's groups are admitted k train steps ahead, so no step is shorter than L / k (RESULTS.md).
    latency = med([x["generate_s"] for x in sync]) if sync else float("nan")
    # The engines' steady throughput: the most tokens per second of engine busy time any segment reached.
    steady = max((x["tokens_per_step"] * x["steps"] / x["engine_busy_s"] for xs in per_mode.values() for x in xs
                  if x["engine_busy_s"] > 0), default=float("nan"))
    for mode, xs in per_mode.items():
        sps = [x["steps_per_s"] for x in xs]
        speed = med(sps) / base if base else float("nan")
        own = max(med([x["tokens_per_step"] for x in xs]) / steady,
                  med([x["train_s"] for x in xs]) + med([x["unhidden_sync_s"] for x in xs]))   # seconds per step
        # the train steps a step's groups have: max_staleness, plus partial_extra_lag with partial rollouts
        spec = MODES.get(mode, {})
        k = spec.get("max_staleness", 0) + (spec.get("partial_extra_lag", 0) if spec.get("partial_rollouts") else 0)
        lat = med(sps) * max(own, latency / k) if k else float("nan")
        lines.append(f"| {mode} | {med(sps):.4f}; {min(sps):.4f}-{max(sps):.4f} | {med([x['tokens_per_s'] for x in xs]):.0f} | "
                     f"{speed:.3f} | {med(sps) * own:.3f} ({1 / own:.4f}) | {lat:.3f} | "
                     f"{1 - med([x['trainer_busy'] for x in xs]):.2f} "
                     f"({med([x['trainer_idle_frac'] for x in xs]):.2f}) | "
                     f"{1 - med([x['engine_busy'] for x in xs]):.2f} | {med([x['sync_critical_share'] for x in xs]):.2f} | "
                     f"{med([x['generate_s'] for x in xs]):.2f} / {med([x['train_s'] for x in xs]):.2f} / "
                     f"{med([x['sync_s'] for x in xs]):.3f} | {med([x['lag1_frac'] for x in xs]):.2f} | "
                     f"{med([x.get('lag2_frac', 0.0) for x in xs]):.3f} | "
                     f"{med([x['spanning_frac'] for x in xs]):.2f} |")
    lines += ["", f"bound per mode: max(tokens per step / {steady:.0f} tokens/s (the engines' steady throughput, measured "
              "here), train + the sync's unhidden part); targets: k1 >= 0.9 of its bound, k1p >= k1, trainer idle < 0.10",
              f"latency bound at staleness k: the same, and at least L / k seconds per step, L = {latency:.2f} s (the sync "
              "mode's generate: a step's longest group from an idle engine); k counts partial_extra_lag with partial "
              "rollouts (k1pl: 2)"]
    if bound:
        lines += [f"(the old ideal bound from the sync mode's phases, (generate + train + sync) / max(generate, train + sync) = "
                  f"{bound:.3f}x sync)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU smoke: tiny model, hf engine, tiny workload")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--median", type=float, default=300)
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--cap", type=int, default=2048)
    p.add_argument("--modes", default="sync,k1,k1p,k1s")
    p.add_argument("--segments", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="measured steps per segment (default 5; dry run 2)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--kv-cache-gb", type=float, default=40.0)
    p.add_argument("--colocated", action="store_true", help="one GPU: vLLM beside the trainer (both resident, CUDA IPC "
                   "sync); without it the trainer has GPU 0 and vLLM GPU 1 (NCCL)")
    p.add_argument("--dispatch-groups", type=int, default=8, help="groups per generate call (streaming engines take many)")
    p.add_argument("--decode-delay", type=float, default=0.0, help="dry run: seconds per decode step of the hf engine "
                   "(generation slower than training, as on GPUs)")
    p.add_argument("--workdir", default="/tmp/async_rl_bench")
    p.add_argument("--out", default=None, help="append the table to this markdown file")
    p.add_argument("--copy-to", default=None, help="copy timeline, metrics and plot here at the end (e.g. $OUT)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.prompts, args.group, args.median, args.cap = 8, 4, 6, 24
        args.steps = 2 if args.steps is None else args.steps
        args.micro_batch, args.dispatch_groups = 4, 2
    args.steps = 5 if args.steps is None else args.steps
    import logging
    logging.basicConfig(level=os.environ.get("RLHF_ORCH_LOG_LEVEL", "WARNING"))
    from transformers import AutoTokenizer

    out = Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    t_build = time.time()
    model_path, cfg_path = build(args, out)
    cfg = load_config(cfg_path)
    tok = AutoTokenizer.from_pretrained(model_path)
    dataset = PromptDataset(load_rows(cfg.data.source), tok, cfg.data.max_prompt_tokens, 0)
    print(f"model + data ready in {time.time() - t_build:.0f}s", flush=True)
    cluster = Cluster.start(cfg, out / "async_rl", model_path, dataset, tok.pad_token_id)
    per_mode: dict[str, list[dict]] = {m: [] for m in args.modes.split(",")}
    try:
        cluster.sync(0)
        step = 1
        print(f"cluster up and synced at {time.time() - t_build:.0f}s", flush=True)
        for seg in range(args.segments):
            for mode in per_mode:
                n = args.warmup + args.steps
                mode_args = dict(MODES[mode])
                ws = cluster.cfg.weight_sync.model_copy(update={"overlap": mode_args.pop("overlap", "auto")})
                cluster.cfg = cluster.cfg.model_copy(update={"weight_sync": ws})   # read at each step's sync
                cluster.start_rollouts(step, step - 1, None, last_step=step + n - 1, **mode_args)
                recs, windows = [], []
                for s in range(step, step + n):
                    a = time.time() - cluster.timeline.t0
                    m, _ = launch.rl_step(cluster, cfg, s)
                    windows.append((a, time.time() - cluster.timeline.t0))
                    recs.append({"step": s, **m})
                    cluster.outputs.sinks.write(s, {**m, "bench/mode": float(list(MODES).index(mode))})
                    print(f"seg {seg} {mode:4s} step {s}: {m['perf/step_s']:.2f}s (wait {m['perf/generate_s']:.2f} "
                          f"train {m['perf/train_s']:.2f} sync {m['perf/sync_s']:.3f}, engines paused "
                          f"{m.get('sync/pause_s', float('nan')):.3f} of it) tokens {m['rollout/tokens']:.0f} "
                          f"lag1 {m.get('staleness/lag_1', 0):.0f} spanning {m['staleness/spanning_frac']:.2f}"
                          + "".join(f" {k[11:]} {v:.3f}" for k, v in sorted(m.items()) if k.startswith("sync/pause_")
                                    and k != "sync/pause_s"), flush=True)
                step += n
                per_mode[mode].append(analyze(cluster, mode, recs[args.warmup:], windows[args.warmup:]))
                print(json.dumps(per_mode[mode][-1]), flush=True)
                (out / "async_rl.json").write_text(json.dumps(per_mode, indent=1))   # a run cut short keeps its segments
        text = table(per_mode, args)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(f"\n## bench/async_rl.py ({time.strftime('%Y-%m-%d')})\n\n{text}\n")
        (out / "async_rl.json").write_text(json.dumps(per_mode, indent=1))
    finally:
        cluster.close([], None)
        stop_ray()
        if args.copy_to:   # the device machine returns only what is under $OUT
            import shutil
            run = out / "async_rl"
            Path(args.copy_to).mkdir(parents=True, exist_ok=True)
            for f in (run / "timeline.jsonl", run / "metrics.jsonl", run / "plots" / "timeline.png", out / "async_rl.json"):
                if f.exists():
                    shutil.copy(f, Path(args.copy_to) / f.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
