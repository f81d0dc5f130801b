"""Wall-clock timing of named phases of a training step.

`PhaseTimer` accumulates `time.perf_counter` seconds per phase name and turns them into a flat
metrics dict (`{"perf/generate_s": 1.23, ...}`) that the driver merges into each step's metrics.

What it deliberately does not do: it does not synchronise CUDA streams (a phase that launches GPU
work must wait for it itself if it wants that work counted), it does not average or smooth, and
it is not thread-safe -- it is meant for the single-threaded driver loop.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class PhaseTimer:
    """Accumulates wall seconds per phase name.

    Re-entering a phase adds to its total. Phases may nest; each one is measured independently,
    so an outer "step" phase includes the time of an inner "generate" phase.
    """

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}
        # Wall time covered by outermost phases only, so total() never counts nested time twice.
        self._outer_total = 0.0
        self._depth = 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body of a `with` block under `name`; the time is recorded even if it raises."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name must be a non-empty string, got {name!r}")
        self._depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self._depth -= 1
            self._totals[name] = self._totals.get(name, 0.0) + elapsed
            if self._depth == 0:
                self._outer_total += elapsed

    def get(self, name: str) -> float:
        """Seconds accumulated under `name` since the last reset (0.0 if never entered)."""
        return self._totals.get(name, 0.0)

    def metrics(self, prefix: str = "perf/") -> dict[str, float]:
        """Flat metrics dict: `{f"{prefix}{name}_s": seconds}` for every phase entered."""
        return {f"{prefix}{name}_s": secs for name, secs in self._totals.items()}

    def total(self) -> float:
        """Wall seconds spent inside any phase: outermost phases only, nested time not double counted."""
        return self._outer_total

    def reset(self) -> None:
        """Forget all accumulated times (call once per step after reading `metrics()`)."""
        if self._depth:
            # Resetting mid-phase would silently attribute the open phase's time to the next step.
            raise RuntimeError("PhaseTimer.reset() called while a phase is still open")
        self._totals.clear()
        self._outer_total = 0.0
