"""Seconds from a SIGKILL to the next completed step, per victim kind, and how each was recovered (issue #34).

    python bench/recovery.py                                  # CPU: configs/tiny_cpu.yaml, 30 steps, 6 victims
    python bench/recovery.py --config configs/vllm_coloc_1gpu.yaml --victims=-reward-0:4,-weight-sync:8,-engine-v:12,\
-rollouts:16,-trainer-0:20 reference.placement=colocated   # one GPU: one trainer rank, engine "v"

One run of launch.py's whole loop in this process. A thread SIGKILLs each victim in turn (an actor-name suffix, once
metrics.jsonl has `step` lines; a restart truncates it to its checkpoint, so each kill lands in the segment after the
one before): a trainer rank, a reward worker, the weight-sync coordinator, a rollout engine, a separate reference
worker, the rollout manager. summary.json's fault records (engines, coordinator, reward workers, the manager: replaced
in place) and run restarts (trainer ranks, reference workers) each carry `next_step_s`, the seconds from the fault to
the first step completed after it; the table prints them with how each was recovered and what it cost in steps.

Before issue #34 (2026-11-26, the same CPU config): a reward worker, the rollout manager and the coordinator each
restarted the run from its last checkpoint, 21-24 s each, with the steps since it trained again.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402   (this checkout's, also when it is not installed)

VICTIMS = [("-trainer-1", 4), ("-reward-0", 8), ("-weight-sync", 11), ("-engine-dedicated", 14),
           ("-reference-1", 18), ("-rollouts", 24)]


def pid_of(suffix: str) -> int | None:
    """The pid of the live actor whose name ends with `suffix`, from its own health report (Ray's state API is too
    slow for a short run)."""
    import ray
    names = [n for n in ray.util.list_named_actors() if n.endswith(suffix)]
    if not names:
        return None
    try:
        return ray.get(ray.get_actor(names[0]).health.remote(), timeout=30)["pid"]
    except Exception:
        return None


def paused(suffix: str) -> bool:
    """Whether the live actor named by `suffix` (an engine) reports itself paused: inside a weight sync, where no
    engine sleeps."""
    import ray
    names = [n for n in ray.util.list_named_actors() if n.endswith(suffix)]
    return bool(names) and ray.get(ray.get_actor(names[0]).health.remote(), timeout=10)["paused"]


def kill_in_turn(run: Path, plan: list, info: list, deadline_s: float = 600, poll_s: float = 0.05) -> threading.Thread:
    """SIGKILL each victim of `plan` in turn: (actor-name suffix, step) once metrics.jsonl has `step` lines, or
    (suffix, step, watch) once it has and the engine `watch` is inside a weight sync (`paused`). `info` gets a record
    per kill (or an error)."""
    import ray

    def go():
        metrics, deadline = run / "metrics.jsonl", time.time() + deadline_s
        try:
            for victim, step, *watch in plan:
                while time.time() < deadline:
                    lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
                    if lines >= step and ray.is_initialized() and (not watch or paused(watch[0])):
                        pid = pid_of(victim)
                        if pid:
                            info.append({"victim": victim, "pid": pid, "step": step, "after_step": lines,
                                         "t": time.time()})
                            os.kill(pid, signal.SIGKILL)
                            break
                    time.sleep(poll_s)
        except Exception as e:
            info.append({"error": repr(e)})

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def table(summary: dict) -> str:
    rows = [(f.get("victim") or f"engine {f.get('engine')}", f.get("recovery") or ("in place" if f.get("replacement")
            else "none"), f.get("next_step_s"), f.get("steps_redone", 0)) for f in summary.get("faults", [])]
    resumed = summary.get("resumed_from")
    rows += [(r["error"].split(":")[0][:60], "run restart" + (f" from step {r['resumed_from']}" if "resumed_from" in r
              else ""), r.get("next_step_s"), r.get("steps_redone", "since the last checkpoint"))
             for r in summary.get("run_restarts", [])]
    lines = ["| victim | recovery | seconds to the next completed step | steps redone |", "|---|---|---|---|"]
    for victim, how, secs, redone in rows:
        lines.append(f"| {victim} | {how} | {secs if secs is not None else 'n/a'} | {redone} |")
    lines.append(f"\n{summary.get('steps')} steps, status {summary.get('status')}, syncs verified "
                 f"{summary.get('verified_syncs')}/{summary.get('syncs')}, ledger balanced "
                 f"{summary.get('ledger', {}).get('balanced')}, last resume from step {resumed}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs/tiny_cpu.yaml"))
    p.add_argument("--workdir", default=None, help="where the run goes (default: a temporary folder)")
    p.add_argument("--victims", default=None, metavar="SUFFIX:STEP,...",
                   help="actor-name suffixes to kill in turn, each once metrics.jsonl has STEP lines; give it with "
                        "'=' (the suffixes start with '-'). Default: "
                        + ",".join(f"{v}:{s}" for v, s in VICTIMS))
    args, overrides = p.parse_known_args(argv)
    try:
        victims = VICTIMS if args.victims is None else [(v.rsplit(":", 1)[0], int(v.rsplit(":", 1)[1]))
                                                        for v in args.victims.split(",")]
    except (IndexError, ValueError):
        p.error(f"--victims takes SUFFIX:STEP pairs, e.g. -reward-0:4; got {args.victims}")
    out = Path(args.workdir or tempfile.mkdtemp(prefix="recovery_"))
    info: list = []
    # The default victims include a separate reference's worker; a --victims list brings its own placement.
    reference = ["reference.placement=separate", "reference.num_workers=2"] if args.victims is None else []
    killer = kill_in_turn(out / "recovery", victims, info)
    rc = launch.main(["--config", args.config, f"experiment.output_dir={out}", "experiment.name=recovery",
                      "experiment.steps=30", "trainer.checkpoint_every=3", "fault_tolerance.max_run_restarts=3",
                      *reference, "metrics.trackers=[jsonl]", "metrics.plots=false", *overrides])
    killer.join(timeout=5)
    summary = json.loads((out / "recovery" / "summary.json").read_text())
    print(f"\n## bench/recovery.py ({time.strftime('%Y-%m-%d')}, {args.config}, rc {rc})\n\nkills: "
          f"{[(k.get('victim'), k.get('step')) for k in info]}\n\n{table(summary)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
