"""The run's checkpoints, seen from the driver: find the one to resume from, write one, restore it, keep the engines'
sampling RNGs as each step leaves them, and freeze the KL reference.

A checkpoint is written into a staging folder (every trainer rank's DeepSpeed state, a separate critic's, the RL
state: step, weight version, data cursor, draws not trained yet, the run's ledger, the engines' sampling RNGs, and an
HF export), given a manifest of digests and renamed; `latest` moves last, so an interrupted save leaves the previous
checkpoint in charge (rlhf_orch/checkpoint.py owns the files and that protocol). Resuming takes the last good one (a
corrupt latest: the one before) and says in `resume_notes` why a resume is not bit-exact.

Step snapshots (fault_tolerance.step_snapshots) are the same checkpoint, without the HF export, written after every
step into a folder in RAM (rlhf_orch/checkpoint.py's snapshot_dir) that keeps only the newest: a run restarted after a
trainer rank died resumes from whichever of the snapshot and the periodic checkpoint holds the later step (issue #34).

It holds no actor: the trainer, critic and reference groups and the engines it writes from or restores into are
passed to each call (driver/cluster.py's Cluster owns them). It decides nothing about when to checkpoint (launch.py).
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from actors.common import get
from rlhf_orch.checkpoint import (MANIFEST, checkpoint_dir, commit, find_good, kept_tags, mark_latest, read_rl_state,
                                  snapshot_dir, staging_dir, step_tags, tag_step, write_rl_state)
from rlhf_orch.errors import CheckpointError, EngineError
from rlhf_orch.storage import Store, run_uri
from rlhf_orch.metrics.timeline import Timeline
from rlhf_orch.run_dir import upload_records
from rlhf_orch.trainer.export import export_spec

logger = logging.getLogger(__name__)


class Checkpoints:
    def __init__(self, cfg, run_dir: Path, model_path: str, timeline: Timeline):
        self.cfg, self.model_path, self.timeline = cfg, model_path, timeline
        self.dir = checkpoint_dir(run_dir)
        ft = cfg.fault_tolerance
        self.snap_dir = snapshot_dir(run_dir, ft.snapshot_dir) if ft.step_snapshots else None
        self.resume_from: tuple[Path, str, dict, dict] | None = None   # (folder, tag, rl_state, tensors) when resuming
        self.resume_notes: list[str] = []    # why a checkpoint was skipped, or why the resume is not bit-exact
        self.boundary_rngs: dict | None = None   # engines' sampling RNGs after the last completed step (step_boundary)
        self._rng_capable = True
        uri = cfg.experiment.storage_uri   # the run folder mirrored there (rlhf_orch/storage.py)
        self.store = Store(run_uri(uri, cfg.experiment.name)) if uri else None
        self.remote_nodes: list = []   # one trainer rank per node other than the driver's (Cluster sets it)
        self._reference_stored = False   # the reference is in storage_uri (one remote read per driver, not per save)

    def find(self) -> dict | None:
        """The RL state of the last good checkpoint, read once at start (None: there is none); notes why a corrupt
        latest one was skipped."""
        if self.store is not None:
            self._fetch_latest()
        tag, self.resume_notes = find_good(self.dir)
        folder = self.dir
        # A step snapshot later than the periodic checkpoint wins, if this folder holds the run it was taken of (one
        # deleted and started again with resume: true finds a failed run's snapshot in RAM, but no rollouts.jsonl).
        if self.snap_dir is not None and (self.dir.parent / "rollouts.jsonl").exists():
            snap, notes = find_good(self.snap_dir)
            self.resume_notes += notes
            if tag_step(snap) > tag_step(tag):
                tag, folder = snap, self.snap_dir
        if tag is None:
            return None
        state, tensors = read_rl_state(folder / tag)
        self.resume_from = (folder, tag, state, tensors)
        return state

    def clear_snapshots(self) -> None:
        """Free the RAM of the step snapshots (a fresh run's start: an earlier run's are stale; a run's end)."""
        if self.snap_dir is not None and self.snap_dir.exists():
            shutil.rmtree(self.snap_dir, ignore_errors=True)

    def engine_rngs(self, engines: dict, slots: dict, timeout: float) -> dict:
        """{slot: sampling RNG state} of every live engine that can save one (a replacement restores its slot)."""
        rngs, refs = {}, {n: e.rng_state.remote() for n, e in engines.items()}   # one round trip for all
        for n, ref in refs.items():
            try:   # a dead engine must not cost the trainer's checkpoint; it restarts with a fresh RNG
                rngs[slots[n]["base"]] = get(ref, timeout, f"engine {n} RNG state", EngineError)
            except EngineError as err:
                logger.warning("no sampling RNG state from engine %s: %s", n, str(err).splitlines()[0])
        return rngs

    def step_boundary(self, engines: dict, slots: dict, timeout: float) -> None:
        """After a completed step (max_staleness 0): remember the engines' sampling RNGs as they are now, before the
        next step generates, so a checkpoint of this step written later (after a failure mid-next-step) resumes
        exactly. Skipped when no engine can save its RNG (vLLM, SGLang) or engines generate ahead (k >= 1)."""
        if self.cfg.rollout.max_staleness or not self._rng_capable:
            return
        self.boundary_rngs = self.engine_rngs(engines, slots, timeout)
        self._rng_capable = any(v is not None for v in self.boundary_rngs.values())

    def write(self, step: int, rollout_state: dict, ledger: dict, trainers, critics, engines: dict, slots: dict,
              timeout: float, snapshot: bool = False) -> dict:
        """Checkpoint `step`: `rollout_state` is the manager's state after it, `ledger` the run's whole ledger.
        `snapshot`: a step snapshot (no HF export; only the newest kept). Returns its seconds and gigabytes."""
        tag, base, t0 = f"step{step}", self.snap_dir if snapshot else self.dir, time.perf_counter()
        with self.timeline.span("trainer", "snapshot" if snapshot else "checkpoint"):
            stage = staging_dir(base, tag)
            path = trainers.call("save_checkpoint", str(base), stage.name, {"step": step})[0]
            if critics is not None:   # where a colocated critic saves too: inside the policy's tag folder
                critics.call("save_checkpoint", path, "critic")
            rngs = self.boundary_rngs if self.boundary_rngs is not None else self.engine_rngs(engines, slots, timeout)
            missing = sorted(slot for slot in {slots[n]["base"] for n in engines} if rngs.get(slot) is None)
            for slot in missing:
                logger.warning("checkpoint %s without engine %s's sampling RNG: resuming from it is not bit-exact",
                               tag, slot)
            # The data cursor is after every draw; draws not yet trained (max_staleness >= 1) are re-queued on resume.
            write_rl_state(stage, {"step": step, "weight_version": step, "data": rollout_state["data"],
                                   "rollout": {"pending": rollout_state["pending"], "ledger": ledger},
                                   "engine_rng_missing": sorted(missing)},
                           {f"engine_rng/{n}": r for n, r in rngs.items() if r is not None})
            if self.cfg.trainer.export_hf and not snapshot:   # the policy with the run's tokenizer, chat template, sampling
                trainers.call("export_hf", str(stage / "hf"), export_spec(self.cfg, self.model_path))
            final = commit(base, tag, 1 if snapshot else self.cfg.trainer.keep_checkpoints)
            if self.store is not None and not snapshot:
                self._publish(tag, final, timeout)
        gb = sum(f.stat().st_size for f in final.rglob("*") if f.is_file()) / 1e9
        (logger.debug if snapshot else logger.info)("%s %s written (%.3f GB)", "snapshot" if snapshot else "checkpoint",
                                                    final, gb)
        return {"s": time.perf_counter() - t0, "gb": gb}

    def restore(self, trainers, critics, engines: dict, timeout: float) -> dict | None:
        """Load the checkpoint found at start into the trainers and engines' RNGs; None if there was none."""
        if self.resume_from is None:
            logger.warning("no checkpoint in %s to continue from: starting from step 1", self.dir)
            return None
        folder, tag, state, tensors = self.resume_from
        if self.store is not None and folder == self.dir:   # ranks on other nodes fetch it onto their own disks
            get([a.fetch_tree.remote(self.store.uri, f"checkpoints/{tag}", str(folder / tag)) for a in self.remote_nodes],
                timeout, f"trainer ranks to download checkpoint {tag}", CheckpointError)
        trainers.call("load_checkpoint", str(folder), tag)
        if critics is not None:
            critics.call("load_checkpoint", str(folder / tag), "critic")
        get([e.set_rng_state.remote(tensors.get(f"engine_rng/{n}")) for n, e in engines.items()],
            timeout, "engine RNG restore", EngineError)
        lost = [n for n in engines if f"engine_rng/{n}" not in tensors]
        if lost:
            self.resume_notes.append(f"resume from {tag} is not bit-exact: no sampling RNG state for engine(s) "
                                     f"{lost} (dead when it was written, or an engine kind that cannot save it)")
            logger.warning("%s", self.resume_notes[-1])
        logger.info("resumed from %s (step %d)", folder / tag, state["step"])
        return state

    # ---- the mirror in storage_uri ------------------------------------------------------------------------------
    def _publish(self, tag: str, final: Path, timeout: float) -> None:
        """Upload committed checkpoint `tag`: every other node's files by a trainer rank there (from its staging folder
        when the rename happened only here), then this node's, then the manifest of all, then `latest`; then the run's
        outputs and the newest keep_checkpoints remote checkpoints kept."""
        t0, rel = time.perf_counter(), f"checkpoints/{tag}"
        others = get([a.upload_files.remote([str(final), str(final.parent / f".tmp-{tag}")], self.store.uri, rel)
                      for a in self.remote_nodes], timeout, f"trainer ranks to upload checkpoint {tag}", CheckpointError)
        manifest = json.loads((final / MANIFEST).read_text())
        for files in others:   # shards this node never saw: their digests as the ranks that wrote them computed
            manifest["files"].update({n: {"bytes": b, "sha256": h} for n, (b, h) in files.items()
                                      if n not in manifest["files"] and n != MANIFEST})
        self.store.put_tree(final, rel, skip=(MANIFEST,), hashes=False)
        self.store.write(f"{rel}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        self.store.write("checkpoints/latest", f"{tag}\n".encode())   # the commit
        if not self._reference_stored and (self.dir / "reference.pt").exists():
            if self.store.read("checkpoints/reference.pt.done") is None:
                self.store.put_file(self.dir / "reference.pt", "checkpoints/reference.pt")
                self.store.write("checkpoints/reference.pt.done", b"1")
            self._reference_stored = True
        tags = step_tags(self.store.dirs("checkpoints"))
        kept = kept_tags(tags, tag, self.cfg.trainer.keep_checkpoints)   # the local folder's rule
        for old in [t for t in tags if t != tag and t not in kept]:
            self.store.remove(f"checkpoints/{old}")
        upload_records(self.store, self.dir.parent)
        logger.info("checkpoint %s uploaded to %s in %.1f s (%d other node(s))", tag, self.store.uri,
                    time.perf_counter() - t0, len(self.remote_nodes))

    def _fetch_latest(self) -> None:
        """Before resuming: the checkpoint the remote `latest` names, the reference and the run's records, downloaded
        into this node's run folder where missing (find_good then verifies them against the manifest)."""
        tag = (self.store.read("checkpoints/latest") or b"").decode().strip()
        for name in ("metrics.jsonl", "rollouts.jsonl", "summary.json", "timeline.jsonl"):
            if not (self.dir.parent / name).exists():
                self.store.get_file(name, self.dir.parent / name)
        if not tag:
            return
        got = self.store.get_tree(f"checkpoints/{tag}", self.dir / tag)
        if not (self.dir / "reference.pt").exists():
            self.store.get_file("checkpoints/reference.pt", self.dir / "reference.pt")
        mark_latest(self.dir, tag)
        logger.info("checkpoint %s from %s: %.3f GB downloaded", tag, self.store.uri, got / 1e9)

    @property
    def reference_path(self) -> str:
        return str(self.dir / "reference.pt")

    def snapshot_reference(self, resumed: bool, trainers, references) -> None:
        """Freeze the KL reference as RL starts (a resumed run reuses the saved one): inside every policy rank, or
        written once by the policy ranks and loaded by the separate reference group."""
        keep = references is None
        if resumed and self.store is not None:   # the frozen reference onto the other nodes' disks
            get([a.fetch_file.remote(self.store.uri, "checkpoints/reference.pt", self.reference_path)
                 for a in self.remote_nodes], self.cfg.ray.get_timeout_s, "the reference's download", CheckpointError)
        trainers.call("snapshot_reference", self.reference_path, resumed, keep)
        if not keep:
            with self.timeline.span("reference", "load"):
                references.load(self.model_path, self.cfg, self.reference_path)
