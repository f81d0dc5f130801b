"""W&B (offline) and MLflow (local file store) sinks for real: a few steps written, then read back through each
tool's own reader (`wandb leet inspect --json` on the offline run folder; MlflowClient on the file store), resume onto
the same run, and the config checks that run before launch (renamed keys, missing packages, W&B online without a key).
"""
import json
import subprocess
import sys

import pytest
import yaml

from rlhf_orch.config.loader import load_config
from rlhf_orch.errors import ConfigError
from rlhf_orch.metrics import trackers
from rlhf_orch.metrics.trackers import flatten, mlflow_name, read_ids

STEPS = [{"rollout/reward_mean": 0.1 * s, "perf/step_s": 1.0 + s, "eval/pass@1": s / 4, "note": "text"}
         for s in range(1, 4)]
CONFIG = {"experiment": {"name": "exp", "steps": 3}, "engines": [{"kind": "hf", "count": 1}], "trainer": {"lr": 0.001}}


def _cfg(tmp_path, *overrides):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"engines": [{"kind": "hf"}], "experiment": {"output_dir": str(tmp_path / "runs")}}))
    return load_config(str(path), list(overrides))


def _error(tmp_path, *overrides) -> str:
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, *overrides)
    return str(e.value)


# ---- config -------------------------------------------------------------------------------------------------
def test_default_trackers_are_jsonl_and_tensorboard(tmp_path):
    m = _cfg(tmp_path).metrics
    assert m.trackers == ["jsonl", "tensorboard"] and m.wandb_mode == "offline" and m.mlflow_tracking_uri is None


@pytest.mark.parametrize("overrides, listed", [
    (["metrics.tensorboard=false"], "[jsonl]"),
    (["metrics.jsonl=false", "metrics.tensorboard=true"], "[tensorboard]"),
    (["metrics.jsonl=true"], "[jsonl, tensorboard]"),
])
def test_removed_booleans_name_their_replacement(tmp_path, overrides, listed):
    msg = _error(tmp_path, *overrides)
    assert "replaced by the list metrics.trackers" in msg and f"trackers: {listed}" in msg
    # the override it suggests is accepted as it is written
    suggested = msg.split("(override: ")[1].split(")")[0]
    assert _cfg(tmp_path, suggested).metrics.trackers == yaml.safe_load(listed)


def test_unknown_and_repeated_trackers(tmp_path):
    assert "metrics.trackers.1: Input should be 'jsonl', 'tensorboard', 'wandb' or 'mlflow'" in \
        _error(tmp_path, "metrics.trackers=[jsonl,comet]")
    assert "metrics.trackers: jsonl is listed twice" in _error(tmp_path, "metrics.trackers=[jsonl,jsonl]")


def test_missing_tracker_package_names_the_pip_command(tmp_path, monkeypatch):
    # The real find_spec on a module that is not installed, as if wandb were absent.
    monkeypatch.setitem(trackers.OPTIONAL_TRACKERS, "wandb", "wandb_absent_for_this_test")
    msg = _error(tmp_path, "metrics.trackers=[jsonl,wandb]")
    assert 'metrics.trackers: wandb is not installed; pip install -e ".[wandb]"' in msg


def test_wandb_online_needs_a_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))          # no ~/.netrc from `wandb login`
    monkeypatch.delenv("NETRC", raising=False)
    pytest.importorskip("wandb")
    assert "metrics.wandb_mode: online needs a W&B API key: export WANDB_API_KEY" in \
        _error(tmp_path, "metrics.trackers=[wandb]", "metrics.wandb_mode=online")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert _cfg(tmp_path, "metrics.trackers=[wandb]", "metrics.wandb_mode=online").metrics.wandb_mode == "online"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    (tmp_path / ".netrc").unlink()
    assert _cfg(tmp_path, "metrics.trackers=[wandb]", "metrics.wandb_mode=online").metrics.wandb_mode == "online"
    # online without wandb listed is not checked (nothing would use it)
    monkeypatch.delenv("WANDB_API_KEY")
    assert _cfg(tmp_path, "metrics.wandb_mode=online").metrics.trackers == ["jsonl", "tensorboard"]


def test_flatten_and_mlflow_names():
    assert flatten(CONFIG) == {"experiment.name": "exp", "experiment.steps": 3, "engines.0.kind": "hf",
                               "engines.0.count": 1, "trainer.lr": 0.001}
    assert flatten({"a": [], "b": {}, "c": None}) == {"a": [], "b": {}, "c": None}
    assert mlflow_name("eval/pass@1") == "eval/pass_1" and mlflow_name("rollout/reward_mean") == "rollout/reward_mean"


# ---- W&B, offline ---------------------------------------------------------------------------------------------
def _wandb_records(run_folder) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_folder)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _wandb_history(run_folder) -> dict[int, dict]:
    return {r["history"]["step"]["num"]: r["history"]["item"] for r in _wandb_records(run_folder)
            if r["type"] == "history"}


def test_wandb_offline_run_holds_steps_and_config(tmp_path):
    pytest.importorskip("wandb")
    from rlhf_orch.metrics.trackers import WandbSink

    sink = WandbSink(tmp_path, "exp", CONFIG, mode="offline")
    for step, m in enumerate(STEPS, start=1):
        sink.write(step, m)
    sink.close()
    ids = read_ids(tmp_path)["wandb"]
    assert ids == {"id": sink.run_id, "project": "exp", "mode": "offline"}
    folders = list((tmp_path / "wandb").glob(f"offline-run-*-{sink.run_id}*"))
    assert len(folders) == 1
    history = _wandb_history(folders[0])
    assert sorted(history) == [1, 2, 3]
    for step, m in enumerate(STEPS, start=1):
        assert {k: history[step][k] for k in m if k != "note"} == pytest.approx({k: v for k, v in m.items() if k != "note"})
        assert "note" not in history[step]      # non-numeric values are not logged
    run = next(r["run"] for r in _wandb_records(folders[0]) if r["type"] == "run")
    assert run["display_name"] == "exp" and run["project"] == "exp"
    assert run["config"]["update"]["trainer"] == {"lr": 0.001}


def test_wandb_resume_continues_the_same_run(tmp_path):
    pytest.importorskip("wandb")
    from rlhf_orch.metrics.trackers import WandbSink

    first = WandbSink(tmp_path, "exp", CONFIG)
    first.write(1, STEPS[0])
    first.close()
    again = WandbSink(tmp_path, "exp", CONFIG, resume=True)
    again.write(2, STEPS[1])
    again.close()
    assert again.run_id == first.run_id and again.resumed
    folders = sorted((tmp_path / "wandb").glob(f"offline-run-*-{first.run_id}*"))
    assert len(folders) == 2            # offline, the resumed segment is a second folder of the same run id
    assert [sorted(_wandb_history(f)) for f in folders] == [[1], [2]]
    fresh = WandbSink(tmp_path, "exp", CONFIG)   # no resume: a new run, and trackers.json names it
    fresh.close()
    assert fresh.run_id != first.run_id and read_ids(tmp_path)["wandb"]["id"] == fresh.run_id


# ---- MLflow, local file store ---------------------------------------------------------------------------------
def _mlflow(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from rlhf_orch.metrics.trackers import MlflowSink, default_tracking_uri
    uri = default_tracking_uri(tmp_path)
    assert uri.startswith("file:///") and uri.endswith("/mlruns")
    return MlflowSink, lambda: MlflowClient(tracking_uri=uri)


def test_mlflow_file_store_holds_steps_params_and_config(tmp_path):
    MlflowSink, client = _mlflow(tmp_path)
    sink = MlflowSink(tmp_path, "exp", CONFIG)
    for step, m in enumerate(STEPS, start=1):
        sink.write(step, m)
    sink.close()
    c = client()
    run = c.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "exp"
    assert c.get_experiment(run.info.experiment_id).name == "exp"
    assert run.data.params == {k: str(v) for k, v in flatten(CONFIG).items()}
    for key in ("rollout/reward_mean", "perf/step_s", "eval/pass@1"):
        history = c.get_metric_history(sink.run_id, mlflow_name(key))
        # steps exactly, values to float precision (pytest 9's approx takes no tuples inside a list)
        assert [h.step for h in history] == list(range(1, len(STEPS) + 1))
        assert [h.value for h in history] == pytest.approx([m[key] for m in STEPS])
    assert "note" not in run.data.metrics
    artifacts = [a.path for a in c.list_artifacts(sink.run_id)]
    assert artifacts == ["config.json"]
    assert read_ids(tmp_path)["mlflow"]["run_id"] == sink.run_id


def test_mlflow_resume_continues_the_same_run(tmp_path):
    MlflowSink, client = _mlflow(tmp_path)
    first = MlflowSink(tmp_path, "exp", CONFIG)
    first.write(1, STEPS[0])
    first.write(2, STEPS[1])
    first.close()
    longer = {**CONFIG, "experiment": {"name": "exp", "steps": 6}}   # resume=true experiment.steps=6
    again = MlflowSink(tmp_path, "exp", longer, resume=True)
    assert again.run_id == first.run_id and again.resumed
    assert client().get_run(again.run_id).info.status == "RUNNING"
    again.write(2, STEPS[1])         # a step after the checkpoint, trained again
    again.write(3, STEPS[2])
    again.close()
    c = client()
    run = c.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["experiment.steps"] == "3" and run.data.tags["resume.experiment.steps"] == "6"
    steps = [h.step for h in c.get_metric_history(first.run_id, "rollout/reward_mean")]
    assert sorted(steps) == [1, 2, 2, 3]
    assert len(c.search_runs([run.info.experiment_id])) == 1


def test_make_trackers_builds_the_listed_ones_in_order(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from rlhf_orch.metrics.trackers import MlflowSink, WandbSink, make_trackers
    cfg = _cfg(tmp_path, "metrics.trackers=[mlflow,jsonl,wandb]", "experiment.name=mt")
    sinks = make_trackers(cfg, tmp_path / "run", resumed=False)
    try:
        assert [type(s) for s in sinks] == [MlflowSink, WandbSink]
    finally:
        for s in sinks:
            s.close()
    params = __import__("mlflow").tracking.MlflowClient(sinks[0].tracking_uri).get_run(sinks[0].run_id).data.params
    assert [params[f"metrics.trackers.{i}"] for i in range(3)] == ["mlflow", "jsonl", "wandb"]
    assert params["experiment.name"] == "mt" and params["engines.0.kind"] == "hf"
    assert set(read_ids(tmp_path / "run")) == {"wandb", "mlflow"}
