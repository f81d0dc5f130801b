"""Unit tests for rlhf_orch.metrics.timeline: real files and real PNGs, no mocks."""

from __future__ import annotations

import random
import time

import pytest

from rlhf_orch.metrics import Timeline, plot_staleness, plot_timeline
from rlhf_orch.metrics.timeline import _actor_key

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_000_000.0


def _timeline() -> Timeline:
    """driver spans 0..10 s; engine_0 busy [1,3] u [2,5] u [7,8] = [1,5] u [7,8] = 5 s."""
    tl = Timeline(t0=T0)
    tl.add("driver", "wait", T0, T0 + 10)
    tl.add("engine_0", "generate", T0 + 1, T0 + 3, step=0)
    tl.add("engine_0", "generate", T0 + 2, T0 + 5, step=0)  # overlaps the previous span
    tl.add("engine_0", "sync", T0 + 7, T0 + 8)
    tl.add("trainer_0", "train", T0 + 4, T0 + 6)
    return tl


def test_add_stores_times_relative_to_t0_with_extra_fields():
    ev = _timeline().events[1]
    assert ev == {"actor": "engine_0", "phase": "generate", "start": 1.0, "end": 3.0, "step": 0}


def test_add_rejects_span_ending_before_it_starts():
    with pytest.raises(ValueError):
        Timeline(t0=0.0).add("engine_0", "generate", 5.0, 4.0)


def test_busy_fraction_merges_overlaps_and_counts_gaps():
    tl = _timeline()
    assert tl.busy_fraction("engine_0") == pytest.approx(5 / 10)  # whole extent 0..10 s
    assert tl.busy_fraction("driver") == pytest.approx(1.0)
    assert tl.busy_fraction("trainer_0") == pytest.approx(2 / 10)
    assert tl.busy_fraction("nobody") == 0.0
    # window [2, 8]: engine_0 busy [2,5] u [7,8] = 4 s of 6
    assert tl.busy_fraction("engine_0", start=2, end=8) == pytest.approx(4 / 6)
    # window entirely in a gap, and an empty window
    assert tl.busy_fraction("engine_0", start=5, end=7) == 0.0
    assert tl.busy_fraction("engine_0", start=3, end=3) == 0.0
    assert Timeline().busy_fraction("engine_0") == 0.0


def test_busy_fraction_span_contained_in_another():
    tl = Timeline(t0=0.0)
    tl.add("engine_0", "generate", 0, 10)
    tl.add("engine_0", "score", 2, 3)  # nested: adds nothing
    tl.add("engine_0", "sync", 12, 14)
    tl.add("driver", "wait", 0, 20)
    assert tl.busy_fraction("engine_0") == pytest.approx(12 / 20)


def test_span_context_manager_records_event_even_on_error():
    tl = Timeline()
    with tl.span("trainer_0", "train", step=3):
        time.sleep(0.02)
    with pytest.raises(RuntimeError):
        with tl.span("engine_1", "generate"):
            raise RuntimeError("boom")
    first, second = tl.events
    assert (first["actor"], first["phase"], first["step"]) == ("trainer_0", "train", 3)
    assert 0 <= first["start"] < 1.0
    assert 0.02 <= first["end"] - first["start"] < 0.5
    assert (second["actor"], second["phase"]) == ("engine_1", "generate")
    assert second["start"] >= first["end"]


def test_jsonl_round_trip_appends(tmp_path):
    tl = _timeline()
    path = tmp_path / "sub" / "timeline.jsonl"
    assert tl.write_jsonl(path) == 5
    events = Timeline.read_jsonl(path)
    assert events == tl.events
    copy = Timeline(t0=0.0)
    copy.extend(events)
    assert copy.events == tl.events
    assert copy.busy_fraction("engine_0") == pytest.approx(0.5)
    tl.write_jsonl(path)  # appends, does not overwrite
    assert len(Timeline.read_jsonl(path)) == 10


def test_extend_rejects_malformed_events():
    with pytest.raises(KeyError):
        Timeline().extend([{"actor": "a", "start": 0.0, "end": 1.0}])
    with pytest.raises(ValueError):
        Timeline().extend([{"actor": "a", "phase": "p", "start": 2.0, "end": 1.0}])


def test_actor_rows_sorted_driver_trainer_engine_reward_others():
    actors = ["reward_0", "zeta", "engine_10", "engine_2", "trainer_1", "driver", "trainer_0", "alpha"]
    assert sorted(actors, key=_actor_key) == ["driver", "trainer_0", "trainer_1", "engine_2", "engine_10",
                                              "reward_0", "alpha", "zeta"]


def _big_events(n: int = 3000) -> list[dict]:
    rng = random.Random(0)
    actors = ["driver", "trainer_0", "trainer_1"] + [f"engine_{i}" for i in range(8)] + ["reward_0", "ref_0"]
    phases = ["generate", "score", "train", "sync", "checkpoint", "wait", "custom_a", "custom_b"]
    events, clock = [], {a: 0.0 for a in actors}
    for _ in range(n):
        actor = rng.choice(actors)
        start = clock[actor] + rng.uniform(0, 0.5)
        clock[actor] = start + rng.uniform(0.05, 2.0)
        events.append({"actor": actor, "phase": rng.choice(phases), "start": start, "end": clock[actor]})
    return events


def test_plot_timeline_writes_png_for_thousands_of_events(tmp_path):
    t = time.perf_counter()
    path = plot_timeline(_big_events(), tmp_path / "plots" / "timeline.png")
    assert time.perf_counter() - t < 30
    assert path == tmp_path / "plots" / "timeline.png"
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_plot_timeline_skips_malformed_and_empty(tmp_path):
    assert plot_timeline([], tmp_path / "empty.png") is None
    bad = [{"actor": "a", "phase": "p", "start": None, "end": 1.0}, {"phase": "p", "start": 0, "end": 1}]
    assert plot_timeline(bad, tmp_path / "bad.png") is None
    assert not list(tmp_path.iterdir())


def _staleness_records(n: int = 40, with_is: bool = True) -> list[dict]:
    recs = []
    for step in range(n):
        rec = {"step": step, "staleness/lag_0": 1000 - 10 * step, "staleness/lag_1": 10 * step,
               "rollout/reward_mean": 0.1}
        if step % 3 == 0:
            rec["staleness/lag_2"] = 50
        if with_is:
            rec["train/is_weight_mean"] = 1.0 + 0.001 * step
            rec["train/is_weight_max"] = 1.5 + 0.05 * step
        recs.append(rec)
    return recs


@pytest.mark.parametrize("with_is", [True, False])
def test_plot_staleness_writes_png(tmp_path, with_is):
    path = plot_staleness(_staleness_records(with_is=with_is), tmp_path / "staleness.png")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_plot_staleness_many_steps_uses_area_chart(tmp_path):
    path = plot_staleness(_staleness_records(n=600), tmp_path / "staleness.png")
    assert len(path.read_bytes()) > 1000


def test_plot_staleness_without_staleness_keys_writes_nothing(tmp_path):
    assert plot_staleness([], tmp_path / "a.png") is None
    assert plot_staleness([{"step": 0, "rollout/reward_mean": 0.3, "train/is_weight_mean": 1.0}],
                          tmp_path / "b.png") is None
    assert plot_staleness([{"step": 0, "staleness/lag_0": 0}], tmp_path / "c.png") is None  # no tokens
    assert not list(tmp_path.iterdir())
