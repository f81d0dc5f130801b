"""Worker groups for the models a run holds apart from the policy ranks: one actor class and one driver-side group
class for every such role (the policy ranks are actors/trainer.py: they also sync weights to the engines).

- `reference` (reference.placement: separate): the frozen KL reference (rlhf_orch/trainer/reference.py), forward
  only; the [B, T] logprobs of each policy shard. Its workers are independent copies (no process group).
- `critic` (critic.placement: separate): the value model (rlhf_orch/trainer/critic.py) as a DeepSpeed group of its
  own: its own process group, ZeRO stage, optimizer and learning rate. Per step it computes the values of every
  policy shard, then takes one value-loss step on the returns the policy ranks computed from them, while the policy
  ranks take their own step.

A `RoleActor` is one rank of one role. `RoleGroup` (driver side, not an actor) starts a role's ranks (on cuda a GPU
share each, one GPU by default, asked of Ray outside the trainer's and engines' placement group; nothing on cpu) and gives rank i of W the
policy shards i, i+W, ...: object references in and out, so a step's tokens never pass through the driver.
The reward model is the third role a model can have; its workers are the reward actors (actors/reward.py), because
they score samples for the rollout manager, not batches for the trainer.
"""
from __future__ import annotations

import os
import time

import ray

from actors.common import Located, get, setup_process
from rlhf_orch.algorithms.base import make_algorithm
from rlhf_orch.config.schema import ExperimentConfig
from rlhf_orch.distributed import init_rank
from rlhf_orch.errors import TrainerError
from rlhf_orch.gpu_memory import with_peak
from rlhf_orch.trainer.critic import DeepSpeedCritic
from rlhf_orch.trainer.options import critic_options, reference_options
from rlhf_orch.trainer.reference import FrozenReference
from rlhf_orch.weight_sync.collective import free_port


@ray.remote
class RoleActor(Located):
    def __init__(self, role: str, rank: int, world_size: int, device: str):
        setup_process(device)
        self.role, self.rank, self.world_size, self.device = role, rank, world_size, device
        self.model = None

    def node_address(self) -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def load(self, model_path: str, cfg: ExperimentConfig, master: tuple[str, int] | None = None,
             state_path: str | None = None) -> str:
        """Build this rank's model from the run's config (a reference: from the policy's snapshot at `state_path`);
        a critic rank first joins its group's process group at `master`."""
        if self.role == "reference":
            self.model = FrozenReference(model_path, device=self.device, **reference_options(cfg, state_path))
            return self.model.device_id()
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        device = init_rank(self.rank, self.world_size, self.device)
        self.model = DeepSpeedCritic(model_path, self.rank, self.world_size, device=device,
                                     **critic_options(cfg, colocated=False))
        return str(device)

    def _ready(self):
        if self.model is None:
            raise TrainerError(f"{self.role} rank {self.rank}: called before load")
        return self.model

    @ray.method(num_returns=2)
    def logprobs(self, batch):
        """Reference: (rows done, [B, T] logprobs); the driver waits on the small first value, the ranks take the
        second."""
        return len(batch), self._ready().logprobs(batch)

    def values(self, *shards):
        """Critic: ({"steps": optimizer steps taken so far, "seconds": this call's}, then each shard's [B, T] values on
        the CPU); called with num_returns = 1 + len(shards)."""
        critic, t0 = self._ready(), time.perf_counter()
        out = [critic.values(s).cpu() for s in shards]
        return ({"steps": critic.steps, "seconds": time.perf_counter() - t0}, *out)

    def train(self, num_tokens_global: float, *parts) -> dict:
        """Critic: one value-loss step over this rank's shards; `parts` is the shards, then their returns, then their
        old values (k of each). Adds `perf/critic_train_s` and on CUDA `mem/critic_peak_gb_max` (this rank's
        allocator peak over the step: the critic group's memory, which the policy ranks' readings no longer
        include)."""
        critic, t0, k = self._ready(), time.perf_counter(), len(parts) // 3
        m = with_peak(critic.device, "mem/critic_peak_gb_max", critic.train_parts,
                      list(zip(parts[:k], parts[k:2 * k], parts[2 * k:])), num_tokens_global)
        return {**m, "perf/critic_train_s": time.perf_counter() - t0}

    def save_checkpoint(self, directory: str, tag: str) -> None:
        self._ready().save_checkpoint(directory, tag)

    def load_checkpoint(self, directory: str, tag: str) -> None:
        self._ready().load_checkpoint(directory, tag)

    def health(self) -> dict:
        return {"pid": os.getpid(), "role": self.role, "rank": self.rank}

    def shutdown(self) -> None:
        """A critic group leaves its process group together (as the policy ranks do)."""
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class RoleGroup:
    def __init__(self, role: str, num: int, device: str, name: str, env: dict, timeout_s: float, gpus: float = 1.0,
                 labels: dict | None = None):
        resources = {"num_gpus": gpus} if device == "cuda" else {"num_cpus": 0}
        if labels:   # nodes.critic / nodes.reference: the nodes these ranks may run on
            resources["label_selector"] = dict(labels)
        self.role, self.timeout_s = role, timeout_s
        self.actors = [RoleActor.options(name=f"{name}-{role}-{i}", runtime_env={"env_vars": env}, **resources)
                       .remote(role, i, num, device) for i in range(num)]

    def call(self, method: str, *args) -> list:
        return get([getattr(a, method).remote(*args) for a in self.actors], self.timeout_s,
                   f"{self.role} ranks: {method}", TrainerError)

    def load(self, model_path: str, cfg: ExperimentConfig, state_path: str | None = None) -> list[str]:
        master = None
        if self.role == "critic":   # rank 0 hosts the group's store
            master = get(self.actors[0].node_address.remote(), self.timeout_s, "critic rank 0", TrainerError)
        return get([a.load.remote(model_path, cfg, master, state_path) for a in self.actors], self.timeout_s,
                   f"{self.role} ranks to load their model", TrainerError)

    def _shares(self, n: int) -> list[list[int]]:
        """Shard indices of each rank: rank i of W takes i, i+W, ..."""
        return [list(range(i, n, len(self.actors))) for i in range(len(self.actors))]

    def logprobs_refs(self, shards: list) -> list:
        """Reference: one object reference of [B, T] logprobs per shard (object references or TrainBatches), returned
        once every worker has computed its share: a dead worker is an error here (naming it), before any policy rank
        enters a step whose collectives the others would wait in for good."""
        done, out = zip(*(self.actors[i % len(self.actors)].logprobs.remote(s) for i, s in enumerate(shards)))
        get(list(done), self.timeout_s, "reference logprobs", TrainerError)
        return list(out)

    def values_refs(self, shards: list) -> tuple[list, list]:
        """Critic: (each rank's {"steps", "seconds"}, one object reference of [B, T] values per shard), not waited
        for: the caller waits on the small first values."""
        info, out = [], [None] * len(shards)
        for actor, share in zip(self.actors, self._shares(len(shards))):
            refs = actor.values.options(num_returns=1 + len(share)).remote(*[shards[i] for i in share])
            info.append(refs[0])
            for i, ref in zip(share, refs[1:]):
                out[i] = ref
        return info, out

    def train_refs(self, shards: list, returns: list, values: list, num_tokens_global: float) -> list:
        """Critic: start every rank's value-loss step on its shards (object references); returns their metrics'
        references."""
        return [actor.train.remote(num_tokens_global, *[shards[i] for i in share], *[returns[i] for i in share],
                                   *[values[i] for i in share])
                for actor, share in zip(self.actors, self._shares(len(shards)))]


def start_role_groups(cfg, name: str, env: dict, timeout_s: float, model_path: str) -> tuple:
    """(reference group, critic group): each None unless the algorithm has the role and its placement is separate.
    The critic group loads its model at once; the reference group loads the policy's snapshot at RL start."""
    roles, device = make_algorithm(cfg.algorithm.model_dump()).roles, cfg.trainer.device
    references = critics = None
    if "reference" in roles and cfg.reference.placement == "separate":
        references = RoleGroup("reference", cfg.reference.num_workers, device, name, env, timeout_s,
                               cfg.reference.gpus_per_worker, cfg.nodes.reference)
    if "critic" in roles and cfg.critic.placement == "separate":
        critics = RoleGroup("critic", cfg.critic.num_ranks, device, name, env, timeout_s, cfg.critic.gpus_per_rank,
                            cfg.nodes.critic)
        try:
            critics.load(cfg.critic.model_path or model_path, cfg)
        except BaseException:   # the caller never sees these groups, so it could not stop them
            for group in (references, critics):
                for a in group.actors if group else []:
                    ray.kill(a)
            raise
    return references, critics
