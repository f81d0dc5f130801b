"""Reward actors: score decoded responses off the driver, with the user's rule-based function, a learned
reward model, or both (reward = function_weight * fn + model_weight * rm; rlhf_orch/rewards/scorer.py).

The function is imported (and its signature checked) at config time by the driver, and the reward model's
folder is checked there too; the actor loads both again in its own process. `builtin:tiny-rm` is built into
`<output_dir>/models/` by the driver (`start_reward_workers`) before any worker starts, so the workers only
load a folder. A worker with `reward.device: cuda` asks Ray for one GPU; on cpu it asks for nothing.
A function that raises, returns a non-finite or non-number value, or runs past `reward.timeout_s` fails the step
with a RewardError naming the function and the offending row (batch and async functions: rlhf_orch/rewards/calls.py).
A worker whose process dies is replaced in place by the rollout manager (`RewardWorkers.start`), which scores its
samples again.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import ray

from actors.common import Located, beside, setup_process
from rlhf_orch.config.schema import RewardSection
from rlhf_orch.models.reward_tiny import RM_BUILTIN, ensure_reward_model_dir
from rlhf_orch.rewards.model import RewardModel
from rlhf_orch.rewards.scorer import RewardScorer


@ray.remote(num_cpus=0)
class RewardActor(Located):
    def __init__(self, function: str | None, model_path: str | None = None, function_weight: float = 1.0,
                 model_weight: float = 1.0, device: str = "cpu", batch_size: int = 16, dtype: str = "float32",
                 batch: bool = False, timeout_s: float | None = None, dense: bool = False):
        setup_process(device if model_path else "cpu")
        model = None
        if model_path:
            model = RewardModel(model_path, device=device, dtype=dtype, batch_size=batch_size)
        self.scorer = RewardScorer(function, model, function_weight, model_weight, batch, timeout_s, dense)
        self.path = self.scorer.path

    def health(self) -> dict:
        """A cheap liveness probe: this worker's process id."""
        import os
        return {"pid": os.getpid()}

    def score(self, items: list[tuple[str, dict]]) -> list[float]:
        return self.scorer.score(items)

    def score_parts(self, items: list[tuple[str, dict]]) -> dict[str, list]:
        """The rewards, each source's values ("function", "model") for per-source metrics, and a dense function's
        "token_rewards"."""
        return self.scorer.score_parts(items)


def resolve_reward_model(cfg) -> str | None:
    """reward.model_path as a folder: builtin:tiny-rm is built (once) under <output_dir>/models/, like the policy."""
    path = cfg.reward.model_path
    if path == RM_BUILTIN:
        path = str(ensure_reward_model_dir(cfg.model.tiny, Path(cfg.experiment.output_dir) / "models",
                                           cfg.experiment.seed).resolve())
    return path


@dataclass(frozen=True)
class RewardWorkers:
    """How this run starts a reward worker: the driver starts `reward.num_workers` of them, and the rollout manager a
    replacement for one that dies (in place: issue #34), from the same typed section."""
    section: RewardSection
    model_path: str | None   # resolved (builtin:tiny-rm built) before any worker starts
    run_name: str
    env: dict
    node: str | None = None  # the driver's node: workers (replacements the manager starts too) stay beside it

    def start(self, label: str):
        """A RewardActor named <run>-reward-<label>, hosting the configured reward sources."""
        r = self.section
        # A GPU worker goes wherever Ray finds a GPU; a CPU one stays beside the driver (actors/common.beside).
        resources = {"num_gpus": 1} if self.model_path and r.device == "cuda" else beside(self.node)
        return RewardActor.options(name=f"{self.run_name}-reward-{label}", runtime_env={"env_vars": self.env},
                                   **resources).remote(r.function, self.model_path, r.function_weight, r.model_weight,
                                                       r.device, r.batch_size, r.dtype, r.batch, r.timeout_s, r.dense)


def start_reward_workers(cfg, name: str, env: dict) -> tuple[list, RewardWorkers]:
    """`reward.num_workers` RewardActors named <name>-reward-<i>, and how to start more (replacements)."""
    spec = RewardWorkers(cfg.reward, resolve_reward_model(cfg), name, env, ray.get_runtime_context().get_node_id())
    return [spec.start(str(i)) for i in range(cfg.reward.num_workers)], spec
