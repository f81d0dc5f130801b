"""Summarise a finished run folder as markdown: learning, sync verification, mismatch, per-phase
times, colocation hand-overs and GPU memory per device (medians over steps, after the first step).

    python bench/summarize_run.py runs/vllm_coloc [more run folders...]

Reads <run>/metrics.jsonl and <run>/summary.json only; prints, writes nothing.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _median(records, key):
    vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else float("nan")


def summarize(run: Path) -> str:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    if not records:
        return f"### {run.name}\n\n- no step finished\n"
    steady = records[1:] or records
    out = [f"### {run.name}", "",
           f"- steps: {len(records)}; reward first 20%: {summary.get('reward_first', float('nan')):.3f}, "
           f"last 20%: {summary.get('reward_last', float('nan')):.3f}; wall {summary.get('wall_s', '?')} s",
           f"- syncs: {summary.get('syncs')} of which checksum-verified: {summary.get('verified_syncs')}; "
           f"transports: {summary.get('transports')}",
           f"- engine vs trainer logprob |diff|: mean over steps {_median(records, 'rollout/logprob_diff_mean'):.4f} "
           f"(median), worst step mean {max(r['rollout/logprob_diff_mean'] for r in records):.4f}, "
           f"worst token {max(r['rollout/logprob_diff_max'] for r in records):.4f}", "",
           "| metric | median | max |", "|---|---|---|"]
    keys = sorted({k for r in steady for k in r if k.startswith(("perf/", "sync/", "colocate/", "mem/", "offload/"))
                   and (k.endswith("_s") or k.endswith("_gb") or k.endswith("gbps"))})
    for k in keys:
        vals = [r[k] for r in steady if isinstance(r.get(k), (int, float))]
        if vals:
            out.append(f"| {k} | {statistics.median(vals):.4g} | {max(vals):.4g} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(summarize(Path(arg)))
