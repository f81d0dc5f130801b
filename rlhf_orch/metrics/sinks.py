"""Destinations for the driver's per-step metrics.

Metrics are flat namespaced dicts of python numbers (`{"rollout/reward_mean": 0.4, ...}`) written
only by the driver. This module provides a JSON-lines file (the run's durable record, read back by
`read_jsonl` for plots and resume), TensorBoard, the gauge names Ray custom metrics use (the Ray sink itself is
driver/metrics_sink.py: rlhf_orch never imports Ray), and a fan-out that keeps a run alive when one destination
fails.

What it deliberately does not do: aggregate, smooth or buffer metrics (every write goes straight
out), print to stdout (the driver shows a progress bar), or import tensorboard at module import time -- it is
imported when its sink is constructed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_RESERVED_JSONL_KEYS = ("step", "time")


class MetricSink:
    """Base class for metric destinations.

    Any object with `write(step, metrics)` and `close()` works where a sink is expected; subclassing
    only adds the context-manager helpers.
    """

    def write(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release files/handles. Default: nothing to release."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _as_number(value: Any) -> float | None:
    """The value as a python float, or None if it is not a real number (None, str, dict, ...)."""
    if isinstance(value, (int, float)):  # bool is an int: exported as 0/1, which is what we want
        return float(value)
    item = getattr(value, "item", None)  # 0-d numpy / torch scalars slipping through
    if callable(item):
        try:
            result = item()
        except (TypeError, ValueError, RuntimeError):
            return None
        if isinstance(result, (int, float)):
            return float(result)
    return None


def _jsonable(value: Any) -> Any:
    """JSON-safe form of a metric value. Non-finite floats become None because JSON has no NaN."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    number = _as_number(value)
    if number is not None:
        return number if math.isfinite(number) else None
    return str(value)  # unexpected type: keep something readable rather than failing the step


class JsonlSink(MetricSink):
    """Appends `{"step": step, "time": unix_time, **metrics}` as one JSON line per write.

    Each line is flushed immediately, so a crashed run leaves every completed step readable.
    Non-finite floats (NaN, +/-inf) are written as `null`: strict JSON has no NaN and other tools
    (jq, pandas) reject Python's `NaN` extension. Opening an existing file appends (resume).
    Metric keys named "step" or "time" are dropped, since they would clobber the record's own.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = self._ends_mid_line(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        if needs_newline:
            # A previous run died mid-line; start on a fresh line so only that one line is lost.
            self._file.write("\n")
            self._file.flush()

    @staticmethod
    def _ends_mid_line(path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() == 0:
                    return False
                f.seek(-1, os.SEEK_END)
                return f.read(1) != b"\n"
        except FileNotFoundError:
            return False

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._file.closed:
            raise RuntimeError(f"JsonlSink({self.path}) is closed")
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            if key in _RESERVED_JSONL_KEYS:
                logger.debug("dropping metric %r: the key is reserved in metrics.jsonl", key)
                continue
            record[key] = _jsonable(value)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All records of a metrics JSONL file, in file order.

    Undecodable lines are skipped with a logged warning: normally only a truncated last line
    left by a crash, or such a line in the middle of a file that a resumed run appended to.
    """
    records: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                logger.warning("%s:%d: skipping unreadable metrics line (%s)", path, lineno, exc)
                continue
            if not isinstance(record, dict):
                logger.warning("%s:%d: skipping non-object metrics line", path, lineno)
                continue
            records.append(record)
    return records


class TensorBoardSink(MetricSink):
    """Writes every numeric metric as a TensorBoard scalar (non-numeric values are skipped).

    Flushes on every write: at one write per training step the cost is negligible, and it means
    TensorBoard shows the latest step and a crash loses nothing.
    """

    def __init__(self, logdir: str | os.PathLike) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: pulls in tensorboard + protobuf

        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.logdir))
        self._closed = False

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._closed:
            raise RuntimeError(f"TensorBoardSink({self.logdir}) is closed")
        for key, value in metrics.items():
            number = _as_number(value)
            if number is None:
                continue
            self._writer.add_scalar(key, number, global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.flush()
            self._writer.close()


_GAUGE_PREFIX = "rlhf_orch_"
_INVALID_GAUGE_CHARS = re.compile(r"[^a-zA-Z0-9_]")


def gauge_name(key: str) -> str:
    """Prometheus-safe gauge name for a metric key: "rollout/reward_mean" -> "rlhf_orch_rollout_reward_mean".

    Every character outside [a-zA-Z0-9_] becomes "_"; the prefix keeps names from starting with a
    digit and groups our metrics on a shared Prometheus endpoint.
    """
    return _GAUGE_PREFIX + _INVALID_GAUGE_CHARS.sub("_", key)


class MultiSink(MetricSink):
    """Fans each write/close out to several sinks.

    A sink that raises is logged and skipped for that call; the others still get the metrics,
    because losing a metrics destination must never kill a training run. The first failure of a
    sink is logged with its traceback, later ones every 100th time to avoid flooding the log.
    """

    def __init__(self, sinks: Iterable[MetricSink]) -> None:
        self.sinks = list(sinks)
        self._failures = [0] * len(self.sinks)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for i, sink in enumerate(self.sinks):
            try:
                sink.write(step, metrics)
            except Exception:
                self._failures[i] += 1
                count = self._failures[i]
                if count == 1:
                    logger.exception("metrics sink %s failed at step %d; continuing", type(sink).__name__, step)
                elif count % 100 == 0:
                    logger.warning("metrics sink %s has failed %d times (latest at step %d)",
                                   type(sink).__name__, count, step)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:
                logger.exception("closing metrics sink %s failed", type(sink).__name__)
