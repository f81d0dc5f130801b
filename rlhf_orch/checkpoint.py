"""What a checkpoint holds besides DeepSpeed's own files, and how a resumed run finds it.

Layout under <run>/checkpoints/:
  latest                 the tag of the newest complete checkpoint (written last, atomically)
  reference.pt           the frozen KL reference (the policy when RL started), written once
  <tag>/                 DeepSpeed's model + optimizer files for every rank
  <tag>/rl_state.json    step, weight version, data cursor (human readable)
  <tag>/rl_state.pt      engines' sampling RNG states (tensors)
  <tag>/hf/              the policy as a Hugging Face folder (safetensors), when export is on

A checkpoint counts only once `latest` names it, so a run killed while saving resumes from the previous
one. This module does file I/O only; the actors decide what goes in.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def write_rl_state(tag_dir: Path, state: dict, tensors: dict) -> None:
    tag_dir.mkdir(parents=True, exist_ok=True)
    (tag_dir / "rl_state.json").write_text(json.dumps(state, indent=2))
    torch.save(tensors, tag_dir / "rl_state.pt")


def read_rl_state(tag_dir: Path) -> tuple[dict, dict]:
    state = json.loads((tag_dir / "rl_state.json").read_text())
    tensors = torch.load(tag_dir / "rl_state.pt", weights_only=True) if (tag_dir / "rl_state.pt").exists() else {}
    return state, tensors


def mark_latest(ckpt: Path, tag: str) -> None:
    tmp = ckpt / "latest.tmp"
    tmp.write_text(tag + "\n")
    os.replace(tmp, ckpt / "latest")     # atomic: a crash leaves the previous tag in place


def latest_tag(ckpt: Path) -> str | None:
    f = ckpt / "latest"
    if not f.exists():
        return None
    tag = f.read_text().strip()
    return tag if (ckpt / tag / "rl_state.json").exists() else None


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
