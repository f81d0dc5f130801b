"""Who-was-busy-when: a recorder of (actor, phase, start, end) spans, and charts of a run's timing.

`Timeline` records spans relative to its `t0`, appends them to JSONL and computes an actor's busy
fraction; `plot_timeline` draws spans as a Gantt chart; `plot_staleness` draws the per-step token
share at each policy lag ("staleness/lag_N" metrics) and the importance-weight mean/max.

What it deliberately does not do: talk to Ray or collect spans from remote actors (callers pass
their own absolute `time.time()` stamps to `add`, or already-relative events to `extend`), or
import matplotlib at module import time -- the plot functions select "Agg" and import pyplot.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from rlhf_orch.metrics.plots import _MAX_BARS, _finite, _series, _steps
from rlhf_orch.metrics.sinks import read_jsonl as _read_jsonl

logger = logging.getLogger(__name__)

_PHASE_COLOURS = {"generate": "C0", "score": "C1", "reward": "C1", "train": "C2", "sync": "C3",
                  "checkpoint": "C4", "wait": "#c8c8c8", "eval": "C5"}
_EXTRA_COLOURS = ["C6", "C8", "C9", "#8c564b", "#17becf", "#bcbd22", "#393b79", "#637939", "#843c39"]
_ACTOR_GROUPS = ("driver", "trainer", "engine", "reward")
_LAG_KEY = re.compile(r"^staleness/lag_(\d+)$")


class Timeline:
    """Thread-safe list of spans; times are stored as seconds since `t0` (default: construction)."""

    def __init__(self, t0: float | None = None):
        self.t0 = time.time() if t0 is None else float(t0)
        self._events: list[dict] = []
        self._lock = threading.Lock()

    def add(self, actor: str, phase: str, start: float, end: float, **extra) -> None:
        """Record a span given absolute wall-clock seconds (`time.time()`)."""
        self.extend([{"actor": actor, "phase": phase, "start": start - self.t0, "end": end - self.t0, **extra}])

    @contextmanager
    def span(self, actor: str, phase: str, **extra):
        """Record the time spent inside the `with` block (also when it raises)."""
        start = time.time()
        try:
            yield
        finally:
            self.add(actor, phase, start, time.time(), **extra)

    def extend(self, events) -> None:
        """Add events whose "start"/"end" are already relative to this timeline's `t0`."""
        checked = [{**ev, "actor": str(ev["actor"]), "phase": str(ev["phase"]),
                    "start": float(ev["start"]), "end": float(ev["end"])} for ev in events]
        bad = next((ev for ev in checked if ev["end"] < ev["start"]), None)
        if bad is not None:
            raise ValueError(f"event ends before it starts: {bad!r}")
        with self._lock:
            self._events.extend(checked)

    @property
    def events(self) -> list[dict]:
        """Copies of the recorded events, in recording order."""
        with self._lock:
            return [dict(ev) for ev in self._events]

    def write_jsonl(self, path: str | os.PathLike) -> int:
        """Append every event as one JSON line to `path`; return how many were written."""
        events = self.events
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(ev) + "\n" for ev in events)
        return len(events)

    read_jsonl = staticmethod(_read_jsonl)  # events written by write_jsonl; unreadable lines are skipped

    def busy_fraction(self, actor: str, start: float | None = None, end: float | None = None) -> float:
        """Share of [start, end] (relative seconds) covered by `actor`'s spans, overlaps counted once.

        The window defaults to the extent of the whole timeline (earliest start to latest end of
        any actor). An empty window, or no events at all, gives 0.0.
        """
        events = self.events
        lo = min((ev["start"] for ev in events), default=0.0) if start is None else float(start)
        hi = max((ev["end"] for ev in events), default=0.0) if end is None else float(end)
        if hi <= lo:
            return 0.0
        clipped = ((max(ev["start"], lo), min(ev["end"], hi)) for ev in events if ev["actor"] == actor)
        busy, cur_s, cur_e = 0.0, lo, lo
        for s, e in sorted(c for c in clipped if c[1] > c[0]):
            if s > cur_e:  # a gap: close the merged run so far
                busy, cur_s = busy + cur_e - cur_s, s
            cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        return busy / (hi - lo)


def _actor_key(actor: str):
    group = next((i for i, g in enumerate(_ACTOR_GROUPS) if actor.startswith(g)), len(_ACTOR_GROUPS))
    return (group, [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", actor)])  # engine_2 < engine_10


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless clusters have no display; must precede importing pyplot
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(events: list[dict], path: str | os.PathLike) -> Path | None:
    """Gantt chart of `events` (relative seconds): one row per actor, one colour per phase.

    Malformed events are skipped. Without any usable event nothing is written and None is returned.
    """
    spans: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for ev in events:
        s, e = _finite(ev.get("start")), _finite(ev.get("end"))
        if s is not None and e is not None and e >= s and "actor" in ev and "phase" in ev:
            spans.setdefault((str(ev["actor"]), str(ev["phase"])), []).append((s, e - s))
    if not spans:
        return None
    actors = sorted({a for a, _ in spans}, key=_actor_key)
    known = list(_PHASE_COLOURS)  # known phases in a fixed order, then the rest alphabetically
    phases = sorted({p for _, p in spans}, key=lambda p: (known.index(p) if p in known else len(known), p))
    unknown = [p for p in phases if p not in _PHASE_COLOURS]
    colours = {p: _PHASE_COLOURS.get(p) or _EXTRA_COLOURS[unknown.index(p) % len(_EXTRA_COLOURS)] for p in phases}
    out, plt = Path(path), _pyplot()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(14, 1.5 + 0.45 * len(actors)))
    try:
        row = {a: i for i, a in enumerate(actors)}
        for (actor, phase), xranges in spans.items():  # one collection per actor/phase keeps big runs fast
            ax.broken_barh(xranges, (row[actor] - 0.4, 0.8), facecolors=colours[phase], linewidth=0)
        ax.set_yticks(range(len(actors)), actors)
        ax.set_ylim(len(actors) - 0.5, -0.5)  # first actor (driver) on top
        ax.set(xlabel="seconds since start", title="Timeline")
        ax.grid(alpha=0.3, axis="x")
        handles = [plt.Rectangle((0, 0), 1, 1, color=colours[p], label=p) for p in phases]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.savefig(out, dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)
    logger.debug("wrote timeline of %d actor(s) to %s", len(actors), out)
    return out


def plot_staleness(records: list[dict], path: str | os.PathLike) -> Path | None:
    """Stacked per-step share of tokens at each policy lag, plus importance weights where recorded.

    Returns None without writing when no record holds a "staleness/lag_N" token count.
    """
    pairs = _steps([r for r in records if isinstance(r, dict)])
    lags = sorted({int(m.group(1)) for _, rec in pairs for k in rec if (m := _LAG_KEY.match(k))})
    counts = [(step, [max(_finite(rec.get(f"staleness/lag_{lag}")) or 0.0, 0.0) for lag in lags])
              for step, rec in pairs]
    rows = [(step, [c / sum(cs) for c in cs]) for step, cs in counts if sum(cs) > 0]  # steps without tokens skipped
    if not rows:
        return None
    is_keys = [k for k in ("train/is_weight_mean", "train/is_weight_max")
               if any(_finite(rec.get(k)) is not None for _, rec in pairs)]
    out, plt = Path(path), _pyplot()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2 if is_keys else 1, 1, figsize=(10, 7 if is_keys else 4.5), sharex=True, squeeze=False)
    try:
        ax, xs, cmap = axes[0][0], [s for s, _ in rows], plt.get_cmap("viridis")
        shares = [[sh[i] for _, sh in rows] for i in range(len(lags))]
        colours = [cmap(i / max(1, len(lags) - 1)) for i in range(len(lags))]  # lag 0 dark, stalest yellow
        labels = [f"lag {lag}" for lag in lags]
        if len(rows) <= _MAX_BARS:
            diffs = [b - a for a, b in zip(xs, xs[1:]) if b > a]
            bottoms = [0.0] * len(rows)
            for ys, colour, label in zip(shares, colours, labels):
                ax.bar(xs, ys, width=0.8 * (min(diffs) if diffs else 1), bottom=bottoms, color=colour, label=label)
                bottoms = [b + y for b, y in zip(bottoms, ys)]
        else:
            ax.stackplot(xs, *shares, colors=colours, labels=labels)
        ax.set(ylim=(0, 1), ylabel="share of tokens", title="Staleness (policy lag of trained tokens)")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        if is_keys:
            ax2 = axes[1][0]
            for key in is_keys:
                kx, ky = _series(pairs, key)
                ax2.plot(kx, ky, marker="." if len(kx) <= _MAX_BARS else None, label=key.split("/", 1)[1])
            ax2.set(ylabel="importance weight")
            ax2.grid(alpha=0.3)
            ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        axes[-1][0].set_xlabel("step")
        fig.savefig(out, dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)
    logger.debug("wrote staleness chart of %d step(s) to %s", len(rows), out)
    return out
