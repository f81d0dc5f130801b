"""The separate reference group (`reference.placement: separate`): Ray shells around rlhf_orch.trainer.reference.

`ReferenceGroup` (driver side) starts `reference.num_workers` ReferenceActors (one GPU each on cuda, asked of Ray
outside the trainer's and engines' placement, like reward-model workers; nothing on cpu), loads the snapshot the
policy ranks wrote, and for each step hands every policy shard's object reference to a worker: the logprobs come
back as object references too, which the driver passes to the policy ranks beside their shards, so the tokens and
logprobs of a step never pass through the driver (it waits only on a row count per shard).
"""
from __future__ import annotations

import ray

from actors.common import get, setup_process
from rlhf_orch.errors import TrainerError


@ray.remote
class ReferenceActor:
    def __init__(self, device: str):
        setup_process(device)
        self.device = device
        self.ref = None

    def load(self, model_path: str, state_path: str, kwargs: dict) -> str:
        from rlhf_orch.trainer.reference import FrozenReference
        self.ref = FrozenReference(model_path, state_path, device=self.device, **kwargs)
        return self.ref.device_id()

    @ray.method(num_returns=2)
    def logprobs(self, batch):
        """(rows done, [B, T] logprobs): the driver waits on the small first value, the ranks take the second."""
        if self.ref is None:
            raise TrainerError("reference worker: logprobs before load")
        return len(batch), self.ref.logprobs(batch)

    def health(self) -> dict:
        import os
        return {"pid": os.getpid()}


# The policy's forward settings the reference must share to give the same numbers (FrozenReference's arguments).
FORWARD_KEYS = ("temperature", "micro_batch_size", "max_tokens_per_micro_batch", "packing", "attn",
                "logprob_chunk_tokens")


class ReferenceGroup:
    def __init__(self, cfg, name: str, env: dict, timeout_s: float):
        device = cfg.trainer.device
        resources = {"num_gpus": 1} if device == "cuda" else {"num_cpus": 0}
        self.timeout_s = timeout_s
        self.actors = [ReferenceActor.options(name=f"{name}-reference-{i}", runtime_env={"env_vars": env},
                                              **resources).remote(device)
                       for i in range(cfg.reference.num_workers)]

    def load(self, model_path: str, state_path: str, trainer_kwargs: dict) -> list[str]:
        """Every worker loads the snapshot at `state_path` (written by the policy ranks just before)."""
        kw = {k: trainer_kwargs[k] for k in FORWARD_KEYS}
        return get([a.load.remote(model_path, state_path, kw) for a in self.actors], self.timeout_s,
                   "reference workers to load the reference", TrainerError)

    def logprobs_refs(self, shards: list) -> list:
        """One object reference of [B, T] logprobs per shard (object references or TrainBatches), round robin,
        returned once every worker has computed its share: a dead worker is an error here (naming it), before any
        policy rank enters a step whose collectives the others would wait in for good."""
        done, out = zip(*(self.actors[i % len(self.actors)].logprobs.remote(s) for i, s in enumerate(shards)))
        get(list(done), self.timeout_s, "reference logprobs", TrainerError)
        return list(out)
