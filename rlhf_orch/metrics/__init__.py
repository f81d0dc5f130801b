"""Metrics for the driver: phase timing, metric sinks (JSONL, TensorBoard, Ray/Prometheus) and plots.

Metrics are flat namespaced dicts of python numbers (`{"rollout/reward_mean": 0.4,
"perf/generate_s": 1.2, ...}`) written only by the driver process.

Importing this package does not import ray, matplotlib or tensorboard: each sink imports its
library when constructed, and `plot_run` imports matplotlib when called.
"""

from rlhf_orch.metrics.plots import plot_run
from rlhf_orch.metrics.sinks import (
    JsonlSink,
    MetricSink,
    MultiSink,
    TensorBoardSink,
    gauge_name,
    read_jsonl,
)
from rlhf_orch.metrics.timeline import Timeline, plot_staleness, plot_timeline
from rlhf_orch.metrics.timer import PhaseTimer

__all__ = [
    "JsonlSink",
    "MetricSink",
    "MultiSink",
    "PhaseTimer",
    "TensorBoardSink",
    "Timeline",
    "gauge_name",
    "plot_run",
    "plot_staleness",
    "plot_timeline",
    "read_jsonl",
]
