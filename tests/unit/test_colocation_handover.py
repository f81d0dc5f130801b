"""driver/colocation.py carrying out a plan, against a simulated shared GPU (fake trainer group and engines, no Ray):
`trainer.offload: auto` moves everything in the first step, measures, then moves only what the plan needs; a switch
wakes what is asleep; the configured modes (true) keep their exact call sequence; an engine replaced mid-run is
handled in every plan; the GPU never holds more than it has."""
import pytest

import driver.colocation as colocation
from rlhf_orch.colocation_plan import GiB

ENGINE_GB = {0: 40.0, 1: 4.5, 2: 2.0}   # an engine's device memory by how many of its tags are asleep


class World:
    """One GPU shared by one trainer rank and its colocated engines; every change checks the device is not over."""

    def __init__(self, total_gb, rest_gb=13.0, peak_gb=30.0):
        self.total, self.rest, self.peak_gb = total_gb, rest_gb, peak_gb
        self.trainer = "rest"          # offloaded (1 GiB left) | rest | cache (its step's cache kept: peak)
        self.peak = 0.0
        self.engines: dict[str, set] = {}
        self.calls: list[str] = []

    def trainer_gb(self):
        return {"offloaded": 1.0, "rest": self.rest, "cache": self.peak_gb}[self.trainer]

    def used_gb(self):
        return self.trainer_gb() + sum(ENGINE_GB[len(t)] for t in self.engines.values())

    def check(self):
        assert self.used_gb() <= self.total, f"out of memory: {self.used_gb():.1f} > {self.total} GiB"

    def train(self) -> dict:
        assert self.trainer != "offloaded", "train step while the trainer is offloaded"
        self.trainer, self.peak = "cache", self.peak_gb
        self.check()
        return {colocation.PEAK_KEY: self.peak_gb}

    def generate(self):
        assert all(not t for t in self.engines.values()), f"generate while asleep: {self.engines}"


class Trainers:
    def __init__(self, w: World):
        self.w = w

    def call(self, method, *args):
        self.w.calls.append(f"trainer.{method}")
        return [getattr(self, method)(*args)]

    def offload_states(self):
        self.w.trainer = "offloaded"
        return {"offload/offload_s": 0.27, "offload/freed_gb": self.w.rest - 1.0}

    def reload_states(self):
        if self.w.trainer == "offloaded":
            self.w.trainer = "rest"
            self.w.check()
        return {"offload/reload_s": 0.34}

    def release_cache(self):
        if self.w.trainer == "cache":
            self.w.trainer = "rest"
        return 0.001

    def memory_stats(self, release=False):
        if release:
            self.release_cache()
        return {"device": "gpu-a", "total": self.w.total * GiB, "used": self.w.used_gb() * GiB,
                "reserved": self.w.trainer_gb() * GiB, "peak_reserved": self.w.peak * GiB}

    def device_memory(self):
        return {"gpu-a": self.w.used_gb()}


class Remote:
    def __init__(self, fn):
        self.remote = fn


class Engine:
    def __init__(self, name, w: World):
        self.name, self.w = name, w
        w.engines[name] = set()
        w.check()
        self.sleep = Remote(self._sleep)
        self.wake_up = Remote(self._wake)
        self.device_memory = Remote(lambda: {"gpu-a": w.used_gb()})

    def _sleep(self, level):
        self.w.calls.append(f"{self.name}.sleep")
        self.w.engines[self.name] = {"weights", "kv_cache"}
        return 0.1

    def _wake(self, tags):
        self.w.calls.append(f"{self.name}.wake{sorted(tags)}")
        self.w.engines[self.name] -= set(tags)
        self.w.check()
        return 0.05


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    monkeypatch.setattr(colocation, "get", lambda refs, *a, **k: refs)


def build(total_gb, offload, device="cuda", **kw):
    """What the builder does: engines up, colocation made, engines sleep, trainer starts, weights wake, first sync."""
    w = World(total_gb, **kw)
    engines = {"v": Engine("v", w)}
    c = colocation.Colocation(Trainers(w), engines, {"v": 2}, offload, device, 10.0)
    c.start()
    c.wake_weights()
    c.step_metrics()
    w.calls.clear()
    return w, c, engines


def step(w, c):
    """One step as launch.rl_step and the Cluster run it; returns the step's metrics and the calls it made."""
    w.calls.clear()
    m = dict(c.to_generate())
    w.generate()
    m.update(c.to_train())
    out = w.train()
    m.update(c.after_train(out))
    m.update(c.wake_weights())
    m.update(c.step_metrics())
    return m, list(w.calls)


FULL = ["trainer.offload_states", "v.wake['kv_cache']", "v.sleep", "trainer.reload_states", "v.wake['weights']"]


def test_big_gpu_auto_moves_everything_once_then_nothing():
    w, c, _ = build(140.4, "auto")
    m1, calls1 = step(w, c)
    # the configured hand-overs, with the three readings around them; then the switch wakes the KV cache at the sync
    assert [x for x in calls1 if "memory_stats" not in x and "device_memory" not in x] == \
        FULL[:-1] + ["v.wake['kv_cache', 'weights']"]
    assert calls1.count("trainer.memory_stats") == 3
    assert m1["colocate/plan_offload"] == 0.0 and m1["colocate/plan_sleep"] == 0.0
    assert m1["colocate/moved_gb"] == pytest.approx(2 * 12.0 + 2 * (40.0 - 2.0))   # both directions, both tenants
    assert c.plan.name == "nothing moves" and not c.offloaded and not c.asleep
    for _ in range(3):
        m, calls = step(w, c)
        assert calls == []                       # no RPC at all: no hand-over, no readings
        assert m["colocate/moved_gb"] == 0.0 and m["colocate/handover_s"] < 0.01
        assert "colocate/plan_offload" not in m and "colocate/offload_s" not in m and "colocate/sleep_s" not in m


def test_tight_gpu_auto_only_the_engine_sleeps():
    w, c, _ = build(79.6, "auto", peak_gb=45.0)
    m1, _ = step(w, c)
    assert (m1["colocate/plan_offload"], m1["colocate/plan_sleep"]) == (0.0, 1.0)
    for _ in range(2):
        m, calls = step(w, c)   # World checks: the trainer's step cache goes before the KV cache comes back
        assert [x for x in calls if "device_memory" not in x] == \
            ["trainer.release_cache", "v.wake['kv_cache']", "v.sleep", "v.wake['weights']"]
        assert m["colocate/moved_gb"] == pytest.approx(2 * 38.0)
        assert "colocate/offload_s" not in m and "colocate/reload_s" not in m


def test_tighter_gpu_auto_moves_as_configured():
    w, c, _ = build(55.0, "auto", peak_gb=45.0)   # 40 awake + 13 resident + 2.75 margin > 55
    m1, _ = step(w, c)
    assert (m1["colocate/plan_offload"], m1["colocate/plan_sleep"]) == (1.0, 1.0)
    _, calls = step(w, c)
    assert [x for x in calls if "device_memory" not in x] == FULL


@pytest.mark.parametrize("offload", [True, False])
def test_configured_modes_keep_their_calls(offload):
    w, c, _ = build(140.4, offload)
    for i in range(3):
        m, calls = step(w, c)
        want = FULL if offload else [x for x in FULL if not x.startswith("trainer.")]
        assert [x for x in calls if "device_memory" not in x and "memory_stats" not in x] == want
        assert "colocate/plan_offload" not in m and "colocate/handover_s" in m
        assert calls.count("trainer.memory_stats") == (2 if i == 0 else 0)   # engines' sleep measured once


def test_cpu_auto_moves_nothing_from_the_start():
    w = World(1e9)
    engines = {"v": Engine("v", w)}
    c = colocation.Colocation(Trainers(w), engines, {"v": 2}, "auto", "cpu", 10.0)
    c.start()
    c.wake_weights()
    assert w.calls == [] and c.plan.name == "nothing moves"
    m1, calls1 = step(w, c)
    assert calls1 == [] and (m1["colocate/plan_offload"], m1["colocate/plan_sleep"]) == (0.0, 0.0)
    assert m1["colocate/moved_gb"] == 0.0
    m2, _ = step(w, c)
    assert "colocate/plan_offload" not in m2


def replace_engine(w, c, engines):
    """What driver/recovery.py does to the dead engine "v": drops it and adds its replacement "v.r1", awake."""
    w.engines.pop("v")
    engines.pop("v")
    c.sleep_levels.pop("v")
    engines["v.r1"] = Engine("v.r1", w)
    c.sleep_levels["v.r1"] = 2


def test_a_replaced_engine_under_each_plan():
    """What driver/recovery.py does to a dead engine (drops it, adds its replacement, awake) and what the Cluster then
    calls (to_train -> sync -> to_generate, as next_batch does when no engine is left)."""
    for total, peak, moved in ((140.4, 30.0, False), (79.6, 45.0, True)):
        w, c, engines = build(total, "auto", peak_gb=peak)
        step(w, c)
        step(w, c)
        c.to_generate()
        replace_engine(w, c, engines)
        w.calls.clear()
        c.to_train()
        c.wake_weights()
        c.to_generate()
        w.generate()
        if moved:
            assert "v.r1.sleep" in w.calls and "v.r1.wake['kv_cache']" in w.calls
        else:
            assert [x for x in w.calls if "device_memory" not in x] == []
        m, _ = step(w, c)
        assert m["colocate/handover_s"] >= 0.0


def test_a_larger_peak_moves_the_plan_and_the_next_hand_overs_follow():
    w, c, _ = build(140.4, "auto")
    step(w, c)
    assert c.plan.moves == 0
    w.peak_gb = 95.0           # a later batch of long responses: 40 + 95 + 7 > 140.4
    w.total = 1e9              # (the simulated device lets this step through; the plan must not rely on that again)
    m, _ = step(w, c)
    assert (m["colocate/plan_offload"], m["colocate/plan_sleep"]) == (0.0, 1.0)
    _, calls = step(w, c)
    assert "v.sleep" in calls and "trainer.release_cache" in calls


def test_an_engine_replaced_during_the_measured_step_keeps_the_configured_moves():
    """Readings that saw another set of engines say nothing about the new one: auto keeps moving as configured."""
    w, c, engines = build(140.4, "auto")
    c.to_generate()
    c.to_train()
    replace_engine(w, c, engines)
    m = c.after_train(w.train())
    assert (m["colocate/plan_offload"], m["colocate/plan_sleep"]) == (1.0, 1.0)
    assert "no GPU memory readings" in c.plan.reason
