"""RayMetricsSink: the run's flat metrics as Ray custom metrics (Prometheus endpoint, Ray dashboard).

It lives in actors/ because it needs Ray (rlhf_orch/ never imports it); names and value handling come from
rlhf_orch.metrics.sinks (`gauge_name`), so a key maps to the same gauge name everywhere. It does not create
dashboards: the gauges appear wherever the cluster's Prometheus scrapes Ray's metrics.
"""
from __future__ import annotations

import math
from typing import Any

import ray

from rlhf_orch.metrics.sinks import _INVALID_GAUGE_CHARS, MetricSink, _as_number, gauge_name


class RayMetricsSink(MetricSink):
    """Exports metrics as Ray custom metrics (`ray.util.metrics.Gauge`).

    They appear on the cluster's Prometheus endpoint (prefixed `ray_` by Ray) and the Ray dashboard, tagged
    `experiment=<experiment>`; `rlhf_orch_step` holds the step of the last write. `keys` maps metric key -> gauge
    name and restricts the export to those keys (names are sanitised all the same); by default every numeric key
    written is exported under `gauge_name(key)`. Gauges are created lazily, once per key.

    Only usable in a process connected to Ray (`ray.is_initialized()`); construction raises
    RuntimeError otherwise. Non-finite values are skipped: a NaN gauge only hides the last good one.
    """

    def __init__(self, keys: dict[str, str] | None = None, experiment: str = "default") -> None:
        if not ray.is_initialized():
            raise RuntimeError(
                "RayMetricsSink needs a process connected to Ray: call ray.init() (or run inside "
                "a Ray driver/actor) before constructing it"
            )
        self._keys = None if keys is None else {k: _INVALID_GAUGE_CHARS.sub("_", v) for k, v in keys.items()}
        self.experiment = str(experiment)
        self._gauges: dict[str, Any] = {}
        self._step_gauge: Any = None

    def _gauge(self, key: str):
        gauge = self._gauges.get(key)
        if gauge is None:
            from ray.util.metrics import Gauge

            name = gauge_name(key) if self._keys is None else self._keys[key]
            gauge = Gauge(name, description=f"rlhf_orch metric {key!r}", tag_keys=("experiment",))
            gauge.set_default_tags({"experiment": self.experiment})
            self._gauges[key] = gauge
        return gauge

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if self._keys is not None and key not in self._keys:
                continue
            number = _as_number(value)
            if number is None or not math.isfinite(number):
                continue
            self._gauge(key).set(number)
        # The step itself as `rlhf_orch_step` (a dashboard's "current step"), whatever `keys` restricts; set after
        # the step's metrics (Ray exports all gauges together every few seconds, so they normally appear together).
        if self._step_gauge is None:
            from ray.util.metrics import Gauge

            self._step_gauge = Gauge(gauge_name("step"), description="rlhf_orch: the last completed RL step",
                                     tag_keys=("experiment",))
            self._step_gauge.set_default_tags({"experiment": self.experiment})
        self._step_gauge.set(float(step))

    def close(self) -> None:
        # Ray owns the exporter; dropping our references is all there is to release.
        self._gauges.clear()
        self._step_gauge = None
