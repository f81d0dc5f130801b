"""`shared_ray`: one local Ray for every run of a test module, which each run joins as it joins a cluster.

A run that finds Ray already initialised uses it and leaves it up (actors/ray_session.init_ray returns False, and
its stop_ray leaves it alone), the path
of `ray.address` / RAY_ADDRESS on a cluster. Starting and stopping a local Ray costs ~6 s per run on the 2-core CI
machine, and the modules that use this fixture make 2-11 runs each. Every run still starts its own actors and
placement group and removes them at its end (a left-over named actor would fail the next run of the module).

Not for modules whose runs need their own Ray: environment variables set by the test for the actors (Ray's
workers inherit the raylet's environment, fixed when Ray starts; the recording reward functions' file is set for
every Ray below: `reward_record`), a Ray started with other resources or options, or a driver in another process.

One Ray serves every module that takes it in all its tests: those modules run first (pytest_collection_modifyitems
below), one after the other, and the Ray stays up between them (~6 s of start and stop saved per module on 2 cores).
The first test that does not ask for it shuts it down first (tests/conftest.py), so any other test starts its Ray as
a run does; a module that mixes both shuts it down at its end, and so does one that kills processes of its runs
(`KILLS_PROCESSES = True` in the module: what a kill leaves behind stays out of the next module's runs); those
modules run last in the group.
"""
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from driver.ray_session import init_ray


# Recording reward functions (test_eval_run, test_gsm8k_run, test_reward_model_run, test_batch_reward_run) append what
# they score to the file this names. Ray's workers inherit the raylet's environment, fixed when Ray starts, so it is
# set here, before any Ray (the shared one included), and each test that reads it empties it first (reward_record).
RECORD_ENV = "RLHF_ORCH_TEST_REWARD_RECORD"
os.environ.setdefault(RECORD_ENV, os.path.join(tempfile.mkdtemp(prefix="rlhf_orch_record_"), "scored.jsonl"))


@pytest.fixture
def reward_record() -> Path:
    """The recording reward functions' file, emptied."""
    path = Path(os.environ[RECORD_ENV])
    path.write_text("")
    return path


def _all_shared(items) -> bool:
    return all("shared_ray" in item.fixturenames for item in items)


def _start_shared_ray(config) -> None:
    if not ray.is_initialized():
        init_ray(SimpleNamespace(ray=SimpleNamespace(address=None, num_cpus=2)), shared=True)   # what `ray.num_cpus=2` runs start
        config.shared_ray_up = True


@pytest.fixture(scope="module")
def shared_ray(request):
    _start_shared_ray(request.config)
    yield
    module_items = [i for i in request.session.items if i.module is request.module]
    if not _all_shared(module_items) or getattr(request.module, "KILLS_PROCESSES", False):
        request.config.stop_shared_ray()   # the next module starts from a fresh Ray


@pytest.fixture(scope="session")
def baseline_run(request, tmp_path_factory):
    """(run folder, records) of configs/tiny_cpu.yaml for 20 steps: the recorded 20-step baseline's own command
    (tests/baselines.py) plus a checkpoint every 5 steps, all kept (numerically neutral; rl_state.pt of step 5 holds
    the engines' sampling RNGs as step 5 left them, as a 5-step run's final checkpoint does). Made once, on the
    shared Ray, by the first test that asks: test_async_rollouts checks it against the recording, test_eval_run
    compares its first 5 steps with a run that evaluates. Only for modules that take `shared_ray` (a session fixture
    is set up before the module's, so it starts the shared Ray itself)."""
    import json
    import launch   # the driver's imports: only where a test asks for this run
    _start_shared_ray(request.config)
    out = tmp_path_factory.mktemp("baseline_run")
    root = Path(__file__).resolve().parents[2]
    assert launch.main(["--config", str(root / "configs/tiny_cpu.yaml"), f"experiment.output_dir={out}",
                        "experiment.name=sync20", "experiment.steps=20", "ray.num_cpus=2", "metrics.trackers=[jsonl]",
                        "metrics.ray_metrics=false", "metrics.plots=false", "trainer.checkpoint_every=5",
                        "trainer.keep_checkpoints=0"]) == 0
    run = out / "sync20"
    return run, [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


def pytest_collection_modifyitems(config, items):
    """Modules whose every test takes the shared Ray first (in their own order), then the other integration modules,
    so that one Ray serves the first group. Items outside tests/integration keep their places."""
    mine = [i for i, item in enumerate(items) if "integration" in item.nodeid.split("/")]
    if not mine:
        return
    by_module: dict = {}
    for i in mine:
        by_module.setdefault(items[i].module, []).append(items[i])
    shared = [m for m, its in by_module.items() if _all_shared(its)]
    shared.sort(key=lambda m: getattr(m, "KILLS_PROCESSES", False))   # stable: those that kill go last
    ordered = [it for m in shared for it in by_module[m]] + [it for m, its in by_module.items() if m not in shared for it in its]
    for slot, item in zip(mine, ordered):
        items[slot] = item
