"""PNG charts of a finished (or running) training run from its metrics records.

`plot_run` takes the records of `read_jsonl(metrics.jsonl)` and writes reward, phase-time and
weight-sync charts. The reward chart gets a second panel for evaluations (eval/ reward, pass@1, pass@k) when the
records have them. The phase-time chart gets a second panel for the trainer when the records have its
throughput metrics: training tokens/s, and MFU, padding fraction and rank imbalance as fractions. Records missing a
key (or holding None/NaN for it) are skipped for that series only, so partial and resumed runs plot fine. Long runs
stay readable: past a few hundred steps a series is drawn as faint points under a rolling mean (`_trend`).

What it deliberately does not do: read files (callers pass records), show windows, or import
matplotlib at module import time -- it selects the non-interactive "Agg" backend and imports
pyplot inside `plot_run`, so importing `rlhf_orch.metrics` stays light and works headless.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Above this many steps a stacked bar chart draws tens of thousands of rectangles (slow, and
# unreadable anyway); a stacked area chart shows the same breakdown.
_MAX_BARS = 300


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _steps(records: list[dict]) -> list[tuple[int, dict]]:
    """(step, record) pairs in step order; records without a usable step use their index."""
    pairs = []
    for i, rec in enumerate(records):
        step = _finite(rec.get("step"))
        pairs.append((int(step) if step is not None else i, rec))
    pairs.sort(key=lambda p: p[0])
    return pairs


def _series(pairs: list[tuple[int, dict]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for step, rec in pairs:
        value = _finite(rec.get(key))
        if value is not None:
            xs.append(step)
            ys.append(value)
    return xs, ys


# Above this many points a per-step line with markers is an unreadable zigzag (600 syncs, a padding fraction that
# alternates between two values): the raw points go faint and a rolling mean carries the line.
_MAX_RAW = 200


def _trend(ax, xs: list, ys: list, color: str, label: str) -> list:
    """A series as a line with markers, or, past _MAX_RAW points, faint raw points under a rolling mean (a window of
    2% of the points). Returns the legend handles."""
    if len(xs) <= _MAX_RAW:
        return ax.plot(xs, ys, color=color, marker=".", label=label)
    window = max(2, round(0.02 * len(xs)))
    ax.scatter(xs, ys, s=2, alpha=0.15, color=color, linewidths=0)
    return ax.plot(xs, _moving_average(ys, window), color=color, linewidth=1.5, label=f"{label} ({window}-step mean)")


def _moving_average(ys: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points (shorter at the start, so the line begins at the first point)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _plot_reward(plt, pairs, out_dir: Path) -> Path | None:
    xs, ys = _series(pairs, "rollout/reward_mean")
    exs, eys = _series(pairs, "eval/reward_mean")
    if not xs and not exs:
        return None
    if exs:   # a second panel: the evaluations (reward, pass@1, pass@k) at the steps they were taken
        fig, (ax, eax) = plt.subplots(2, 1, figsize=(10, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(10, 5))
    try:
        if exs:
            _eval_panel(eax, pairs)
        if xs:
            window = max(1, round(0.1 * len(ys)))
            ax.scatter(xs, ys, s=10, alpha=0.4, color="C0", label="rollout reward (per step)")
            ax.plot(xs, _moving_average(ys, window), color="C0", linewidth=2,
                    label=f"rollout reward ({window}-step moving avg)")
        if exs:
            ax.plot(exs, eys, marker="o", color="C1", linewidth=1.5, label="eval reward")
        ax.set_title("Reward")
        if not exs:
            ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
        path = out_dir / "reward.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        return path
    finally:
        plt.close(fig)


def _eval_panel(ax, pairs) -> None:
    """eval/reward_mean, eval/pass@1 and eval/pass@k (k from eval/k) per evaluation; pass@k only for k > 1 (at
    k = 1 it is pass@1, which would be drawn twice under one name)."""
    _, ks = _series(pairs, "eval/k")
    k = str(int(ks[-1])) if ks else "k"   # records without eval/k keep the generic name
    series = [("eval/reward_mean", "eval reward"), ("eval/pass@1", "pass@1")] + ([("eval/pass@k", f"pass@{k}")]
                                                                                 if k != "1" else [])
    for i, (key, label) in enumerate(series):
        fx, fy = _series(pairs, key)
        if fx:
            ax.plot(fx, fy, marker="o", color=f"C{i + 1}", label=label)
    ax.set_title("Evaluation")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")


_NOT_PHASES = {"perf/step_s", "perf/trainer_idle_s"}   # seconds that are not a phase of the step (no stacked bar)


def _plot_phase_times(plt, pairs, out_dir: Path) -> Path | None:
    keys = sorted({k for _, rec in pairs for k in rec
                   if k.startswith("perf/") and k.endswith("_s") and k not in _NOT_PHASES})
    step_xs, step_ys = _series(pairs, "perf/step_s")
    rows = [(step, rec) for step, rec in pairs if any(_finite(rec.get(k)) is not None for k in keys)]
    if not rows and not step_xs:
        return None
    xs = [step for step, _ in rows]
    trainer = any(k in rec for _, rec in pairs for k in _TRAINER_KEYS)
    if trainer:
        fig, (ax, tax) = plt.subplots(2, 1, figsize=(10, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(10, 5))
    try:
        if trainer:
            _trainer_panel(tax, pairs)
        bottoms = [0.0] * len(rows)
        heights_by_key = {k: [(_finite(rec.get(k)) or 0.0) for _, rec in rows] for k in keys}
        labels = [k[len("perf/"):-len("_s")] for k in keys]
        if len(rows) <= _MAX_BARS:
            diffs = [b - a for a, b in zip(xs, xs[1:]) if b > a]
            width = 0.8 * (min(diffs) if diffs else 1)
            for key, label in zip(keys, labels):
                heights = heights_by_key[key]
                ax.bar(xs, heights, width=width, bottom=bottoms, label=label)
                bottoms = [b + h for b, h in zip(bottoms, heights)]
        elif keys:
            ax.stackplot(xs, *[heights_by_key[k] for k in keys], labels=labels, alpha=0.8)
        if step_xs:
            ax.plot(step_xs, step_ys, color="black", linewidth=1.5, marker="." if len(step_xs) <= _MAX_BARS else None,
                    label="step (total)")
        ax.set_title("Time per phase")
        if not trainer:
            ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        path = out_dir / "phase_times.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        return path
    finally:
        plt.close(fig)


_TRAINER_KEYS = ("train/tokens_per_s", "train/mfu", "train/padding_frac", "train/rank_imbalance")


def _trainer_panel(ax, pairs) -> None:
    """Training tokens/s (left axis) and the fractions MFU, padding, rank imbalance (right axis)."""
    handles = []
    xs, ys = _series(pairs, "train/tokens_per_s")
    if xs:
        handles += _trend(ax, xs, ys, "C0", "train tokens/s")
    ax.set_ylabel("tokens/s", color="C0")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    for i, key in enumerate(_TRAINER_KEYS[1:]):
        fx, fy = _series(pairs, key)
        if fx:
            handles += _trend(ax2, fx, fy, f"C{i + 1}", key[len("train/"):])
    ax2.set_ylabel("fraction")
    ax2.set_ylim(bottom=0)
    ax.set_title("Trainer throughput")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.08, 1.0))


def _sync_seconds(pairs) -> tuple[list[int], list[float], str]:
    """"sync/total_s" per step, or the sum of the record's "sync/*_s" keys where it is absent."""
    xs, ys = [], []
    for step, rec in pairs:
        total = _finite(rec.get("sync/total_s"))
        if total is None:
            parts = [_finite(v) for k, v in rec.items() if k.startswith("sync/") and k.endswith("_s")]
            parts = [p for p in parts if p is not None]
            total = sum(parts) if parts else None
        if total is not None:
            xs.append(step)
            ys.append(total)
    return xs, ys, "sync time (s)"


def _plot_sync(plt, pairs, out_dir: Path) -> Path | None:
    if not any(k.startswith("sync/") for _, rec in pairs for k in rec):
        return None
    txs, tys, tlabel = _sync_seconds(pairs)
    gxs, gys = _series(pairs, "sync/gbps")
    if not txs and not gxs:
        return None
    fig, ax = plt.subplots(figsize=(10, 5))
    try:
        handles = []
        if txs:
            handles += _trend(ax, txs, tys, "C0", tlabel)
        ax.set_xlabel("step")
        ax.set_ylabel("seconds", color="C0")
        if gxs:
            ax2 = ax.twinx()  # throughput has different units and scale than duration
            handles += _trend(ax2, gxs, gys, "C1", "throughput (GB/s)")
            ax2.set_ylabel("GB/s", color="C1")
        ax.set_title("Weight sync")
        ax.grid(alpha=0.3)
        ax.legend(handles=handles, loc="best")
        path = out_dir / "sync.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        return path
    finally:
        plt.close(fig)


def plot_run(records: list[dict], out_dir: str | os.PathLike) -> list[Path]:
    """Write reward.png, phase_times.png and sync.png into `out_dir`; return the paths written.

    A chart whose series are all absent from `records` is not written (no empty PNGs), so the
    returned list can be shorter than three.
    """
    import matplotlib

    matplotlib.use("Agg")  # headless clusters have no display; must precede importing pyplot
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs = _steps([r for r in records if isinstance(r, dict)])
    written = []
    for plot in (_plot_reward, _plot_phase_times, _plot_sync):
        path = plot(plt, pairs, out)
        if path is not None:
            written.append(path)
    logger.debug("wrote %d plot(s) to %s", len(written), out)
    return written
