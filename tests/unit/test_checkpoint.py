"""rlhf_orch.checkpoint: staged commit with a manifest, pruning, verification and fallback, write failures,
and the cadence policy. Pure file I/O on tmp_path: no Ray, no DeepSpeed."""
import errno
import json
import logging
import os

import pytest
import torch

from rlhf_orch import checkpoint as C
from rlhf_orch.errors import CheckpointError, RLHFOrchError

SHARD = "mp_rank_00_model_states.pt"


def save(ckpt, step, keep=0, payload=b""):
    """What the builder does: stage, DeepSpeed-like shard + rl_state (+ an hf/ subfolder), commit."""
    tag = f"step{step}"
    stage = C.staging_dir(ckpt, tag)
    (stage / SHARD).write_bytes(payload or bytes(range(256)) * 40 + str(step).encode())
    (stage / "hf").mkdir()
    (stage / "hf" / "config.json").write_text(json.dumps({"step": step}))
    C.write_rl_state(stage, {"step": step, "weight_version": step}, {"engine_rng/e0": torch.arange(4)})
    return C.commit(ckpt, tag, keep)


@pytest.fixture
def ckpt(tmp_path):
    d = C.checkpoint_dir(tmp_path)
    d.mkdir()
    (d / "reference.pt").write_bytes(b"reference")
    return d


def test_commit_round_trip_with_manifest(ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="rlhf_orch.checkpoint"):
        final = save(ckpt, 10)
    assert "checkpoint step10: manifest of 4 files" in caplog.text and " s" in caplog.text
    assert final == ckpt / "step10" and not (ckpt / ".tmp-step10").exists()
    assert (ckpt / "latest").read_text().strip() == "step10"
    man = json.loads((final / "manifest.json").read_text())
    assert man["tag"] == "step10" and man["step"] == 10 and man["created"]
    assert set(man["files"]) == {SHARD, "hf/config.json", "rl_state.json", "rl_state.pt"}
    assert man["files"][SHARD]["bytes"] == (final / SHARD).stat().st_size
    assert len(man["files"][SHARD]["sha256"]) == 64
    assert C.verify(final) is None
    assert C.find_good(ckpt) == ("step10", [])
    assert C.latest_tag(ckpt) == "step10"
    state, tensors = C.read_rl_state(final)
    assert state["step"] == 10 and torch.equal(tensors["engine_rng/e0"], torch.arange(4))


def test_hashing_is_chunked_and_matches_hashlib(ckpt, monkeypatch):
    monkeypatch.setattr(C, "_CHUNK", 7)              # many chunks, odd boundary
    final = save(ckpt, 1, payload=os.urandom(1000))
    import hashlib
    man = json.loads((final / "manifest.json").read_text())
    assert man["files"][SHARD]["sha256"] == hashlib.sha256((final / SHARD).read_bytes()).hexdigest()


def test_keep_prunes_to_newest_and_keeps_reference(ckpt):
    (ckpt / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script")
    for step in range(1, 6):
        save(ckpt, step, keep=2)
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["latest", "reference.pt", "step4", "step5", "zero_to_fp32.py"]
    assert C.find_good(ckpt) == ("step5", [])


def test_keep_zero_keeps_all(ckpt):
    for step in (1, 2, 3):
        save(ckpt, step, keep=0)
    assert C._step_tags(ckpt) and sorted(C._step_tags(ckpt)) == ["step1", "step2", "step3"]


def test_prune_drops_folders_of_an_abandoned_later_attempt(ckpt):
    save(ckpt, 5)
    save(ckpt, 8)
    C.mark_latest(ckpt, "step5")                     # as if the run resumed from step5 (step8 left behind)
    save(ckpt, 6, keep=2)
    assert sorted(C._step_tags(ckpt)) == ["step5", "step6"]


def test_kept_tags_is_one_rule_for_the_folder_and_the_storage_mirror():
    tags = ["step8", "step6", "step5", "step4", "step2"]   # newest first; step8 from an abandoned attempt
    assert C.kept_tags(tags, "step6", 3) == ["step5", "step4"]
    assert C.kept_tags(tags, "step6", 3, complete=lambda t: t != "step5") == ["step4", "step2"]
    assert C.kept_tags(tags, "step6", 1) == [] and C.kept_tags(tags, "step6", 0) == ["step8", "step5", "step4", "step2"]
    assert C.kept_tags(tags, "final", 2) == ["step8"]   # a tag that is no step: the newest others


@pytest.mark.parametrize("damage, reason", [
    ("flip", f"file {SHARD}: sha256 mismatch"),
    ("truncate", f"file {SHARD}: 5 bytes, manifest says"),
    ("manifest", "manifest.json missing and rl_state.json unreadable"),
    ("delete", f"file {SHARD} missing"),
    ("state", "rl_state.json"),
])
def test_corrupt_newest_falls_back_to_previous(ckpt, damage, reason, caplog):
    save(ckpt, 15)
    save(ckpt, 20)
    d = ckpt / "step20"
    if damage == "flip":
        data = bytearray((d / SHARD).read_bytes())
        data[100] ^= 0xFF
        (d / SHARD).write_bytes(bytes(data))
    elif damage == "truncate":
        (d / SHARD).write_bytes(b"short")
    elif damage == "manifest":                       # no manifest and no rl_state: not even a legacy checkpoint
        (d / "manifest.json").unlink()
        (d / "rl_state.json").unlink()
    elif damage == "delete":
        (d / SHARD).unlink()
    elif damage == "state":
        (d / "rl_state.json").write_text("{not json")   # size may even match: the hash catches it
    with caplog.at_level(logging.WARNING, logger="rlhf_orch.checkpoint"):
        tag, messages = C.find_good(ckpt)
    assert tag == "step15"
    assert len(messages) == 1 and messages[0].startswith("checkpoint step20 is unusable (")
    assert reason in messages[0] and messages[0].endswith("; using step15")
    assert messages[0] in caplog.text
    assert C.verify(d) is not None and C.latest_tag(ckpt) == "step15"


def test_verify_reasons(ckpt):
    final = save(ckpt, 3)
    (final / "manifest.json").unlink()
    assert C.verify(final) == "manifest.json missing"
    (final / "manifest.json").write_text("[")
    assert C.verify(final) == "manifest.json unreadable"
    assert C.verify(ckpt / "step99") == "folder missing"


def test_legacy_checkpoint_without_manifest_is_used_with_a_note(ckpt):
    old = ckpt / "step7"                              # the layout older code wrote: no manifest
    old.mkdir()
    (old / SHARD).write_bytes(b"weights")
    C.write_rl_state(old, {"step": 7}, {})
    C.mark_latest(ckpt, "step7")
    tag, messages = C.find_good(ckpt)
    assert tag == "step7" and len(messages) == 1 and "could not be verified" in messages[0]


def test_no_checkpoint(ckpt):
    assert C.find_good(ckpt) == (None, [])
    assert C.find_good(ckpt.parent / "nowhere") == (None, [])
    (ckpt / "step3").mkdir()                          # a partial folder only
    tag, messages = C.find_good(ckpt)
    assert tag is None and messages[0].endswith("no usable checkpoint left")


def test_crashed_save_uses_old_and_next_commit_cleans_staging(ckpt):
    save(ckpt, 10)
    stage = C.staging_dir(ckpt, "step20")             # the save of step20 dies half way
    (stage / SHARD).write_bytes(b"half")
    C.write_rl_state(stage, {"step": 20}, {})
    (ckpt / "latest").write_text(".tmp-step20")       # even a stray `latest` naming the staging folder
    tag, messages = C.find_good(ckpt)
    assert tag == "step10" and "not a checkpoint folder name" in messages[0]
    C.mark_latest(ckpt, "step10")
    stale = C.staging_dir(ckpt, "step11")             # another leftover of a different tag
    save(ckpt, 12)
    assert not stage.exists() and not stale.exists()
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "reference.pt", "step10", "step12"]


def test_staging_dir_replaces_a_leftover(ckpt):
    stage = C.staging_dir(ckpt, "step4")
    (stage / "junk").write_text("x")
    assert C.staging_dir(ckpt, "step4") == stage and list(stage.iterdir()) == []


def test_redone_step_replaces_the_old_folder(ckpt):
    save(ckpt, 10)
    save(ckpt, 20, payload=b"first attempt")
    C.mark_latest(ckpt, "step10")                     # resumed from step10; step20 is done again
    final = save(ckpt, 20, payload=b"second attempt")
    assert (final / SHARD).read_bytes() == b"second attempt" and C.verify(final) is None
    assert not any(p.name.startswith(".") for p in ckpt.iterdir())
    assert C.find_good(ckpt) == ("step20", [])


def test_commit_refuses_without_rl_state(ckpt):
    save(ckpt, 1)
    stage = C.staging_dir(ckpt, "step2")
    (stage / SHARD).write_bytes(b"x")
    with pytest.raises(CheckpointError, match="rl_state.json"):
        C.commit(ckpt, "step2", 0)
    assert not stage.exists() and C.find_good(ckpt) == ("step1", [])
    with pytest.raises(CheckpointError, match="staging"):
        C.commit(ckpt, "step3", 0)
    with pytest.raises(CheckpointError, match="plain folder name"):
        C.staging_dir(ckpt, "../x")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_read_only_checkpoint_dir(ckpt):
    save(ckpt, 1)
    os.chmod(ckpt, 0o555)
    try:
        with pytest.raises(CheckpointError, match="Permission denied") as exc:
            C.staging_dir(ckpt, "step2")
        assert "checkpoint step2" in str(exc.value)
    finally:
        os.chmod(ckpt, 0o755)
    stage = C.staging_dir(ckpt, "step2")              # staging works, then the folder turns read-only
    C.write_rl_state(stage, {"step": 2}, {})
    os.chmod(ckpt, 0o555)
    try:
        with pytest.raises(CheckpointError, match="Permission denied"):
            C.commit(ckpt, "step2", 1)
    finally:
        os.chmod(ckpt, 0o755)
    assert (ckpt / "latest").read_text().strip() == "step1" and C.find_good(ckpt) == ("step1", [])


def test_rename_failure_keeps_latest_and_previous(ckpt, monkeypatch):
    """The permission case by injection, so it runs as root too."""
    save(ckpt, 1)
    save(ckpt, 2, payload=b"old step2")
    C.mark_latest(ckpt, "step1")
    real = os.rename

    def rename(src, dst):
        if str(src).endswith(".tmp-step2"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(src))
        return real(src, dst)
    monkeypatch.setattr(C.os, "rename", rename)
    stage = C.staging_dir(ckpt, "step2")
    C.write_rl_state(stage, {"step": 2}, {})
    with pytest.raises(CheckpointError) as exc:
        C.commit(ckpt, "step2", 1)
    msg = str(exc.value)
    assert msg.startswith("checkpoint step2: cannot rename ") and msg.endswith("[Errno 13] Permission denied")
    assert isinstance(exc.value, RLHFOrchError) and isinstance(exc.value.__cause__, PermissionError)
    assert not stage.exists() and (ckpt / "step2" / SHARD).read_bytes() == b"old step2"
    assert (ckpt / "latest").read_text().strip() == "step1"
    assert sorted(C._step_tags(ckpt)) == ["step1", "step2"]


def test_disk_full_names_the_os_cause(ckpt, monkeypatch):
    save(ckpt, 1)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    stage = C.staging_dir(ckpt, "step2")
    monkeypatch.setattr(C.os, "fsync", full)
    with pytest.raises(CheckpointError, match=r"checkpoint step2: cannot write .*rl_state\.json: "
                                              r"\[Errno 28\] No space left on device"):
        C.write_rl_state(stage, {"step": 2}, {})
    monkeypatch.undo()
    C.write_rl_state(stage, {"step": 2}, {})
    monkeypatch.setattr(C.os, "fsync", full)
    with pytest.raises(CheckpointError, match=r"No space left on device"):
        C.commit(ckpt, "step2", 1)
    monkeypatch.undo()
    assert not stage.exists() and (ckpt / "latest").read_text().strip() == "step1"
    assert C.find_good(ckpt) == ("step1", [])


def test_policy_steps_and_minutes():
    now = [0.0]
    p = C.CheckpointPolicy(every_steps=5, every_minutes=0, clock=lambda: now[0])
    assert [s for s in range(1, 16) if p.due(s)] == [5, 10, 15]
    p = C.CheckpointPolicy(every_steps=0, every_minutes=2.0, clock=lambda: now[0])
    assert not p.due(1)
    now[0] = 119.0
    assert not p.due(2)
    now[0] = 120.0
    assert p.due(3)
    p.mark_done()
    assert not p.due(4)
    now[0] = 240.0
    assert p.due(5)
    both = C.CheckpointPolicy(every_steps=10, every_minutes=1.0, clock=lambda: now[0])
    assert both.due(10) and not both.due(11)
    now[0] += 60
    assert both.due(11)
    off = C.CheckpointPolicy(0, 0, clock=lambda: now[0])
    now[0] += 1e6
    assert not any(off.due(s) for s in range(1, 50))


def test_snapshot_dir_in_ram_per_user_and_run_folder(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    a, b = C.snapshot_dir(tmp_path / "x" / "run", shm=shm), C.snapshot_dir(tmp_path / "y" / "run", shm=shm)
    assert a.parent == b.parent == shm / f"rlhf_orch-{os.getuid()}" and a != b and a.name.startswith("run-")
    assert C.snapshot_dir(tmp_path / "x" / "run", shm=shm) == a   # the same folder for the same run (a restart)
    assert C.snapshot_dir(tmp_path / "run", shm=tmp_path / "none") == (tmp_path / "run" / "snapshots").resolve()
    assert C.snapshot_dir(tmp_path / "run", "/somewhere/else", shm=shm) == C.Path("/somewhere/else")
    assert [C.tag_step(t) for t in ("step12", "step0", None, "reference", "step3x")] == [12, 0, -1, -1, -1]


def test_driver_resumes_from_the_later_of_snapshot_and_checkpoint(tmp_path):
    """driver/checkpoints.py: a step snapshot later than the periodic checkpoint wins, an earlier one does not; a
    snapshot keeps only the newest; clear_snapshots frees the folder."""
    from driver.checkpoints import Checkpoints
    from rlhf_orch.config import load_config
    from rlhf_orch.metrics.timeline import Timeline
    cfg = load_config("configs/tiny_cpu.yaml", ["fault_tolerance.step_snapshots=true",
                                                f"fault_tolerance.snapshot_dir={tmp_path / 'snaps'}"])
    cp = Checkpoints(cfg, tmp_path / "run", "model", Timeline())
    assert cp.find() is None and cp.resume_from is None
    cp.dir.mkdir(parents=True)
    save(cp.dir, 3, keep=2)
    for step in (4, 5):
        save(cp.snap_dir, step, keep=1)
    assert cp.find()["step"] == 3   # no rollouts.jsonl: the folder was started again, the snapshot is another run's
    (tmp_path / "run" / "rollouts.jsonl").write_text("")
    assert cp.find()["step"] == 5 and cp.resume_from[:2] == (cp.snap_dir, "step5")
    assert sorted(p.name for p in cp.snap_dir.iterdir() if p.name.startswith("step")) == ["step5"]
    save(cp.dir, 6, keep=2)
    assert cp.find()["step"] == 6 and cp.resume_from[:2] == (cp.dir, "step6")
    cp.clear_snapshots()
    assert not cp.snap_dir.exists() and cp.find()["step"] == 6
