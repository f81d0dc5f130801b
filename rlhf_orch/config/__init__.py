"""Experiment configuration: the pydantic schema and the YAML/override loader."""
from rlhf_orch.config.loader import apply_override, load_config
from rlhf_orch.config.engines import ENGINE_KINDS
from rlhf_orch.config.schema import ExperimentConfig, engine_names

__all__ = ["ENGINE_KINDS", "ExperimentConfig", "apply_override", "engine_names", "load_config"]
