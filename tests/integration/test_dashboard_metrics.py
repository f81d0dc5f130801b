"""A short real CPU run (configs/tiny_cpu.yaml) on a Ray this test starts with a known metrics export port: every
metric name the Grafana dashboard's PromQL uses (read out of dashboards/rlhf_orch.json) must be on Ray's Prometheus
endpoint, tagged with the run's experiment. The same run also writes W&B (offline) and MLflow (file store) when they
are installed, and their steps must equal metrics.jsonl's."""
import json
import math
import os
import socket
import sys
import time
import urllib.request
from importlib.util import find_spec
from pathlib import Path

import pytest

from dashboard_promql import not_exported

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402
from rlhf_orch.config.schema import ExperimentConfig  # noqa: E402

pytestmark = pytest.mark.integration

NAME, STEPS = "dash", 3
DASHBOARD = json.loads((ROOT / "dashboards" / "rlhf_orch.json").read_text())
TRACKERS = ["jsonl"] + [t for t in ("wandb", "mlflow") if find_spec(t) is not None]
# eval/ metrics need an evaluation in the run (rlhf_orch/evaluation.py); without that section they cannot appear.
EVAL = ["eval.every=2", "eval.max_prompts=8"] if "eval" in ExperimentConfig.model_fields else []


def cpu_cannot_export(name: str) -> bool:
    """mem/ gauges are read from CUDA devices only (driver/colocation.py, actors/trainer.py): none on CPU; their
    names are checked against the naming rule in tests/unit/test_dashboard.py."""
    return name.startswith("ray_rlhf_orch_mem_") or (not EVAL and name.startswith("ray_rlhf_orch_eval_"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    """{sample name: value} of this run's samples (experiment=NAME) on Ray's metrics endpoint ({} until it serves)."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.labels.get("experiment") == NAME}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run folder, {exported sample: value}) after the run, scraped until the dashboard's names are there or 90 s."""
    import ray
    out, port = tmp_path_factory.mktemp("dash"), _free_port()
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), saved]))   # as actors/ray_session.init_ray does
    ray.init(address="local", num_cpus=2, include_dashboard=False, _metrics_export_port=port)
    try:
        rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.steps={STEPS}",
                          f"experiment.name={NAME}", f"experiment.output_dir={out}", "trainer.warm_start_steps=0",
                          "ray.num_cpus=2", "metrics.plots=false", f"metrics.trackers=[{','.join(TRACKERS)}]", *EVAL])
        assert rc == 0
        deadline, exported = time.monotonic() + 90, {}   # Ray exports custom metrics every few seconds
        while time.monotonic() < deadline:
            exported = _scrape(port)
            if exported.get("ray_rlhf_orch_step") == STEPS and not not_exported(DASHBOARD, set(exported),
                                                                                 cpu_cannot_export):
                break
            time.sleep(2)
        yield out / NAME, exported
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def test_every_dashboard_metric_is_exported(run):
    run_dir, exported = run
    assert exported, "nothing tagged experiment=dash on Ray's metrics endpoint"
    missing = not_exported(DASHBOARD, set(exported), cpu_cannot_export)
    assert not missing, f"dashboards/rlhf_orch.json uses metrics the run did not export: {missing}"
    assert exported["ray_rlhf_orch_step"] == STEPS
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert exported["ray_rlhf_orch_rollout_reward_mean"] == pytest.approx(last["rollout/reward_mean"])


def _jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_mlflow_run_matches_metrics_jsonl(run):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    run_dir, _ = run
    ids = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert ids["tracking_uri"] == (run_dir / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=ids["tracking_uri"])
    info = client.get_run(ids["run_id"])
    assert info.info.status == "FINISHED" and info.data.params["experiment.name"] == NAME
    records = _jsonl(run_dir)
    for key in ("rollout/reward_mean", "train/loss", "sync/gbps", "perf/step_s"):
        history = sorted((h.step, h.value) for h in client.get_metric_history(ids["run_id"], key))
        # steps exactly, values to float precision (pytest 9's approx takes no tuples inside a list)
        assert [s for s, _ in history] == [r["step"] for r in records], key
        assert [v for _, v in history] == pytest.approx([r[key] for r in records]), key


def test_wandb_offline_run_matches_metrics_jsonl(run):
    pytest.importorskip("wandb")
    import subprocess
    run_dir, _ = run
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    (folder,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(folder)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in map(json.loads, out.splitlines())
               if r["type"] == "history"}
    records = _jsonl(run_dir)
    assert sorted(history) == [r["step"] for r in records]
    for r in records:
        numbers = {k: v for k, v in r.items() if k not in ("step", "time") and isinstance(v, (int, float))
                   and math.isfinite(v)}
        assert {k: history[r["step"]][k] for k in numbers} == pytest.approx(numbers)
