"""Experiment trackers for the driver's per-step metrics: Weights & Biases (`WandbSink`) and MLflow (`MlflowSink`).

Both are `MetricSink`s the driver fans out to next to metrics.jsonl and TensorBoard (`metrics.trackers` names them).
The run's config is logged once (W&B config, MLflow params plus a config.json artifact), every numeric metric of a
step is logged at that step, and the tracker's run id is kept in `<run>/trackers.json` so that a resumed run
(`resume=true`, or a restart after an actor death) continues the same W&B run / MLflow run. `make_trackers` builds
the configured ones; `tracker_problems` and `wandb_online_problem` are the config checks that run before launch.

What it does not do: import wandb or mlflow at module import (each sink imports its package when constructed), start a
tracking server, upload anything in W&B's default offline mode, capture the console, log checkpoints as artifacts, or
mark a failed run as failed (close() cannot tell how the run ended; both runs end as finished).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlhf_orch.metrics.sinks import MetricSink, _as_number

logger = logging.getLogger(__name__)

IDS_FILE = "trackers.json"
# tracker name -> the module it imports; each has an extra of the same name in pyproject.toml.
OPTIONAL_TRACKERS = {"wandb": "wandb", "mlflow": "mlflow"}
RENAMED_KEYS = ("jsonl", "tensorboard")   # the booleans metrics.trackers replaced


def install_hint(tracker: str) -> str:
    return (f'pip install -e ".[{tracker}]" from the rlhf_orch checkout (or pip install {OPTIONAL_TRACKERS[tracker]}), '
            f"or remove {tracker} from metrics.trackers")


def tracker_problems(trackers: Iterable[str]) -> list[str]:
    """What keeps `trackers` from working here: a name listed twice, a package not installed (with the pip command)."""
    problems, seen = [], set()
    for name in trackers:
        if name in seen:
            problems.append(f"{name} is listed twice; list each tracker once")
        seen.add(name)
        module = OPTIONAL_TRACKERS.get(name)
        if module and importlib.util.find_spec(module) is None:
            problems.append(f"{name} is not installed; {install_hint(name)}")
    return problems


def wandb_online_problem() -> str | None:
    """W&B online mode without an API key would fail at wandb.init, after Ray started: say so before launch."""
    if os.environ.get("WANDB_API_KEY"):
        return None
    import netrc
    from urllib.parse import urlparse
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        if netrc.netrc().authenticators(host):   # what `wandb login` writes
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return ("online needs a W&B API key: export WANDB_API_KEY=... (or run `wandb login`), or keep wandb_mode: "
            "offline and upload later with `wandb sync <run>/wandb/offline-run-*`")


def renamed_keys_message(section: dict) -> str | None:
    """The error for a metrics section that still uses the removed jsonl/tensorboard booleans, naming the list to
    write instead (None when it uses neither)."""
    old = [k for k in RENAMED_KEYS if k in section]
    if not old:
        return None
    trackers = [k for k in RENAMED_KEYS if section.get(k, True) is not False]
    listed = "[" + ", ".join(trackers) + "]"
    return (f"{' and '.join(old)} {'were' if len(old) > 1 else 'was'} replaced by the list "
            f"metrics.trackers (jsonl, tensorboard, wandb, mlflow; default [jsonl, tensorboard]): write "
            f"`trackers: {listed}` under metrics: (override: metrics.trackers={listed.replace(' ', '')}) "
            f"and remove {', '.join(old)}")


# ---- run ids kept in the run folder --------------------------------------------------------------------------
def read_ids(run_dir: Path) -> dict:
    try:
        ids = json.loads((Path(run_dir) / IDS_FILE).read_text())
        return ids if isinstance(ids, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def _save_id(run_dir: Path, tracker: str, entry: dict) -> None:
    path = Path(run_dir) / IDS_FILE
    ids = read_ids(run_dir)
    ids[tracker] = entry
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(ids, indent=2))
    os.replace(tmp, path)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "l": [{"c": 2}]} -> {"a.b": 1, "l.0.c": 2}; leaves (None, numbers, strings) kept as they are."""
    if isinstance(tree, dict):
        items = ((str(k), v) for k, v in tree.items())
    elif isinstance(tree, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in items:
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, (dict, list, tuple)) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def _numbers(metrics: dict) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        number = _as_number(value)
        if number is not None:
            out[key] = number
    return out


# ---- Weights & Biases ------------------------------------------------------------------------------------------
class WandbSink(MetricSink):
    """Logs each step's numeric metrics to a W&B run named after the experiment, files under `<run_dir>/wandb/`.

    `mode` "offline" (the default of metrics.wandb_mode) writes only local files, uploaded later with `wandb sync`;
    "online" streams to the W&B server (needs an API key). With `resume` and a run id in trackers.json, the same W&B
    run continues. W&B keeps a run's steps increasing, so steps a resumed run repeats (those after the checkpoint it
    resumed from) keep their first values online; offline, a resumed run is a second folder with the same run id.
    """

    def __init__(self, run_dir: str | os.PathLike, experiment: str, config: dict, mode: str = "offline",
                 project: str | None = None, resume: bool = False) -> None:
        import wandb

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run_id = read_ids(self.run_dir).get("wandb", {}).get("id") if resume else None
        if resume and run_id is None:
            logger.warning("resume: no W&B run id in %s; a new W&B run starts", self.run_dir / IDS_FILE)
        self._run = wandb.init(project=project or experiment, name=experiment, id=run_id,
                               resume="allow" if run_id else None, dir=str(self.run_dir), mode=mode, config=config,
                               settings=wandb.Settings(console="off", reinit="create_new"))
        # Online, a resumed run's next step is known; steps below it would be dropped by W&B with one warning each.
        self.resumed = run_id is not None
        self._first_step = int(self._run.step) if run_id and getattr(self._run, "resumed", False) else 0
        self._skipped = 0
        _save_id(self.run_dir, "wandb", {"id": self._run.id, "project": self._run.project, "mode": mode})
        logger.info("W&B run %s (%s, %s)%s", self._run.id, self._run.project, mode, " resumed" if run_id else "")
        self._closed = False

    @property
    def run_id(self) -> str:
        return self._run.id

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._closed:
            raise RuntimeError("WandbSink is closed")
        if step < self._first_step:
            self._skipped += 1
            if self._skipped == 1:
                logger.info("W&B run %s already has step %d; steps before it keep their first values",
                            self._run.id, self._first_step - 1)
            return
        self._run.log(_numbers(metrics), step=int(step))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._run.finish()


# ---- MLflow ----------------------------------------------------------------------------------------------------
_MLFLOW_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_\-. :/]")   # MLflow's rule for metric, param and tag names
_MLFLOW_MAX_PARAMS, _MLFLOW_MAX_METRICS = 100, 1000       # per log_batch call (a tracking server's limits)
_MLFLOW_MAX_PARAM_VALUE = 6000


def mlflow_name(key: str) -> str:
    """MLflow-safe metric/param name: 'eval/pass@1' -> 'eval/pass_1' ('/' is allowed and kept)."""
    return _MLFLOW_BAD_CHARS.sub("_", key)[:250]


def default_tracking_uri(run_dir: str | os.PathLike) -> str:
    """A local file store under the run folder: file:///abs/run/mlruns (`mlflow ui --backend-store-uri` it)."""
    return (Path(run_dir) / "mlruns").resolve().as_uri()


class MlflowSink(MetricSink):
    """Logs each step's numeric metrics to an MLflow run in the experiment named after experiment.name.

    `tracking_uri` defaults to a local file store under the run folder. MLflow 3 keeps its file store in maintenance
    mode and refuses it unless MLFLOW_ALLOW_FILE_STORE is true; for a `file:` URI this sink sets it in this process
    (unless it is set already). Params are the flattened config (`trainer.lr`, `engines.0.kind`, ...), also logged
    whole as the artifact config.json. With `resume` and a run id in trackers.json for the same tracking URI, the
    same MLflow run continues: steps it repeats get a second value at the same step, and config values changed for the
    resume (MLflow params cannot change) are logged as tags `resume.<param>`.
    """

    def __init__(self, run_dir: str | os.PathLike, experiment: str, config: dict, tracking_uri: str | None = None,
                 resume: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = tracking_uri or default_tracking_uri(self.run_dir)
        if self.tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=self.tracking_uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is not None and exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        experiment_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
        params = {mlflow_name(k): ("" if v is None else str(v))[:_MLFLOW_MAX_PARAM_VALUE]
                  for k, v in flatten(config).items()}
        self.run_id = self._resumable(experiment_id) if resume else None
        self.resumed = self.run_id is not None
        if self.run_id is None:
            run = client.create_run(experiment_id, run_name=experiment, tags={"rlhf_orch.run_dir": str(self.run_dir)})
            self.run_id = run.info.run_id
            self._log_params(params)
            try:   # the config as one readable file too; an artifact store a server cannot reach must not stop the run
                client.log_dict(self.run_id, config, "config.json")
            except Exception as e:
                logger.warning("MLflow: config.json artifact not logged: %s", str(e).splitlines()[0])
        else:
            client.update_run(self.run_id, status="RUNNING")
            old = client.get_run(self.run_id).data.params
            self._log_params({k: v for k, v in params.items() if k not in old})
            changed = {f"resume.{k}": v for k, v in params.items() if k in old and old[k] != v}
            for key, value in changed.items():
                client.set_tag(self.run_id, mlflow_name(key), value)
        _save_id(self.run_dir, "mlflow", {"run_id": self.run_id, "experiment_id": experiment_id,
                                           "tracking_uri": self.tracking_uri})
        logger.info("MLflow run %s in experiment %r at %s%s", self.run_id, experiment, self.tracking_uri,
                    " (resumed)" if self.resumed else "")
        self._closed = False

    def _resumable(self, experiment_id: str) -> str | None:
        entry = read_ids(self.run_dir).get("mlflow", {})
        run_id = entry.get("run_id")
        if run_id and entry.get("tracking_uri") == self.tracking_uri:
            try:
                run = self._client.get_run(run_id)
                if run.info.experiment_id == experiment_id and run.info.lifecycle_stage == "active":
                    return run_id
            except Exception as e:   # deleted or unreadable: a new run, said in the log
                logger.warning("MLflow run %s cannot be continued (%s)", run_id, str(e).splitlines()[0])
        logger.warning("resume: no MLflow run to continue for %s at %s; a new MLflow run starts",
                       self.run_dir, self.tracking_uri)
        return None

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), _MLFLOW_MAX_PARAMS):
            self._client.log_batch(self.run_id, params=items[i:i + _MLFLOW_MAX_PARAMS])

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._closed:
            raise RuntimeError("MlflowSink is closed")
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        # NaN and inf go out as they are (MLflow stores them; a NaN loss is worth seeing).
        items = [Metric(mlflow_name(k), v, now, int(step)) for k, v in _numbers(metrics).items()]
        for i in range(0, len(items), _MLFLOW_MAX_METRICS):
            self._client.log_batch(self.run_id, metrics=items[i:i + _MLFLOW_MAX_METRICS])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.set_terminated(self.run_id, "FINISHED")


def make_trackers(cfg, run_dir: str | os.PathLike, resumed: bool) -> list[MetricSink]:
    """The sinks of `cfg.metrics.trackers` that are experiment trackers (wandb, mlflow), in the listed order.
    `resumed`: the run continues from a checkpoint, so the trackers continue their runs too."""
    m, name = cfg.metrics, cfg.experiment.name
    config = cfg.model_dump(mode="json")
    sinks: list[MetricSink] = []
    try:
        for tracker in m.trackers:
            if tracker == "wandb":
                sinks.append(WandbSink(run_dir, name, config, m.wandb_mode, m.wandb_project, resumed))
            elif tracker == "mlflow":
                sinks.append(MlflowSink(run_dir, name, config, m.mlflow_tracking_uri, resumed))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
