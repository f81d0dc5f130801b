"""Engine faults through real Ray actors and real process deaths (two hf engines, two DeepSpeed ranks).

- SIGKILL the dedicated engine's process at step ~10 of 40: its groups go back to the queue, the colocated engine
  serves them, a replacement starts on the same bundle (slowly, as vLLM does: a test hook) while the run goes on
  with the survivor, joins a re-planned broadcast group once up, gets the weights (its first sync verified) and
  takes work. The run finishes all 40 steps, every prompt trained exactly once.
- SIGSTOP it instead (a frozen process: it answers nothing): the health check declares it hung within
  fault_tolerance.engine_stall_s, kills it and replaces it. This test and the two that follow its replacement's
  first sync or its own hang run with fault_tolerance.replacement_start=wait (the step waits for the replacement).
- SIGKILL each kind of sync member in the middle of a weight sync (a test hook makes each bucket's load slow): the
  colocated engine, the dedicated engine, trainer rank 0. The others abandon the sync at once (issue #33), the
  driver replaces the engine and syncs again, or restarts the run for the trainer, and the run finishes.
"""
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402
from bench.recovery import kill_in_turn, pid_of  # noqa: E402
from engine_hooks import set_engine_hooks  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
KILLS_PROCESSES = True   # the shared Ray is shut down after this module (tests/integration/conftest.py)
COMMON = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false",
          "trainer.warm_start_steps=0", "experiment.log_samples_every=0"]
SLOW = {"decode_delay_s": 0.005}   # every engine a little slower (test hooks: tests/engine_hooks.py)


@pytest.fixture(autouse=True)
def _slow_engines(monkeypatch):
    set_engine_hooks(monkeypatch, SLOW, SLOW)


def _fault_at(run_dir: Path, step: int, sig: int, actor_suffix: str, out: dict) -> threading.Thread:
    """A thread that sends `sig` to the engine actor's process once `step` steps are in metrics.jsonl."""
    def go():
        try:
            kill()
        except Exception as e:   # seen by the test's assertion on `out`
            out["error"] = repr(e)

    def kill():
        metrics = run_dir / "metrics.jsonl"
        deadline, pid = time.time() + 300, None
        while time.time() < deadline:
            if pid is None and ray.is_initialized():   # look the process up early (before the step comes)
                pid = pid_of(actor_suffix)
            if pid and metrics.exists() and len(metrics.read_text().splitlines()) >= step:
                break
            time.sleep(0.05)
        lines = metrics.read_text().splitlines()
        out.update(pid=pid, t=time.time(), at_step=len(lines), lines=lines)   # the records before the kill
        os.kill(pid, sig)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _check_run(run: Path, steps: int, prompts: int = 16, overlapped: bool = False):
    """Every step once, every sync verified, every prompt trained once, the ledger balanced. `overlapped`
    (weight_sync.overlap): every step overlapped its sync, and step s reports the sync of version s-1 (step 1 none)."""
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    if overlapped:
        assert all(r["sync/overlapped"] == 1.0 for r in records) and "sync/checksum_ok" not in records[0]
    assert all(r["sync/checksum_ok"] == 1.0 for r in (records[1:] if overlapped else records))
    trained = [tuple(s) for l in (run / "rollouts.jsonl").read_text().splitlines() for s in json.loads(l)["sources"]]
    assert len(trained) == steps * prompts and len(set(trained)) == len(trained)      # each prompt exactly once
    summary = json.loads((run / "summary.json").read_text())
    led = summary["ledger"]
    assert led["balanced"] == 1 and led["trained"] == steps * prompts
    return records, summary


def test_killed_engine_is_replaced_resynced_and_nothing_is_lost(tmp_path, monkeypatch):
    # The dedicated engine (and so its replacement) starts 2 s slower; the survivor serves steps of ~0.4 s alone,
    # so the ~7 s a replacement takes here (2 s of it the hook) leave ~5 s to spare before the run's end.
    set_engine_hooks(monkeypatch, {"decode_delay_s": 0.06}, {**SLOW, "start_delay_s": 2.0})
    run = tmp_path / "kill"
    info = {}
    killer = _fault_at(run, 10, signal.SIGKILL, "-engine-dedicated", info)
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                      "experiment.name=kill", "experiment.steps=40", *COMMON])
    killer.join(timeout=5)
    assert rc == 0 and "pid" in info, info
    records, summary = _check_run(run, 40)
    [fault] = summary["faults"]
    assert fault["engine"] == "dedicated" and fault["replacement"] == "dedicated.r1"
    assert fault["first_sync_verified"] is True and 0 < fault["recovery_s"] < 120
    assert "died" in fault["cause"]
    assert records[-1]["fault/engine_restarts"] == 1 and records[-1]["fault/engines_live"] == 2
    # The steps went on with the survivor alone while the replacement started (they did not wait for it).
    alone = [r["step"] for r in records if r["fault/engines_live"] == 1]
    assert len(alone) >= 2 and alone == list(range(alone[0], alone[-1] + 1)) and alone[-1] < 40, alone
    assert summary["verified_syncs"] == summary["syncs"]
    # the replacement took work after its verified sync; the dead engine's last span is before its death
    events = [json.loads(l) for l in (run / "timeline.jsonl").read_text().splitlines()]
    assert any(e["actor"] == "engine:dedicated.r1" and e["phase"] == "generate" for e in events)
    assert any(e["actor"] == "engine:dedicated" and e["phase"] == "dead" for e in events)


def test_frozen_engine_is_declared_hung_and_replaced(tmp_path):
    run = tmp_path / "hang"
    info = {}
    freezer = _fault_at(run, 5, signal.SIGSTOP, "-engine-dedicated", info)
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                      "experiment.name=hang", "experiment.steps=12", "fault_tolerance.engine_stall_s=4",
                      "fault_tolerance.health_interval_s=0.5", "fault_tolerance.replacement_start=wait", *COMMON])
    freezer.join(timeout=5)
    assert rc == 0 and "pid" in info, info
    records, summary = _check_run(run, 12)
    [fault] = summary["faults"]
    assert fault["engine"] == "dedicated" and fault["first_sync_verified"] is True
    assert fault["t"] - info["t"] < 4 + 2 * 0.5 + 3      # detected within its deadline (plus one check interval)
    assert "health check" in fault["cause"] or "hung" in fault["cause"]


def test_the_only_engine_dies_and_a_replacement_gets_the_current_weights_at_once(tmp_path):
    """No engine left mid-step: the driver replaces it right away (the trainer still holds the version the step
    needs), syncs it over CUDA-IPC's CPU stand-in (shared memory), and the step goes on. The engine sleeps while
    the trainer trains and the trainer offloads while it generates (the GPU colocation hand-overs), so its death
    is usually seen by a hand-over (found on an H200 with vLLM: the trainer had to be reloaded before the sync)."""
    import yaml
    cfg = yaml.safe_load((ROOT / "configs/tiny_cpu.yaml").read_text())
    cfg["engines"] = [{**cfg["engines"][0], "sleep_level": 2}]   # only the colocated engine (ipc route)
    cfg["trainer"]["offload"] = True
    path = tmp_path / "one_engine.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "alone"
    info = {}
    killer = _fault_at(run, 4, signal.SIGKILL, "-engine-colocated", info)
    rc = launch.main(["--config", str(path), f"experiment.output_dir={tmp_path}", "experiment.name=alone",
                      "experiment.steps=30", *COMMON])
    killer.join(timeout=5)
    assert rc == 0 and "pid" in info, info
    records, summary = _check_run(run, 30)
    [fault] = summary["faults"]
    assert fault["engine"] == "colocated" and fault["replacement"] == "colocated.r1"
    assert fault["first_sync_verified"] is True
    assert records[-1]["sync/ipc_engines"] == 1 and records[-1]["fault/engines_live"] == 1


def test_engine_without_progress_is_declared_hung_and_restarts_are_bounded(tmp_path, monkeypatch):
    """The dedicated engine answers its health checks but takes 10 s per decode step (longer than
    engine_stall_s): it is hung. Its replacement (same config) hangs too; with max_engine_restarts=1 spent, the run
    finishes on the colocated engine, and summary.json lists both faults."""
    run = tmp_path / "slow"
    set_engine_hooks(monkeypatch, SLOW, {"decode_delay_s": 10})   # the dedicated engine makes no progress
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                      "experiment.name=slow", "experiment.steps=4", "fault_tolerance.engine_stall_s=3",
                      "fault_tolerance.health_interval_s=0.5", "fault_tolerance.max_engine_restarts=1",
                      "fault_tolerance.replacement_start=wait", *COMMON])
    assert rc == 0
    records, summary = _check_run(run, 4)
    assert [(f["engine"], f["replacement"]) for f in summary["faults"]] == [("dedicated", "dedicated.r1"),
                                                                             ("dedicated.r1", None)]
    assert all("no progress" in f["cause"] for f in summary["faults"])
    assert records[-1]["fault/engines_live"] == 1 and records[-1]["fault/engine_restarts"] == 1


def test_a_member_killed_during_a_weight_sync_is_abandoned_by_the_others_at_once(tmp_path, monkeypatch):
    """Issue #33 (and #17 before it). Each kind of sync member is SIGKILLed while a sync is in flight, in one run:
    the colocated engine (ipc), then the dedicated one (broadcast), then trainer rank 0 (the sender). Every engine
    sleeps 1 s before loading a bucket (`sync_delay_s`), so each sync lasts long enough to be hit. The survivors
    must abandon the sync at once (the coordinator aborts it; before #33 the dedicated engine waited for the sync
    timeout, 60 s, for the checksums the dead side never sent), before the replacement is even started; the
    replacement's first sync is verified; the trainer's death restarts the run from its step-8 checkpoint; the run
    ends with every step once."""
    run = tmp_path / "midsync"
    info: list = []
    killer = kill_in_turn(run, [("-engine-colocated", 3, "-engine-dedicated"),
                                ("-engine-dedicated", 6, "-engine-colocated.r1"),
                                ("-trainer-0", 10, "-engine-colocated.r1")], info, poll_s=0.02)
    set_engine_hooks(monkeypatch, {**SLOW, "sync_delay_s": 1.0}, {**SLOW, "sync_delay_s": 1.0})
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                      "experiment.name=midsync", "experiment.steps=12", "trainer.checkpoint_every=4",
                      # each step waits for a replacement's first verified sync: started in the background, the
                      # dedicated one's first sync was at times the one the trainer's kill at step ~10 aborts
                      "fault_tolerance.replacement_start=wait", *COMMON])
    killer.join(timeout=5)
    assert rc == 0 and len(info) == 3 and all("pid" in k for k in info), info
    _, summary = _check_run(run, 12)
    assert summary["status"] == "finished"
    timeout_s = 60.0   # the sync deadline these runs have (weight_sync.timeout_s default: 60 s + 10 s per GB)
    engines, trainer = summary["faults"][:2], summary["faults"][2]
    for f, (name, new) in zip(engines, [("colocated", "colocated.r1"), ("dedicated", "dedicated.r2")]):
        assert (f["engine"], f["replacement"], f["phase"]) == (name, new, "mid-sync"), f
        # every survivor let go within seconds of the failure, aborted (not timed out), before the replacement started
        assert f["survivors_let_go_s"] < 5 < timeout_s and f["survivors"], f
        assert not any("timed out" in s["how"] or "deadline" in s["how"] for s in f["survivors"].values()), f
        assert f["t_failure_seen"] + f["survivors_let_go_s"] <= f["replacement_t"], f
        assert f["first_sync_verified"] is True and f["to_serving_s"] < timeout_s, f
    assert any(s["how"].startswith("SyncAborted") for f in engines for s in f["survivors"].values())
    assert trainer["victim"] == "trainer rank 0" and trainer["phase"] == "mid-sync", trainer
    assert trainer["recovery"] == "run restart" and trainer["survivors_let_go_s"] < 5, trainer
    [restart] = summary["run_restarts"]
    assert "died" in restart["error"] and summary["resumed_from"] == 8


def test_an_engine_killed_during_an_overlapped_sync_is_replaced_from_the_staged_weights(tmp_path, monkeypatch):
    """Issue #27 item 2 with #33: at max_staleness 1 the sync of step s overlaps step s+1 (weight_sync.overlap auto),
    and the trainer ranks may already hold step s+1's weights when its failure is seen. The dedicated engine is
    SIGKILLed inside such a transfer (its loads take 1 s): the driver sees the failed sync while it waits for the next
    batch (the survivor stays paused until a verified sync), replaces the engine, sends the staged copy of version s
    again to both, and the run finishes with every step once and every sync verified. Later the weight-sync
    coordinator is SIGKILLed inside another overlapped transfer (issue #34): it is replaced in place and the staged
    copy sent again, verified, without a run restart."""
    run = tmp_path / "overlap_kill"
    info: list = []
    killer = kill_in_turn(run, [("-engine-dedicated", 3, "-engine-dedicated"),
                                ("-weight-sync", 5, "-engine-dedicated.r1")], info, poll_s=0.02)
    set_engine_hooks(monkeypatch, SLOW, {**SLOW, "sync_delay_s": 1.0})   # the dedicated engine syncs slowly
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                      "experiment.name=overlap_kill", "experiment.steps=8", "rollout.max_staleness=1",
                      "metrics.plots=false", "fault_tolerance.replacement_start=wait", *COMMON])
    killer.join(timeout=5)
    assert rc == 0 and len(info) == 2 and all("pid" in i for i in info), info
    _, summary = _check_run(run, 8, overlapped=True)
    assert summary["status"] == "finished" and summary["verified_syncs"] == summary["syncs"] == 9
    assert summary["run_restarts"] == []
    [f, c] = summary["faults"]
    assert (f["engine"], f["replacement"], f["phase"]) == ("dedicated", "dedicated.r1", "mid-sync"), f
    assert f["first_sync_verified"] is True and f["survivors_let_go_s"] < 5, f
    assert f["first_sync_version"] == f["sync_version"], f   # the staged version again, not the trainer's later one
    assert c["victim"] == "weight-sync coordinator" and c["recovery"] == "in place", c
