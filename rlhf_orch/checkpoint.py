"""What a checkpoint holds besides DeepSpeed's own files, how it is committed, and how a resumed run finds one.

Layout under <run>/checkpoints/:
  latest                 the tag of the newest committed checkpoint (written last, atomically)
  reference.pt           the frozen KL reference (the policy when RL started), written once; never pruned
  .tmp-<tag>/            a checkpoint being written (staging); renamed to <tag>/ by `commit`
  <tag>/                 DeepSpeed's model + optimizer files for every rank
  <tag>/rl_state.json    step, weight version, data cursor (human readable)
  <tag>/rl_state.pt      engines' sampling RNG states (tensors)
  <tag>/hf/              the policy as a Hugging Face folder (safetensors), when export is on
  <tag>/manifest.json    every file above: relative path -> {"bytes", "sha256"}; plus tag, step, created

Saving: `stage = staging_dir(ckpt, tag)`; all files go under `stage` (DeepSpeed: `save_checkpoint(ckpt,
tag=stage.name, save_latest=False)`; its file names do not contain the tag, so the renamed folder loads with
tag=<tag>); then `commit(ckpt, tag, keep)` hashes and fsyncs everything, renames the folder into place, moves
`latest` and prunes. A crash before the rename leaves a `.tmp-*` folder (the next commit removes it) and
`latest` on the previous checkpoint. Write failures raise `CheckpointError` with the OS cause.

Resuming: `find_good(ckpt)` tries the tag in `latest`, then every other `step<N>` folder newest first, and
takes the first whose files match its manifest. Backward compatibility: a folder without manifest.json
(older code) is taken if its rl_state.json reads, with a warning that it could not be verified.
This module does file I/O only; the actors decide what goes in.
"""
from __future__ import annotations

import datetime
import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from rlhf_orch.errors import CheckpointError

logger = logging.getLogger(__name__)

MANIFEST, STAGING_PREFIX, OLD_PREFIX = "manifest.json", ".tmp-", ".old-"
_CHUNK = 1 << 20                      # hash 1 MiB at a time: multi-GB shards never sit in memory
_STEP_TAG = re.compile(r"step(\d+)")
_SAFE_TAG = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]*")   # a plain folder name, not a staging one


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def snapshot_dir(run_dir: str | Path, configured: str | None = None, shm: str | Path = "/dev/shm") -> Path:
    """Where a run's step snapshots live (fault_tolerance.step_snapshots): `configured`, else a folder in RAM
    (/dev/shm) named after the user, the run and the run folder's absolute path (two runs of one name in different
    folders do not share it), else <run>/snapshots."""
    if configured:
        return Path(configured)
    run = Path(run_dir).resolve()
    if not Path(shm).is_dir():
        return run / "snapshots"
    digest = hashlib.sha256(str(run).encode()).hexdigest()[:12]
    return Path(shm) / f"rlhf_orch-{os.getuid()}" / f"{run.name}-{digest}"


def tag_step(tag: str | None) -> int:
    """The step of checkpoint tag `step<N>` (-1 for None or another name)."""
    m = _STEP_TAG.fullmatch(tag or "")
    return int(m.group(1)) if m else -1


@contextmanager
def _os_errors(tag: str, what: str, path=None):
    """OSError -> CheckpointError naming the checkpoint, the action, the file (the OS's, else `path`; none
    when `what` names its paths) and the OS cause."""
    try:
        yield
    except OSError as e:
        where = "" if path is None else f" {e.filename or path}"
        cause = f"[Errno {e.errno}] {e.strerror}" if e.strerror else str(e)
        raise CheckpointError(f"checkpoint {tag}: cannot {what}{where}: {cause}") from e


@contextmanager
def _naming(path: Path):
    try:
        yield
    except OSError as e:
        e.filename = e.filename or str(path)   # write/flush/fsync errors do not say which file
        raise


def _write_durable(path: Path, data: bytes) -> None:
    with _naming(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)    # makes renames and new entries in `path` durable (POSIX)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Best effort: a folder that cannot be removed is logged, never fatal."""
    try:
        shutil.rmtree(path)
    except OSError as e:
        logger.warning("could not remove %s: %s", path, e)


def _step_tags(ckpt: Path) -> list[str]:
    """The step<N> folders, newest step first."""
    return step_tags([p.name for p in ckpt.iterdir() if p.is_dir()] if ckpt.is_dir() else [])


def step_tags(names) -> list[str]:
    """The step<N> names among `names`, newest step first (a local folder's or the storage_uri mirror's)."""
    return sorted((n for n in names if _STEP_TAG.fullmatch(n)), key=lambda t: -int(t[4:]))


def staging_dir(ckpt: Path, tag: str) -> Path:
    """An empty `<ckpt>/.tmp-<tag>` to write checkpoint `tag` into (a crashed save's leftover is removed first)."""
    if not _SAFE_TAG.fullmatch(tag):
        raise CheckpointError(f"checkpoint tag {tag!r} is not a plain folder name")
    stage = Path(ckpt) / f"{STAGING_PREFIX}{tag}"
    with _os_errors(tag, "create staging folder", stage):
        if stage.exists():
            logger.info("removing %s left by an interrupted save", stage)
            shutil.rmtree(stage)
        stage.mkdir(parents=True)
    return stage


def write_rl_state(tag_dir: Path, state: dict, tensors: dict) -> None:
    buf = io.BytesIO()
    torch.save(tensors, buf)           # serialised in memory so a full disk reports the OS error, not torch's
    with _os_errors(tag_dir.name.removeprefix(STAGING_PREFIX), "write", tag_dir):
        tag_dir.mkdir(parents=True, exist_ok=True)
        _write_durable(tag_dir / "rl_state.json", json.dumps(state, indent=2).encode())
        _write_durable(tag_dir / "rl_state.pt", buf.getvalue())


def read_rl_state(tag_dir: Path) -> tuple[dict, dict]:
    state = json.loads((tag_dir / "rl_state.json").read_text())
    tensors = torch.load(tag_dir / "rl_state.pt", weights_only=True) if (tag_dir / "rl_state.pt").exists() else {}
    return state, tensors


def _read_state(tag_dir: Path) -> dict | None:
    try:
        state = json.loads((tag_dir / "rl_state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _hash(path: Path, sync: bool) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    with _naming(path), open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
        if sync:
            os.fsync(f.fileno())       # the data reaches the disk before the rename publishes it
    return n, h.hexdigest()


def _hash_all(root: Path, rels: list[str], sync: bool = False) -> dict[str, tuple[int, str]]:
    """On a few threads (reads and hashlib release the GIL); an unreadable file raises OSError."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(rels)))) as pool:
        return dict(zip(rels, pool.map(lambda r: _hash(root / r, sync), rels)))


def _write_manifest(stage: Path, tag: str) -> None:
    t0, state = time.monotonic(), _read_state(stage)
    if state is None:
        raise CheckpointError(f"checkpoint {tag}: rl_state.json missing or unreadable in {stage}; not committed")
    with _os_errors(tag, "hash and sync", stage):
        rels = sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file() and p.name != MANIFEST)
        hashed = _hash_all(stage, rels, sync=True)
    manifest = {"tag": tag, "step": state.get("step"),
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "files": {r: {"bytes": n, "sha256": h} for r, (n, h) in hashed.items()}}
    with _os_errors(tag, "write", stage / MANIFEST):
        _write_durable(stage / MANIFEST, json.dumps(manifest, indent=1).encode())
        for d in {(stage / r).parent for r in rels} | {stage}:
            _fsync_dir(d)
    logger.info("checkpoint %s: manifest of %d files, %.3f GB, took %.1f s", tag, len(rels),
                sum(n for n, _ in hashed.values()) / 1e9, time.monotonic() - t0)


def commit(ckpt: Path, tag: str, keep: int) -> Path:
    """Publish `<ckpt>/.tmp-<tag>` as `<ckpt>/<tag>`: manifest, rename, `latest`, then keep the newest `keep`
    checkpoints (<= 0: all). Returns the folder. On a write failure: CheckpointError, the staging folder
    removed, `latest` and the earlier checkpoints as they were."""
    ckpt = Path(ckpt)
    stage, final, old = ckpt / f"{STAGING_PREFIX}{tag}", ckpt / tag, None
    if not _SAFE_TAG.fullmatch(tag) or not stage.is_dir():
        raise CheckpointError(f"checkpoint {tag}: no staging folder {stage} (call staging_dir first)")
    try:
        _write_manifest(stage, tag)
        if final.exists():             # a step redone after a restart: the new one replaces it
            old = ckpt / f"{OLD_PREFIX}{tag}"
            if old.exists():
                _remove(old)
            with _os_errors(tag, f"move aside {final} to {old}"):
                os.rename(final, old)
        with _os_errors(tag, f"rename {stage} to {final}"):
            os.rename(stage, final)
            _fsync_dir(ckpt)
    except CheckpointError:
        if old is not None and old.exists() and not final.exists():
            try:
                os.rename(old, final)  # put the previous one back
            except OSError as e:
                logger.warning("checkpoint %s: could not move %s back: %s", tag, old, e)
        if stage.exists():
            _remove(stage)
        raise
    mark_latest(ckpt, tag)
    try:
        _prune(ckpt, tag, keep)
    except OSError as e:               # committed already; an unpruned folder only costs disk
        logger.warning("checkpoint %s: pruning %s failed: %s", tag, ckpt, e)
    logger.info("checkpoint %s committed", final)
    return final


def _prune(ckpt: Path, current: str, keep: int) -> None:
    """Remove leftover .tmp-*/.old-* folders; when keep > 0 also every step<N> folder but `current` and the
    newest keep-1 complete ones before it (a later step's folder is from an abandoned attempt)."""
    for p in ckpt.iterdir():
        if p.is_dir() and p.name.startswith((STAGING_PREFIX, OLD_PREFIX)):
            logger.info("removing leftover %s", p)
            _remove(p)
    tags = _step_tags(ckpt)
    kept = kept_tags(tags, current, keep,
                     lambda t: (ckpt / t / MANIFEST).exists() or (ckpt / t / "rl_state.json").exists())
    for t in tags:
        if t != current and t not in kept:
            logger.info("pruning checkpoint %s (keep=%d)", ckpt / t, keep)
            _remove(ckpt / t)


def kept_tags(tags: list[str], current: str, keep: int, complete=lambda tag: True) -> list[str]:
    """The step<N> tags to keep beside `current` (keep <= 0: every one): the newest keep-1 complete ones before it (a
    later step's folder is from an abandoned attempt). `tags` newest first, as _step_tags lists them. One rule for the
    local folder (_prune) and the storage_uri mirror (driver/checkpoints.py)."""
    others = [t for t in tags if t != current]
    if keep <= 0:
        return others
    cur = int(m[1]) if (m := _STEP_TAG.fullmatch(current)) else None
    return [t for t in others if (cur is None or int(t[4:]) < cur) and complete(t)][:keep - 1]


def mark_latest(ckpt: Path, tag: str) -> None:
    tmp = Path(ckpt) / "latest.tmp"
    with _os_errors(tag, "write", tmp):
        _write_durable(tmp, (tag + "\n").encode())
        os.replace(tmp, Path(ckpt) / "latest")     # atomic: a crash leaves the previous tag in place
        _fsync_dir(Path(ckpt))


def verify(tag_dir: Path) -> str | None:
    """None if every file manifest.json lists has its size and sha256 and rl_state.json reads; else why not."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        return "folder missing"
    try:
        files = json.loads((tag_dir / MANIFEST).read_text())["files"]
        sizes = {rel: meta["bytes"] for rel, meta in files.items()}
    except FileNotFoundError:
        return f"{MANIFEST} missing"
    except (OSError, ValueError, LookupError, TypeError, AttributeError):
        return f"{MANIFEST} unreadable"
    for rel, size in sizes.items():
        if not (tag_dir / rel).is_file():
            return f"file {rel} missing"
        if (actual := (tag_dir / rel).stat().st_size) != size:
            return f"file {rel}: {actual} bytes, manifest says {size}"
    try:
        hashed = _hash_all(tag_dir, list(files))
    except OSError as e:
        return f"cannot read: {e}"
    bad = [rel for rel, (_, digest) in hashed.items() if digest != files[rel].get("sha256")]
    if bad:
        return f"file {bad[0]}: sha256 mismatch"
    return None if _read_state(tag_dir) is not None else "rl_state.json unreadable"


def find_good(ckpt: Path) -> tuple[str | None, list[str]]:
    """The tag to resume from (the one in `latest`, else the newest step<N> that verifies; None if none) and a
    message per rejected candidate (and per unverified legacy one taken), each also logged as a WARNING."""
    ckpt, named, notes, rejected, good = Path(ckpt), None, [], [], None
    try:
        named = (ckpt / "latest").read_text().strip() or None
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as e:
        notes.append(f"{ckpt / 'latest'} is unreadable ({e}); trying every checkpoint folder")
    for tag in ([named] if named else []) + [t for t in _step_tags(ckpt) if t != named]:
        reason = verify(ckpt / tag) if _SAFE_TAG.fullmatch(tag) else "not a checkpoint folder name"
        if reason == f"{MANIFEST} missing":
            if _read_state(ckpt / tag) is None:
                reason += " and rl_state.json unreadable"
            else:                      # written by older code: usable, not verifiable
                notes.append(f"checkpoint {tag} has no {MANIFEST} (written by an older version): its files "
                             "could not be verified; using it since rl_state.json is readable")
                reason = None
        if reason is None:
            good = tag
            break
        rejected.append((tag, reason))
    then = f"using {good}" if good else "no usable checkpoint left"
    messages = [f"checkpoint {t} is unusable ({r}); {then}" for t, r in rejected] + notes
    for msg in messages:
        logger.warning("%s", msg)
    return good, messages


def latest_tag(ckpt: Path) -> str | None:
    """Kept for callers of the old API: the tag `find_good` picks (its messages are logged)."""
    return find_good(ckpt)[0]


class CheckpointPolicy:
    """When to checkpoint: at every `every_steps`-th step and/or when `every_minutes` passed since the last
    `mark_done()` (or construction); <= 0 turns either off. Pure: the clock is injected."""

    def __init__(self, every_steps: int, every_minutes: float, clock: Callable[[], float] = time.monotonic):
        self.every_steps, self.every_minutes, self.clock = int(every_steps), float(every_minutes), clock
        self.last = clock()

    def due(self, step: int) -> bool:
        return ((self.every_steps > 0 and step % self.every_steps == 0)
                or (self.every_minutes > 0 and self.clock() - self.last >= self.every_minutes * 60.0))

    def mark_done(self) -> None:
        self.last = self.clock()


def truncate_metrics(path: Path, last_step: int) -> list[dict]:
    """Keep the records of steps <= last_step (the checkpoint's) and return them; later ones are redone."""
    if not path.exists():
        return []
    keep_lines, records = [], []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue   # a line cut by the crash
        if rec.get("step", 0) <= last_step:
            keep_lines.append(line)
            records.append(rec)
    path.write_text("".join(l + "\n" for l in keep_lines))
    dropped = "" if not records else f" (kept steps 1..{last_step})"
    logger.info("resuming: metrics.jsonl truncated to the checkpoint%s", dropped)
    return records
