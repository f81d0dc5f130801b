"""The end-of-run report: a few lines a person reads at the end of a run, from its summary.json and its folder.

It says how the run ended, its steps and wall time, the reward's first and last fifth, the last evaluation, how many
weight syncs were verified, the faults survived and the restarts, and where every output is (metrics, summary,
the checkpoint `latest` names, every plot written). summary.json stays the complete record; this is its digest.
No Ray, no I/O besides listing the run folder.
"""
from __future__ import annotations

from pathlib import Path


def end_of_run(summary: dict, run_dir: Path) -> list[str]:
    """The report's lines (the driver logs them one by one)."""
    status = summary.get("status", "?")
    steps, wall = summary.get("steps"), summary.get("wall_s")
    head = f"run {status}" + (f" after {steps} steps" if steps is not None else "") + (f" in {wall:.0f} s" if wall else "")
    if summary.get("error") and status != "finished":
        head += f": {summary['error']}"
    lines = [head]
    if "reward_first" in summary:
        lines.append(f"reward (mean of the first / last fifth of steps): {summary['reward_first']:.3f} -> "
                     f"{summary['reward_last']:.3f}")
    ev = summary.get("eval") or {}
    scores = {k.split("/", 1)[1]: v for k, v in ev.items() if k.startswith("eval/") and isinstance(v, (int, float))}
    if scores:   # its reward, pass@1 and (with several samples per prompt) pass@k; summary.json has the rest
        k = int(scores.get("k", 1))
        named = [("reward_mean", "reward"), ("pass@1", "pass@1")] + ([("pass@k", f"pass@{k}")] if k > 1 else [])
        shown = ", ".join(f"{name} {scores[key]:.3f}" for key, name in named if key in scores)
        prompts = f" on {int(scores['prompts'])} prompts" if "prompts" in scores else ""
        lines.append(f"last evaluation (step {ev.get('step', '?')}): {shown}{prompts}")
    if "syncs" in summary:
        lines.append(f"weight syncs verified: {summary.get('verified_syncs', 0)} of {summary['syncs']}")
    faults, restarts = summary.get("faults") or [], summary.get("run_restarts") or []
    if faults or restarts:
        replaced = sum(1 for f in faults if f.get("replacement"))
        lines.append(f"faults: {len(faults)} ({replaced} replaced in place), run restarts: {len(restarts)}; details in "
                     "summary.json")
    lines.append(f"outputs in {run_dir}:")
    for name, what in (("metrics.jsonl", "per-step metrics"), ("summary.json", "this summary, complete")):
        if (run_dir / name).exists():
            lines.append(f"  {name}: {what}")
    latest = run_dir / "checkpoints" / "latest"
    if latest.exists():
        lines.append(f"  checkpoints/{latest.read_text().strip()}: the latest checkpoint (resume=true continues from it)")
    plots = sorted(p.name for p in (run_dir / "plots").glob("*.png")) if (run_dir / "plots").is_dir() else []
    if plots:
        lines.append(f"  plots/: {', '.join(plots)}")
    return lines
