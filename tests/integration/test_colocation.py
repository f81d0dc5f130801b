"""Colocation on CPU: the colocated hf engine sleeps (level 2: weights dropped) while the trainer trains,
and the trainer offloads its ZeRO state while the engines generate. The whole hand-over sequence runs
through real Ray actors and DeepSpeed; it must change nothing in the numbers: losses, rewards and sync
digests equal a run without it (ZeRO-2: the recorded synchronous-loop baseline, whose command this run is but for
the hand-overs and the bucket size; ZeRO-3: a plain run beside it), and every sync after a wake is
checksum-verified. The ZeRO-2 run is also the RL loop's end-to-end check through both transports
(rl_steps_through_both_transports).

`trainer.offload: auto` on CPU moves nothing and trains as the recorded baseline. That run is also the check of both
ways a sync's loads are checked (it was test_sync_paths.py, a run of its own with the baseline's command): the
colocated engine compares every tensor with the trainer's checksums itself (its mailbox stream), while the dedicated
one, over broadcast, reports its checksums and stays paused until the coordinator has compared them (`hold`, then
`commit`): the path tensor-parallel SGLang takes, which the hf engine's `unchecked_broadcast` test hook forces there.
Neither changes a number, so the run must be the recorded baseline's first steps to 1e-6, sync digests included."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402
from baselines import baseline  # noqa: E402
from engine_hooks import set_engine_hooks  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]


def _run(tmp_path, name, zero_stage, extra):
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "experiment.steps=3", f"experiment.name={name}",
                      f"experiment.output_dir={tmp_path}", f"trainer.zero_stage={zero_stage}",
                      "ray.num_cpus=2", "metrics.ray_metrics=false", "weight_sync.bucket_size_mb=0.1", *extra])
    assert rc == 0
    return [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


COLOC = ["engines.0.sleep_level=2", "trainer.offload=true"]


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_sleep_and_offload_change_nothing_but_memory(tmp_path, zero_stage):
    if zero_stage == 2:   # the baseline's own command (warm start 30) with the hand-overs: compared with its records
        base = baseline("tiny_cpu_20steps")
        coloc = _run(tmp_path, "coloc", 2, COLOC)
        rl_steps_through_both_transports(tmp_path / "coloc", coloc)
        for want, got in zip(base["steps"], coloc):
            for key in base["keys"]:
                assert abs(want[key] - got[key]) <= 1e-6, (want["step"], key, want[key], got[key])
    else:   # no ZeRO-3 baseline is recorded: a plain run beside it (a short warm start keeps both quick)
        plain = _run(tmp_path, "plain", 3, ["trainer.warm_start_steps=2"])
        rl_steps_through_both_transports(tmp_path / "plain", plain)
        coloc = _run(tmp_path, "coloc", 3, [*COLOC, "trainer.warm_start_steps=2", "metrics.plots=false",
                                            "metrics.trackers=[jsonl]"])
        assert len(coloc) == len(plain) == 3
        for a, b in zip(plain, coloc):
            for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "sync/digest", "train/kl"):
                assert b[key] == pytest.approx(a[key], abs=1e-6), key
            assert "colocate/sleep_s" not in a and "colocate/handover_s" not in a
    assert len(coloc) == 3
    for b in coloc:
        assert b["sync/checksum_ok"] == 1.0
        # every hand-over ran: engines slept and woke (weights for the sync, KV for generation), trainers moved
        for key in ("colocate/sleep_s", "colocate/reload_s", "colocate/wake_weights_s", "colocate/offload_s",
                    "colocate/wake_kv_s", "perf/to_generate_s", "perf/to_train_s", "colocate/handover_s",
                    "colocate/moved_gb"):
            assert key in b, key
        assert b["colocate/handover_s"] > 0 and "colocate/plan_offload" not in b   # a plan only under offload: auto


def rl_steps_through_both_transports(run: Path, records: list[dict]) -> None:
    """RL steps through real Ray actors, real DeepSpeed ranks (ZeRO-2 and ZeRO-3, gloo) and real gloo/shared-memory
    weight sync into two hf engines: one colocated (ipc), one dedicated (broadcast), in buckets of 0.1 MB. (It was
    test_rl_loop's own two-step run; the runs above are that run with one step more, ZeRO-2's with the hand-overs.)"""
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["sync/version"] == r["step"]
        assert r["sync/checksum_ok"] == 1.0
        assert r["sync/ipc_engines"] == 1 and r["sync/broadcast_engines"] == 1
        assert r["sync/bytes"] > 400_000          # the whole tiny model moved
        assert r["rollout/samples"] == 16 * 8
        # engines generated with exactly the trainer's weights
        assert r["rollout/logprob_diff_max"] < 1e-3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["syncs"] == 4 and summary["verified_syncs"] == 4
    assert set(summary["transports"].values()) == {"ipc from trainer rank 0", "broadcast from trainer rank 0"}
    assert (run / "plots" / "reward.png").stat().st_size > 1000
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step3"
    assert json.loads((run / "checkpoints" / "step3" / "rl_state.json").read_text())["step"] == 3


def test_offload_auto_moves_nothing_and_a_self_checking_and_a_coordinator_checked_engine_sync_as_the_baseline(
        tmp_path, monkeypatch):
    """`trainer.offload: auto` with a sleeping colocated engine configured: on CPU there is no GPU memory to share,
    so nothing moves (the plan says so once in step 1's metrics), and the run is the offload: false run, whose per-step
    numbers are the recorded synchronous-loop baseline. The dedicated engine leaves the check of its loads to the
    coordinator (held, then committed: test_sync_paths.py's run, folded in here), which must change no number either."""
    recorded = baseline("tiny_cpu_20steps")
    base = recorded["steps"]
    set_engine_hooks(monkeypatch, {}, {"unchecked_broadcast": True})   # engines.0: colocated; engines.1: dedicated
    assert launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                        "experiment.name=auto", "experiment.steps=3", "trainer.offload=auto", "engines.0.sleep_level=2",
                        "ray.num_cpus=2", "metrics.ray_metrics=false", "metrics.plots=false",
                        "metrics.trackers=[jsonl]"]) == 0
    recs = [json.loads(l) for l in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for want, got in zip(base, recs):
        for key in recorded["keys"]:   # every recorded key (loss, KL, grad norm, rewards, sync digest, ...)
            assert abs(want[key] - got[key]) <= 1e-6, (want["step"], key, want[key], got[key])
        assert got["sync/held_engines"] == 1   # the dedicated engine's loads checked by the coordinator
        assert got["sync/checksum_ok"] == 1.0
        assert got["colocate/moved_gb"] == 0.0 and got["colocate/handover_s"] < 0.05
        assert not any(k in got for k in ("colocate/sleep_s", "colocate/offload_s", "colocate/reload_s",
                                          "colocate/wake_kv_s", "colocate/wake_weights_s"))
    assert (recs[0]["colocate/plan_offload"], recs[0]["colocate/plan_sleep"]) == (0.0, 0.0)
    assert "colocate/plan_offload" not in recs[1]
