"""SIGTERM (what `ray job stop` and a preempting scheduler send) stops a run cleanly: the driver saves the last
completed step's checkpoint (complete: it verifies against its manifest), writes summary.json with status
"stopped", the plots and the timeline, and exits non-zero; `resume=true` then continues from that step. A second
SIGTERM during that clean-up (as seen under `ray job stop` on a loaded machine) must not cut it short."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from rlhf_orch.checkpoint import checkpoint_dir, find_good  # noqa: E402

pytestmark = pytest.mark.integration
ARGS = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "trainer.warm_start_steps=0",
        "experiment.name=stop", "experiment.steps=500", "experiment.log_samples_every=0",
        "engines.0.decode_delay_s=0.01", "engines.1.decode_delay_s=0.01"]


def test_sigterm_saves_checkpoint_summary_and_plots(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--config", str(ROOT / "configs/tiny_cpu.yaml"),
                             f"experiment.output_dir={tmp_path}", *ARGS], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "driver.log", "w"))
    run = tmp_path / "stop"
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
        assert proc.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        time.sleep(0.2)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)                       # inside the clean-up: the final checkpoint and plots take seconds
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    stop_s = time.time() - t0
    log = (tmp_path / "driver.log").read_text()
    assert rc == 1, log[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "stopped" and "SIGTERM" in summary["error"]
    steps = [json.loads(l)["step"] for l in metrics.read_text().splitlines()]
    tag, notes = find_good(checkpoint_dir(run))
    assert tag == f"step{steps[-1]}" and not notes            # the last completed step, complete and verified
    assert (run / "plots" / "timeline.png").exists() and (run / "plots" / "reward.png").exists()
    assert "again: still saving the stopped run" in log, log[-3000:]
    assert stop_s < 60, stop_s
