"""The run's identity and where it writes (`experiment`), and which Ray it runs on (`ray`): two sections of the
experiment config, re-exported by schema.py. Describes and validates only; an output_dir given as a URI becomes a
local folder mirrored to that URI (rlhf_orch/storage.py does the transfers).
"""
from __future__ import annotations

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from rlhf_orch.config.base import _Section
from rlhf_orch.storage import is_uri, local_mirror


class ExperimentSection(_Section):
    name: str = Field("experiment", min_length=1, description="Run name; used for output folders and metric tags.")
    output_dir: str = Field("runs", description="Parent folder; the run writes to <output_dir>/<name>/.")
    seed: int = Field(0, description="Seeds Python, torch and the data order on every actor.")
    steps: int = Field(100, ge=1, description="RL steps (each: generate -> score -> train -> sync).")
    log_samples_every: int = Field(25, ge=0, description="Log one decoded sample every N steps (0: never).")
    overwrite: bool = Field(False, description="A fresh run (resume=false) whose folder holds an earlier run's outputs "
                            "deletes them first; without it such a run is refused before Ray starts.")
    storage_uri: str | None = Field(None, description="Mirror the run folder to s3://, gs://, file://... (pyarrow.fs; "
                                    "rlhf_orch/storage.py); an output_dir given as a URI sets it (and a local folder).")

    @model_validator(mode="before")
    @classmethod
    def _uri_output(cls, data):
        if isinstance(data, dict) and is_uri(uri := data.get("output_dir")):   # s3://... mirrored from a local folder
            data = {**data, "output_dir": local_mirror(uri), "storage_uri": data.get("storage_uri") or uri}
        return data

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        # The name is a folder under output_dir: a separator or '..' would write outside it (or into another run).
        if "/" in v or "\\" in v or v in (".", "..") or v.strip() != v:
            raise PydanticCustomError("run_name", "not a plain folder name (no '/', '\\', '..' or surrounding spaces); "
                                      "put the folder in experiment.output_dir and a plain name here")
        return v


class RaySection(_Section):
    address: str | None = Field(None, description="Ray cluster to join; default: RAY_ADDRESS, else start a local one.")
    num_cpus: float | None = Field(None, gt=0, description="CPUs for a local Ray (default: the machine's).")
    get_timeout_s: float = Field(600.0, gt=0, description="Timeout of every blocking wait on an actor.")
