"""Learning parity of asynchronous rollouts (issue #27 item 4): does max_staleness 1 learn as well as on-policy?

    nice -n 19 python bench/learning_parity.py --out bench/learning_parity.md            # 6 runs x 600 steps, CPU
    python bench/learning_parity.py --steps 20 --seeds 0 --out /tmp/lp.md               # smoke of the script

Runs configs/tiny_cpu.yaml (or --config) one run at a time, in subprocesses of `python launch.py`: on-policy
(rollout.max_staleness 0) and at rollout.max_staleness 1 with the defaults as they resolve (algorithm.off_policy auto
-> decoupled, rollout.running_requests auto -> abort on hf engines), seeds --seeds each. Per run: the last-20% mean
reward (launch.py's `reward_last`, the mean of rollout/reward_mean over the last 20% of steps), the first step whose
reward reaches --reach (0.3), syncs verified, the ledger (balanced, aborted groups) and wall time. Then the staleness-1
values against the on-policy spread (min..max), median and spread, and whether each one is inside the band.

A benchmark, not CI (tests/integration/test_learning_parity.py keeps one seeded staleness-1 run against the band).
It prints the markdown table and writes it to --out, with the per-run JSON beside it (--out with .json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "metrics.plots=false"]
MODES = {"on-policy": ["rollout.max_staleness=0"], "staleness 1": ["rollout.max_staleness=1"]}


def last_frac_mean(values: list[float], frac: float = 0.2) -> float:
    k = max(1, int(len(values) * frac))
    return sum(values[-k:]) / k


def run_one(args, mode: str, seed: int) -> dict:
    name = f"parity_{mode.replace(' ', '')}_s{seed}"
    cmd = [sys.executable, str(ROOT / "launch.py"), "--config", str(ROOT / args.config),
           f"experiment.output_dir={args.runs}", f"experiment.name={name}", f"experiment.seed={seed}",
           f"experiment.steps={args.steps}", "experiment.overwrite=true", *QUIET, *MODES[mode], *args.set]
    t0 = time.time()
    log = Path(args.runs) / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    run = Path(args.runs) / name
    out = {"mode": mode, "seed": seed, "rc": rc, "wall_s": round(wall, 1), "run": str(run), "log": str(log)}
    try:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((run / "summary.json").read_text())
        config = json.loads((run / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    rewards = [r["rollout/reward_mean"] for r in records]
    led = summary.get("ledger", {})
    out.update(steps=len(rewards), last20=last_frac_mean(rewards), first20=rewards and sum(rewards[:max(1, len(rewards) // 5)]) / max(1, len(rewards) // 5),
               reach_step=next((r["step"] for r in records if r["rollout/reward_mean"] >= args.reach), None),
               verified=f"{summary.get('verified_syncs')}/{summary.get('syncs')}", status=summary.get("status"),
               balanced=led.get("balanced"), aborted=led.get("aborted"), trained=led.get("trained"),
               off_policy=config["algorithm"]["off_policy"], running_requests=config["rollout"]["running_requests"],
               max_lag=max((r.get("staleness/max_lag", 0) for r in records), default=0))
    return out


def table(results: list[dict], reach: float) -> str:
    ok = [r for r in results if "last20" in r]
    on = sorted(r["last20"] for r in ok if r["mode"] == "on-policy")
    lo, hi = (on[0], on[-1]) if on else (float("nan"), float("nan"))
    lines = [f"| mode | seed | last-20% reward | first-20% | step reward >= {reach} | inside on-policy band | "
             "off_policy | running_requests | syncs verified | ledger balanced | aborted groups | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "last20" not in r:
            lines.append(f"| {r['mode']} | {r['seed']} | failed (rc {r['rc']}: {r.get('error', '')}; log {r['log']}) "
                         "| | | | | | | | | |")
            continue
        inside = "" if r["mode"] == "on-policy" or not on else ("yes" if lo <= r["last20"] <= hi else
                                                      ("above" if r["last20"] > hi else "**below**"))
        lines.append(f"| {r['mode']} | {r['seed']} | {r['last20']:.3f} | {r['first20']:.3f} | {r['reach_step']} | {inside} | "
                     f"{r['off_policy']} | {r['running_requests']} | {r['verified']} | {r['balanced']} | {r['aborted']} | "
                     f"{r['wall_s']:.0f} |")
    lines.append("")
    for mode in MODES:
        vals = sorted(r["last20"] for r in ok if r["mode"] == mode)
        if vals:
            lines.append(f"- {mode}: last-20% reward min..max {vals[0]:.3f}..{vals[-1]:.3f}, median "
                         f"{statistics.median(vals):.3f}, spread {vals[-1] - vals[0]:.3f} ({len(vals)} seeds)")
    k1 = [r["last20"] for r in ok if r["mode"] == "staleness 1"]
    if on and k1:
        inside = sum(lo <= v <= hi for v in k1)
        lines.append(f"- staleness 1 inside the on-policy band [{lo:.3f}, {hi:.3f}]: {inside} of {len(k1)}; "
                     f"above: {sum(v > hi for v in k1)}; below: {sum(v < lo for v in k1)}; median difference "
                     f"{statistics.median(k1) - statistics.median(on):+.3f}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--reach", type=float, default=0.3, help="report the first step whose mean reward reaches this")
    p.add_argument("--runs", default="runs/learning_parity", help="parent folder of the runs")
    p.add_argument("--set", nargs="*", default=[], help="extra section.key=value overrides for every run")
    p.add_argument("--out", default="bench/learning_parity.md")
    args = p.parse_args(argv)
    results = []
    for mode in args.modes:            # sequentially: one run at a time on a shared CPU
        for seed in args.seeds:
            r = run_one(args, mode, seed)
            results.append(r)
            print(json.dumps(r), flush=True)
    flags = (f" --modes {' '.join(repr(m) for m in args.modes)}" if args.modes != list(MODES) else "") + \
        (f" --set {' '.join(args.set)}" if args.set else "")
    md = (f"`python bench/learning_parity.py --steps {args.steps} --seeds {' '.join(map(str, args.seeds))}{flags}` "
          f"({args.config}; {platform.node()}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()})\n\n"
          + table(results, args.reach))
    print(md)
    Path(args.out).write_text(md)
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=2))
    return 0 if all("last20" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
