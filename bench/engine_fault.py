"""Kill a rollout engine's process mid-run and measure the recovery (GPU or CPU).

    python bench/engine_fault.py --config configs/vllm_coloc_1gpu.yaml --kill-step 6 experiment.steps=16 ...
    python bench/engine_fault.py --config configs/tiny_cpu.yaml --engine dedicated --kill-step 10 experiment.steps=30

Runs launch.py's whole loop in this process; a thread SIGKILLs the engine actor's process (found through the
engine's own health report) once `--kill-step` steps are done. Prints the fault record from summary.json (seconds
from death to the replacement's verified first sync and to its first work, whether that sync was verified) and the per-step times and tokens/s
before, around and after the fault. `--copy-to DIR` copies metrics.jsonl, summary.json and timeline.jsonl there.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402
from actors.common import kill_descendants  # noqa: E402
from rlhf_orch.config import engine_names, load_config  # noqa: E402


def killer(run_dir: Path, suffix: str, step: int, out: dict, mid_sync: str = "", tree: bool = False) -> threading.Thread:
    """`mid_sync` "sync": after `step` steps, kill at the first moment the engine reports itself inside a weight sync
    (its health's `syncing`: from its pause to its resume; polled as fast as the calls return, since a colocated sync
    lasts milliseconds); "receive": inside the sync's receive (`receiving`), so that the other members are still in
    the transfer (a survivor blocked in a broadcast, issue #33). `tree`: the actor's child processes die with it,
    first: vLLM's engine core is a child of the rollout actor and is the member of the sync's NCCL group, so killing
    the actor alone leaves the transfer to finish (what the GPU runs of the sixth and seventh sessions saw); children
    die first, as vLLM's own kill_process_tree does."""
    def go():
        metrics, pid, actor = run_dir / "metrics.jsonl", None, None
        while True:
            if pid is None and ray.is_initialized():
                names = [n for n in ray.util.list_named_actors() if n.endswith(suffix)]
                if names:
                    try:
                        actor = ray.get_actor(names[0])
                        pid = ray.get(actor.health.remote(), timeout=60)["pid"]
                    except Exception:
                        pid = None
            if pid and metrics.exists() and len(metrics.read_text().splitlines()) >= step:
                if not mid_sync or ray.get(actor.health.remote(), timeout=60)[
                        "receiving" if mid_sync == "receive" else "syncing"]:
                    break
                continue
            time.sleep(0.05)
        out.update(pid=pid, t=time.time(), after_step=len(metrics.read_text().splitlines()))
        out["children"] = kill_descendants(pid) if tree else []   # deepest first, then the actor
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--engine", default=None, help="engine name to kill (default: the config's first)")
    p.add_argument("--kill-step", type=int, default=6)
    p.add_argument("--mid-sync", nargs="?", const="sync", default="", choices=["sync", "receive"],
                   help="kill inside a weight sync after --kill-step steps (receive: inside its transfer)")
    p.add_argument("--tree", action="store_true", help="also kill the actor's child processes (vLLM's engine core)")
    p.add_argument("--output-dir", default="/tmp/fault_runs")
    p.add_argument("--copy-to", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(args.config, args.overrides)
    engine = args.engine or engine_names(cfg)[0]
    run = Path(args.output_dir) / cfg.experiment.name
    shutil.rmtree(run, ignore_errors=True)
    info: dict = {}
    killer(run, f"-engine-{engine}", args.kill_step, info, args.mid_sync, args.tree)
    rc = launch.main(["--config", args.config, f"experiment.output_dir={args.output_dir}", *args.overrides])
    summary = json.loads((run / "summary.json").read_text())
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    print(f"\nexit {rc}; status {summary.get('status')}; steps {len(recs)}; killed {engine} (pid {info.get('pid')}) "
          f"after step {info.get('after_step')}" + (f" with its child processes {info.get('children')}" if args.tree else ""))
    for f in summary.get("faults", []):
        if "survivors_let_go_s" in f:
            print(f"mid-sync: {f.get('failed_first')} failed first; the other members let go within "
                  f"{f['survivors_let_go_s']:.3f} s: {f.get('survivors')}; serving again {f.get('to_serving_s')} s after")
        print(f"fault: {f['engine']} during {f['phase']} ({f['cause'][:100]}); {f.get('groups_requeued')} groups re-queued; "
              f"replacement {f.get('replacement')}; synced {f.get('recovery_s')} s after the death was seen; first sync "
              f"v{f.get('first_sync_version')} verified: {f.get('first_sync_verified')}")
    serving_t = (summary.get("faults") or [{}])[0].get("serving_t")
    if info.get("t") and serving_t:
        print(f"seconds from SIGKILL to the replacement serving: {serving_t - info['t']:.1f}")
    elif info.get("t"):
        print("the replacement never served in this run")
    k = info.get("after_step") or args.kill_step
    print("\n| step | step_s | generate_s | sync_s | tokens/s | engines live |\n|---|---|---|---|---|---|")
    for r in recs:
        mark = " (fault)" if r["step"] == k + 1 else ""
        print(f"| {r['step']}{mark} | {r['perf/step_s']:.2f} | {r['perf/generate_s']:.2f} | {r['sync/total_s']:.3f} | "
              f"{r['rollout/tokens'] / max(r['perf/step_s'], 1e-9):.0f} | {r.get('fault/engines_live', float('nan')):.0f} |")
    # While a dedicated replacement starts (fault_tolerance.replacement_start: background) the survivors serve alone.
    full = max((r.get("fault/engines_live", 0) for r in recs), default=0)
    alone = [r for r in recs if r["step"] > k and r.get("fault/engines_live", full) < full]
    if alone:
        rate = statistics.median(r["rollout/tokens"] / max(r["perf/step_s"], 1e-9) for r in alone)
        print(f"\n{len(alone)} steps served by fewer engines (steps {alone[0]['step']}-{alone[-1]['step']}): median "
              f"{statistics.median(r['perf/step_s'] for r in alone):.2f} s per step, {rate:.0f} tokens/s")
    before = [r["perf/step_s"] for r in recs if 2 <= r["step"] <= k]
    after = [r["perf/step_s"] for r in recs if r["step"] > k + 1]
    if before and after:
        print(f"\nmedian step_s before the fault {statistics.median(before):.2f}, after recovery "
              f"{statistics.median(after):.2f}; the fault step took {recs[k]['perf/step_s']:.1f} s")
    if args.copy_to:
        dst = Path(args.copy_to)
        dst.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "summary.json", "timeline.jsonl"):
            if (run / name).exists():
                shutil.copy(run / name, dst / name)
    return rc


if __name__ == "__main__":
    sys.exit(main())
