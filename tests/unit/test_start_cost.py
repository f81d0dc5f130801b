"""What an actor's process imports at its start (#28 item 6: CI time is mostly seven fresh processes per run
importing torch, transformers and DeepSpeed on 2 cores).

- Every DeepSpeed role takes DeepSpeed through `import_deepspeed` (rlhf_orch/distributed.py), which leaves out
  mlflow (DeepSpeed's autotuner imports it whenever installed: ~2 s per rank). A plain `import deepspeed`
  anywhere before it undoes that: the trainer's own constructor did so until this test.
- `setup_process` (every actor's first call) imports neither transformers nor torch, and an actor that imports
  them later still gets one thread and quiet transformers logging.
Each case runs in a fresh process: what matters is what that process imported.
"""
import ast
import multiprocessing
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_deepspeed_is_imported_only_through_import_deepspeed():
    offenders = []
    for path in (ROOT / "rlhf_orch").rglob("*.py"):
        if path.name == "distributed.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name == "deepspeed" for a in node.names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], f"use rlhf_orch.distributed.import_deepspeed() instead of `import deepspeed`: {offenders}"


def _trainer_start(model_dir: str, queue) -> None:
    import torch
    from rlhf_orch.trainer.deepspeed_trainer import DeepSpeedTrainer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0")
    DeepSpeedTrainer(model_dir, 0, 1, device="cpu", zero_stage=2, lr=1e-2)
    try:
        queue.put({"mlflow": "mlflow" in sys.modules, "deepspeed": "deepspeed" in sys.modules})
    finally:
        torch.distributed.destroy_process_group()


def test_a_trainer_rank_starts_without_mlflow(tiny_model_dir):
    pytest.importorskip("mlflow", reason="the point is DeepSpeed's import of an installed mlflow")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_trainer_start, args=(tiny_model_dir, queue))
    proc.start()
    got = queue.get(timeout=600)
    proc.join(60)
    assert proc.exitcode == 0
    assert got["deepspeed"] and not got["mlflow"], got


SETUP = """
import os, sys
sys.path.insert(0, {root!r})
for key in ("OMP_NUM_THREADS", "TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS"):
    os.environ.pop(key, None)
from actors.common import setup_process
setup_process("cpu")
before = ("torch" in sys.modules, "transformers" in sys.modules)
import torch
from transformers.utils import logging as hf_logging
print(before, torch.get_num_threads(), hf_logging.get_verbosity() == hf_logging.ERROR, hf_logging.is_progress_bar_enabled())
"""


def test_setup_process_imports_neither_torch_nor_transformers_and_still_sets_them():
    out = subprocess.run([sys.executable, "-c", SETUP.format(root=str(ROOT))], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == "(False, False) 1 True False", out.stdout
