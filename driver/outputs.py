"""What a run writes besides its checkpoints: the metric sinks (metrics.jsonl, TensorBoard, wandb/mlflow, Ray's
metrics endpoint), rollouts.jsonl (which draws each step trained on), the timeline and the plots.

A resumed run drops the records after its checkpoint's step before the sinks append to the files, and its trackers
continue their runs; a fresh start never appends to an earlier run's records. Closing writes the timeline and the
plots (a failure there is logged, never raised: plots must not hide a run's result) and closes every sink.
It holds no actor and decides nothing about the run (driver/cluster.py opens and closes it; launch.py writes to it).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from driver.metrics_sink import RayMetricsSink
from rlhf_orch.checkpoint import truncate_metrics
from rlhf_orch.metrics import JsonlSink, MultiSink, TensorBoardSink, plot_run, plot_staleness, plot_timeline
from rlhf_orch.metrics.timeline import Timeline
from rlhf_orch.metrics.trackers import make_trackers

logger = logging.getLogger(__name__)


class RunOutputs:
    def __init__(self, cfg, run_dir: Path, timeline: Timeline):
        self.cfg, self.run_dir, self.timeline = cfg, Path(run_dir), timeline
        self.sinks: MultiSink | None = None
        self.history: list[dict] = []   # a resumed run's metrics up to its checkpoint (the records go on from them)
        self._rollout_log = None

    def open(self, resume_step: int | None) -> None:
        """`resume_step`: the step of the checkpoint a run resumes from (None: a fresh start)."""
        if resume_step is not None:
            self.history = truncate_metrics(self.run_dir / "metrics.jsonl", resume_step)
            truncate_metrics(self.run_dir / "rollouts.jsonl", resume_step)
        self.sinks = self._sinks(resume_step is not None)
        log = self.run_dir / "rollouts.jsonl"
        if resume_step is None:
            log.unlink(missing_ok=True)
        self._rollout_log = open(log, "a", encoding="utf-8")

    def _sinks(self, resumed: bool) -> MultiSink:
        m, sinks = self.cfg.metrics, []
        if "jsonl" in m.trackers:
            path = self.run_dir / "metrics.jsonl"
            if not resumed and path.exists():   # a fresh start (resume=true without a checkpoint too)
                path.unlink()                   # must not append to an earlier run's records
            sinks.append(JsonlSink(path))
        if "tensorboard" in m.trackers:
            sinks.append(TensorBoardSink(self.run_dir / "tb"))
        try:   # wandb, mlflow: a resumed run continues their runs (ids in <run>/trackers.json)
            sinks.extend(make_trackers(self.cfg, self.run_dir, resumed=resumed))
        except BaseException:
            MultiSink(sinks).close()
            raise
        if m.ray_metrics:
            sinks.append(RayMetricsSink(experiment=self.cfg.experiment.name))
        return MultiSink(sinks)

    def log_rollouts(self, step: int, meta: dict) -> None:
        """rollouts.jsonl: which draws (epoch, dataset row) each step trained on, and how many were filtered."""
        self._rollout_log.write(json.dumps({"step": step, "sources": meta["sources"],
                                            "groups_filtered": meta["metrics"].get("rollout/groups_filtered", 0)}) + "\n")
        self._rollout_log.flush()

    def _write_timeline(self, records: list[dict]) -> None:
        path = self.run_dir / "timeline.jsonl"
        path.unlink(missing_ok=True)   # one file per (re)start: times are relative to that start
        self.timeline.write_jsonl(path)
        if self.cfg.metrics.plots:
            plot_timeline(self.timeline.events, self.run_dir / "plots" / "timeline.png")
            plot_staleness(records, self.run_dir / "plots" / "staleness.png")

    def close(self, records: list[dict]) -> None:
        """The timeline and plots written, every sink closed (also after a failed start: what was opened)."""
        try:
            self._write_timeline(records)
        except Exception as e:   # plots must never hide the run's result
            logger.warning("timeline not written: %s", e)
        if self.sinks is not None:
            self.sinks.close()
        if self._rollout_log is not None:
            self._rollout_log.close()
        if self.cfg.metrics.plots and records:
            plot_run(records, self.run_dir / "plots")   # the end-of-run report lists every plot (rlhf_orch/report.py)
