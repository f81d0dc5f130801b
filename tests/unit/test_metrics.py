"""Unit tests for rlhf_orch.metrics: real files, real TensorBoard event files, real PNGs, no mocks."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time

import pytest

from rlhf_orch.metrics import (
    JsonlSink,
    MultiSink,
    PhaseTimer,
    TensorBoardSink,
    gauge_name,
    plot_run,
    read_jsonl,
)
from rlhf_orch.metrics.plots import _MAX_RAW, _eval_panel, _trend

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- PhaseTimer

def test_phase_timer_accumulates_reentered_phase():
    timer = PhaseTimer()
    for _ in range(2):
        with timer.phase("generate"):
            time.sleep(0.02)
    with timer.phase("train"):
        time.sleep(0.01)
    m = timer.metrics()
    assert set(m) == {"perf/generate_s", "perf/train_s"}
    assert 0.04 <= m["perf/generate_s"] < 0.5
    assert 0.01 <= m["perf/train_s"] < 0.5
    assert timer.total() == pytest.approx(m["perf/generate_s"] + m["perf/train_s"])
    assert timer.metrics(prefix="time/") == {"time/generate_s": m["perf/generate_s"],
                                             "time/train_s": m["perf/train_s"]}


def test_phase_timer_nested_phases_measured_independently():
    timer = PhaseTimer()
    with timer.phase("step"):
        time.sleep(0.01)
        with timer.phase("sync"):
            time.sleep(0.02)
    step, sync = timer.get("step"), timer.get("sync")
    assert 0.02 <= sync < 0.5
    assert step >= sync + 0.01
    assert timer.total() == pytest.approx(step)  # nested time is not counted twice


def test_phase_timer_records_time_on_exception_and_resets():
    timer = PhaseTimer()
    with pytest.raises(ValueError):
        with timer.phase("boom"):
            time.sleep(0.005)
            raise ValueError("x")
    assert timer.get("boom") >= 0.005
    with timer.phase("open"):
        with pytest.raises(RuntimeError):
            timer.reset()
    timer.reset()
    assert timer.metrics() == {} and timer.total() == 0.0 and timer.get("boom") == 0.0


# ---------------------------------------------------------------- JSONL

def test_jsonl_round_trip_nan_and_append(tmp_path):
    path = tmp_path / "deep" / "dir" / "metrics.jsonl"
    with JsonlSink(path) as sink:
        sink.write(1, {"rollout/reward_mean": 0.5, "train/loss": float("nan"), "n": 3})
        sink.write(2, {"rollout/reward_mean": 0.75, "train/loss": float("inf")})
        # Flushed per line: readable while the sink is still open.
        assert len(read_jsonl(path)) == 2
    for line in path.read_text().splitlines():
        json.loads(line)  # strict JSON: no NaN/Infinity tokens
    with JsonlSink(path) as sink:  # reopen appends (resume)
        sink.write(3, {"rollout/reward_mean": 1.0})
    recs = read_jsonl(path)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[0]["rollout/reward_mean"] == 0.5 and recs[0]["n"] == 3
    assert recs[0]["train/loss"] is None and recs[1]["train/loss"] is None
    assert all(abs(r["time"] - time.time()) < 60 for r in recs)


def test_jsonl_truncated_last_line_tolerated(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    with JsonlSink(path) as sink:
        sink.write(1, {"a": 1.0})
        sink.write(2, {"a": 2.0})
    with open(path, "a") as f:
        f.write('{"step": 3, "a": 3.')  # a crash mid-write
    with caplog.at_level(logging.WARNING, logger="rlhf_orch.metrics.sinks"):
        recs = read_jsonl(path)
    assert [r["step"] for r in recs] == [1, 2]
    assert any("skipping" in r.message for r in caplog.records)
    # A resumed run starts on a fresh line, so only the truncated record is lost.
    with JsonlSink(path) as sink:
        sink.write(3, {"a": 3.0})
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]


# ---------------------------------------------------------------- TensorBoard

def test_tensorboard_sink_event_file_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    sink.write(1, {"train/loss": 1.5, "rollout/reward_mean": 0.25, "note": "text", "none": None})
    sink.write(2, {"train/loss": 0.5})
    sink.close()
    sink.close()  # idempotent
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert set(tags) == {"train/loss", "rollout/reward_mean"}
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2]
    assert [e.value for e in loss] == pytest.approx([1.5, 0.5])
    assert acc.Scalars("rollout/reward_mean")[0].value == pytest.approx(0.25)


# ---------------------------------------------------------------- MultiSink

class _ListSink:
    def __init__(self):
        self.rows, self.closed = [], False

    def write(self, step, metrics):
        self.rows.append((step, dict(metrics)))

    def close(self):
        self.closed = True


class _BrokenSink:
    def write(self, step, metrics):
        raise OSError("disk full")

    def close(self):
        raise OSError("still full")


def test_multisink_keeps_going_when_one_sink_fails(caplog):
    first, last = _ListSink(), _ListSink()
    multi = MultiSink([first, _BrokenSink(), last])
    with caplog.at_level(logging.ERROR, logger="rlhf_orch.metrics.sinks"):
        multi.write(1, {"a": 1.0})
        multi.write(2, {"a": 2.0})
        multi.close()
    assert first.rows == last.rows == [(1, {"a": 1.0}), (2, {"a": 2.0})]
    assert first.closed and last.closed
    assert any("disk full" in (r.exc_text or "") or r.exc_info for r in caplog.records)


# ---------------------------------------------------------------- plots

def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5_000


def _records(n=30):
    recs = []
    for step in range(1, n + 1):
        rec = {"step": step, "time": 0.0,
               "rollout/reward_mean": math.sin(step / 5) + step / n,
               "perf/generate_s": 1.0 + 0.1 * step, "perf/train_s": 0.5, "perf/sync_s": 0.2,
               "perf/step_s": 1.8 + 0.1 * step,
               "sync/gbps": 10.0 + step % 3}
        if step % 10 == 0:
            rec["eval/reward_mean"] = step / n
        if step % 2:
            rec["sync/total_s"] = 0.2
        else:  # fallback: sum of sync/*_s keys
            rec["sync/gather_s"], rec["sync/broadcast_s"] = 0.1, 0.15
        recs.append(rec)
    return recs


def test_plot_run_writes_all_pngs(tmp_path):
    paths = plot_run(_records(), tmp_path / "plots")
    assert [p.name for p in paths] == ["reward.png", "phase_times.png", "sync.png"]
    for p in paths:
        _assert_png(p)


def test_plot_run_round_trip_from_jsonl_with_missing_values(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with JsonlSink(path) as sink:
        for i, rec in enumerate(_records(12)):
            rec = {k: v for k, v in rec.items() if k not in ("step", "time")}
            if i == 3:
                rec["rollout/reward_mean"] = float("nan")  # -> None in the file
                del rec["perf/train_s"]
            if i == 5:
                del rec["sync/gbps"]
            sink.write(i, rec)
    paths = plot_run(read_jsonl(path), tmp_path / "plots")
    assert {p.name for p in paths} == {"reward.png", "phase_times.png", "sync.png"}
    for p in paths:
        _assert_png(p)


def test_plot_run_skips_charts_without_data(tmp_path):
    recs = [{"step": 1, "rollout/reward_mean": 0.1}, {"step": 2, "rollout/reward_mean": None},
            {"step": 3}, {"rollout/reward_mean": 0.3}]
    paths = plot_run(recs, tmp_path)
    assert [p.name for p in paths] == ["reward.png"]
    _assert_png(paths[0])
    assert plot_run([], tmp_path / "empty") == []


def test_plot_run_many_steps_uses_area_chart(tmp_path):
    paths = plot_run(_records(400), tmp_path)
    assert len(paths) == 3
    for p in paths:
        _assert_png(p)


def test_long_series_are_faint_points_under_a_rolling_mean():
    """Issue #31: 600 syncs drawn as lines with markers were an unreadable zigzag; past _MAX_RAW points a series is
    faint points plus one rolling-mean line (its legend says the window); short series keep their markers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    try:
        xs = list(range(1, 601))
        ys = [0.15 if x % 2 else 0.25 for x in xs]          # a padding fraction alternating every step
        [line] = _trend(ax, xs, ys, "C0", "padding")
        assert "12-step mean" in line.get_label() and line.get_marker() in (None, "None", "")
        assert max(line.get_ydata()[20:]) - min(line.get_ydata()[20:]) < 0.01   # a flat line, not a band
        assert len(ax.collections) == 1 and ax.collections[0].get_alpha() < 0.5   # the raw points, faint
        [short] = _trend(ax, xs[:_MAX_RAW], ys[:_MAX_RAW], "C1", "short")
        assert short.get_marker() == "." and short.get_label() == "short"
    finally:
        plt.close(fig)


@pytest.mark.parametrize("k, labels", [(1, ["eval reward", "pass@1"]), (4, ["eval reward", "pass@1", "pass@4"])])
def test_eval_panel_draws_pass_at_k_only_when_k_is_not_one(k, labels):
    """Issue #31: with one sample per prompt pass@k is pass@1, and the panel had two "pass@1" legends."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    try:
        pairs = [(s, {"eval/reward_mean": 0.1 * s, "eval/pass@1": 0.1 * s, "eval/pass@k": 0.2 * s, "eval/k": float(k)})
                 for s in (50, 100)]
        _eval_panel(ax, pairs)
        assert [line.get_label() for line in ax.get_lines()] == labels
    finally:
        plt.close(fig)


# ---------------------------------------------------------------- Ray metrics

@pytest.mark.parametrize("key, expected", [
    ("rollout/reward_mean", "rlhf_orch_rollout_reward_mean"),
    ("perf/generate_s", "rlhf_orch_perf_generate_s"),
    ("sync/gbps", "rlhf_orch_sync_gbps"),
    ("eval/pass@1 (gsm8k)", "rlhf_orch_eval_pass_1__gsm8k_"),
    ("9-lives.x:y", "rlhf_orch_9_lives_x_y"),
])
def test_gauge_name_sanitising(key, expected):
    assert gauge_name(key) == expected


def test_ray_metrics_sink_requires_ray():
    import ray
    from driver.metrics_sink import RayMetricsSink

    if ray.is_initialized():
        pytest.skip("Ray already initialised in this process")
    with pytest.raises(RuntimeError, match="ray.init"):
        RayMetricsSink(experiment="exp")


def test_import_is_light():
    code = ("import sys, rlhf_orch.metrics; "
            "heavy = [m for m in ('ray', 'matplotlib', 'tensorboard') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.integration
def test_ray_metrics_sink_with_ray(monkeypatch):
    import ray

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        from driver.metrics_sink import RayMetricsSink
        sink = RayMetricsSink(experiment="unit-test")
        sink.write(1, {"rollout/reward_mean": 0.5, "perf/generate_s": 1.0, "note": "x",
                       "train/loss": float("nan")})
        sink.write(2, {"rollout/reward_mean": 0.6})
        sink.close()
        only = RayMetricsSink(keys={"train/loss": "rlhf_orch_loss"}, experiment="unit-test")
        only.write(1, {"train/loss": 0.1, "rollout/reward_mean": 0.5})
        assert list(only._gauges) == ["train/loss"]
        only.close()
    finally:
        ray.shutdown()


def test_phase_plot_gets_a_trainer_panel(tmp_path):
    recs = _records(20)
    for r in recs:
        r.update({"train/tokens_per_s": 4e4 + r["step"], "train/mfu": 0.27, "train/padding_frac": 0.0,
                  "train/rank_imbalance": 0.01})
    with_panel = plot_run(recs, tmp_path / "a")[1]
    without = plot_run(_records(20), tmp_path / "b")[1]
    _assert_png(with_panel)
    from PIL import Image   # matplotlib depends on pillow
    # The second panel makes the figure taller (10x8 in vs 10x5 in).
    assert Image.open(with_panel).size[1] > 1.3 * Image.open(without).size[1]
