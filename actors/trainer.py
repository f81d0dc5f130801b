"""Trainer actors: one Ray actor per DeepSpeed rank, and the driver-side group that drives them.

`TrainerActor` only builds a `DeepSpeedTrainer` and a `WeightSender` and forwards calls; `TrainerGroup`
(driver side, not an actor) starts N of them with a rendezvous from rank 0, shards batches and
averages their metrics. Bulk tensors move between trainer and engines only through the sender's
transports; Ray carries small batches, handles and metrics.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import ray

from actors.common import Located, actor_env, get, setup_process
from rlhf_orch.config.schema import ExperimentConfig
from rlhf_orch.errors import TrainerError
from rlhf_orch.gpu_memory import process_memory, stats, with_peak
from rlhf_orch.trainer.batch import shard
from rlhf_orch.trainer.critic import DeepSpeedCritic
from rlhf_orch.trainer.deepspeed_trainer import DeepSpeedTrainer
from rlhf_orch.trainer.options import critic_options, policy_options
from rlhf_orch.trainer.packing import imbalance
from rlhf_orch.trainer.token_step import advantages, policy_update, token_level_step
from rlhf_orch.types import TrainBatch
from rlhf_orch.weight_sync import WeightSender
from rlhf_orch.weight_sync.abort import AbortFlag
from rlhf_orch.weight_sync.collective import free_port

if TYPE_CHECKING:   # the driver's placement, for the annotation only: actors/ never imports driver/
    from driver.placement import Placement


# health and abort_sync answer while a call runs; "sync" sends staged weights while the next step trains
@ray.remote(concurrency_groups={"control": 1, "sync": 1})
class TrainerActor(Located):
    def __init__(self, rank: int, world_size: int, device: str, device_id: str):
        setup_process(device)
        self.rank, self.world_size, self.device = rank, world_size, device
        self._device_id = device_id
        self.trainer = None
        self.sender = None
        self._kept_stage: tuple[list, int | None] = ([], None)   # a closed sender's staged weights (weight_sync.overlap)
        self.abort_flag = AbortFlag.private()   # the coordinator's abort_sync ends this rank's side of a sync at once

    def node_address(self) -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def init(self, master_addr: str, master_port: int, model_path: str, cfg: ExperimentConfig) -> str:
        """Build this rank's DeepSpeed policy (and the critic, where it lives in the policy ranks) from the run's
        config (rlhf_orch/trainer/options.py)."""
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        critic = critic_options(cfg, colocated=True)
        self.trainer = DeepSpeedTrainer(model_path, self.rank, self.world_size, device=self.device,
                                        **policy_options(cfg))
        self.critic, self._prepared = None, None
        if self.trainer.algo.needs_critic and critic is not None:   # critic.placement colocated: in this process
            c = dict(critic)
            self.critic_warmup = c.pop("warmup_steps", 0)
            self.critic = DeepSpeedCritic(c.pop("model_path") or model_path, self.rank, self.world_size,
                                          device=self.trainer.device, **c)
        return self.device_id()

    @ray.method(concurrency_group="control")
    def health(self) -> dict:
        """A cheap liveness probe (the driver's, before a checkpoint): this rank's process id. Answered on its own
        thread, so a busy rank (training, sending weights) still answers at once."""
        import os
        return {"pid": os.getpid(), "rank": self.rank}

    def device_id(self) -> str:
        return self.trainer.device_id() or self._device_id

    # ---- training -----------------------------------------------------------------------------
    def logprobs(self, batch: TrainBatch):
        return self.trainer.logprobs(batch)

    def train_step(self, batch: TrainBatch, num_tokens_global: float, ref_logprobs=None) -> dict:
        """`ref_logprobs`: this shard's [B, T] logprobs from the separate reference group (None: the reference,
        if any, is this rank's own copy). On CUDA also `mem/trainer_peak_gb_max`: the most this rank's allocator
        held during the step (the colocation plan of `trainer.offload: auto` reads it; max over ranks)."""
        if ref_logprobs is not None:
            batch.ref_logprobs = ref_logprobs
        if self.trainer.algo.token_level:
            return self._peak(token_level_step, self.trainer, self.critic, getattr(self, "critic_warmup", 0), batch,
                              num_tokens_global)
        return self._peak(self.trainer.train_step, batch, num_tokens_global)

    def _peak(self, fn, *args) -> dict:
        return with_peak(self.trainer.device, "mem/trainer_peak_gb_max", fn, *args)

    # A critic group of its own (critic.placement: separate): the step in two calls, so the group trains on the
    # returns while this rank trains the policy.
    @ray.method(num_returns=2)
    def advantages(self, batch: TrainBatch, ref_logprobs, values, frozen: bool):
        """(metrics, [B, T] returns) of this shard from the critic group's `values`; the batch, with its advantages,
        waits for `train_prepared`. `frozen`: the critic is still warming up."""
        if ref_logprobs is not None:
            batch.ref_logprobs = ref_logprobs
        returns, m = advantages(self.trainer, batch, values)
        self._prepared = (batch, frozen)
        return m, returns.cpu()

    def train_prepared(self, num_tokens_global: float) -> dict:
        if self._prepared is None:
            raise TrainerError(f"trainer rank {self.rank}: train_prepared without advantages first")
        (batch, frozen), self._prepared = self._prepared, None
        return self._peak(policy_update, self.trainer, batch, num_tokens_global, frozen)

    def sft_step(self, batch: TrainBatch, num_tokens_global: float) -> dict:
        return self.trainer.sft_step(batch, num_tokens_global)

    def snapshot_reference(self, path: str | None = None, reuse: bool = False, keep: bool = True) -> None:
        self.trainer.snapshot_reference(path, reuse, keep)

    def load_checkpoint(self, directory: str, tag: str) -> dict:
        out = self.trainer.load_checkpoint(directory, tag)
        if self.critic is not None:
            self.critic.load_checkpoint(os.path.join(directory, tag), "critic")
        return out

    def save_checkpoint(self, directory: str, tag: str, client_state: dict) -> str:
        path = self.trainer.save_checkpoint(directory, tag, client_state)
        if self.critic is not None:   # inside the policy's tag folder, so the manifest and commit cover it
            self.critic.save_checkpoint(path, "critic")
        return path

    def export_hf(self, directory: str, spec=None) -> None:
        """The policy only (the critic is in the DeepSpeed checkpoint, not exported); `spec`: trainer/export.py."""
        self.trainer.export_hf(directory, spec)

    # ---- colocation -----------------------------------------------------------------------------
    def offload_states(self) -> dict:
        return self._with_critic(self.trainer.offload_states(), "offload_states")

    def reload_states(self) -> dict:
        return self._with_critic(self.trainer.reload_states(), "reload_states")

    def _with_critic(self, m: dict, method: str) -> dict:
        """A colocated critic moves with the policy: its seconds and GiB add to the policy's."""
        if self.critic is None:
            return m
        for k, v in getattr(self.critic, method)().items():
            m[k] = m.get(k, 0.0) + v
        return m

    def memory_stats(self, release: bool = False) -> dict:
        """Bytes on this rank's GPU for the colocation plan: the device's total and used (every process), this
        rank's allocated/reserved and their peaks since the last train step began. `release`: give the allocator's
        free cached blocks back first (the trainer at rest). {} on CPU."""
        s = stats(self.trainer.device, release)
        return {"device": self.device_id(), **s} if s else {}

    def release_cache(self) -> float:
        """Give the allocator's free cached blocks back to the device (a trainer that stays resident while the
        engines take their KV cache back); returns seconds."""
        import time
        import torch
        t0 = time.perf_counter()
        if self.trainer.device.type == "cuda":
            torch.cuda.empty_cache()
        return time.perf_counter() - t0

    def device_memory(self) -> dict[str, float]:
        """{device id: used GiB} of this rank's GPU ({} on CPU)."""
        m = process_memory(self.trainer.device)
        return {self.device_id(): m["device_used_gb"]} if m else {}

    # ---- weight sync ----------------------------------------------------------------------------
    def param_specs(self, dtype: str):
        return self.trainer.param_specs(dtype)

    def setup_sender(self, layouts, specs: dict[str, dict], verify: bool, timeout_s: float) -> dict:
        """Setup's first round (weight_sync/transport.py): open this rank's side of every transport it sends on
        ({transport: spec}; rank 0's broadcast group blocks until every member joined). Returns the offers its
        receivers connect with ({transport: offer}; ipc: the ring buffers' handles)."""
        self.close_sender()   # a re-plan after an engine fault: leave the old broadcast group first
        here = ray.util.get_node_ip_address()   # where a gloo group's sockets bind (the store may sit elsewhere)
        self.sender = WeightSender(layouts, self.trainer.device, {n: {**s, "local_host": here} for n, s in specs.items()},
                                   verify, timeout_s=timeout_s, abort_flag=self.abort_flag)
        # weight_sync.overlap: a failed sync is sent again from its staged copy, which outlives the old sender
        self.sender.adopt_stage(*self._kept_stage)
        return self.sender.offers()

    def accept(self, transport: str, engine: str, answer) -> None:
        """Setup's third round: `engine` connected over `transport` and answered (ipc: its mailbox)."""
        self.sender.accept(transport, engine, answer)

    @ray.method(concurrency_group="control")
    def abort_sync(self, sync_id: int) -> float:
        """Answered on its own thread while `send_weights` runs: its waits raise SyncAborted at once, and rank 0
        leaves the broadcast group, which frees every broadcast receiver (weight_sync/sender.py)."""
        self.abort_flag.abort(int(sync_id))
        return time.time()

    def close_sender(self) -> None:
        if getattr(self, "sender", None) is not None:
            self._kept_stage = self.sender.kept_stage()
            self.sender.close()
        self.sender = None

    def send_weights(self, version: int, sync_id: int = 0):
        return self.sender.send(self.trainer.iter_named_tensors(self._gather_groups()), version, sync_id)

    def stage_weights(self, version: int) -> dict:
        """Copy this rank's weights into the sender's staging buffer (weight_sync.overlap): `send_staged` then
        transfers them while this rank trains the next step. Every rank together (ZeRO-3 gathers)."""
        return self.sender.stage(self.trainer.iter_named_tensors(self._gather_groups()), version)

    @ray.method(concurrency_group="sync")
    def send_staged(self, version: int, sync_id: int = 0):
        """Send the staged weights (of `version`) on a thread of their own: train_step runs meanwhile on the actor's
        default thread. The buffers it reads are the sender's, which no train step touches."""
        if self.sender.staged_version != version:
            raise TrainerError(f"trainer rank {self.rank}: staged weights are version {self.sender.staged_version}, "
                               f"not {version}")
        return self.sender.send(self.sender.staged(), version, sync_id)

    def _gather_groups(self) -> list[list[str]]:
        return [layout.names for layout in self.sender.layouts]   # ZeRO-3 gathers one bucket at a time

    def shutdown(self) -> None:
        """Leave the process groups in order, so no rank dies on a store whose host already exited."""
        import torch.distributed as dist
        if self.sender is not None:
            self.sender.release()   # CPU: its shared buffers' names; the driver kills this process next
        self.close_sender()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _average(results: list[dict]) -> dict[str, float]:
    """Per-rank metrics -> one: max for *_max, min for *_min, sums for *_sum, token counts and tokens/s (ranks run
    at the same time), means for the rest; the ranks' `train/seq_tokens` also give `train/rank_imbalance`."""
    out: dict[str, float] = {}
    for key in results[0]:
        vals = [r[key] for r in results]
        if key.endswith("_max"):
            out[key] = max(vals)
        elif key.endswith("_min"):
            out[key] = min(vals)
        elif key.endswith("_sum") or key.endswith("tokens") or key.endswith("tokens_per_s"):
            out[key] = sum(vals)
        else:
            out[key] = sum(vals) / len(vals)
    if "train/seq_tokens" in results[0]:
        out["train/rank_imbalance"] = imbalance([r["train/seq_tokens"] for r in results])
    if "train/flops" in results[0]:
        out["train/rank_flops_imbalance"] = imbalance([r["train/flops"] for r in results])
        out["train/rank_time_imbalance"] = imbalance([r["train/time_s"] for r in results])
    return out


class TrainerGroup:
    """Driver-side handle on all trainer ranks (not an actor)."""

    def __init__(self, placement: Placement, device: str, name: str, timeout_s: float):
        n = len(placement.trainer_bundles)
        self.timeout_s = timeout_s
        env = actor_env(device)
        self.actors = [
            TrainerActor.options(**placement.options(b, f"{name}-trainer-{r}", env)).remote(
                r, n, device, placement.device_id(b))
            for r, b in enumerate(placement.trainer_bundles)
        ]

    def _all(self, what: str, method: str, *args):
        return get([getattr(a, method).remote(*args) for a in self.actors], self.timeout_s, what, TrainerError)

    def init(self, model_path: str, cfg: ExperimentConfig, refs: list | None = None) -> list[str]:
        """Every rank builds its model and DeepSpeed engine; waits for `refs` of an earlier `init_async` if given."""
        refs = self.init_async(model_path, cfg) if refs is None else refs
        return get(refs, self.timeout_s, "trainer ranks to initialise DeepSpeed", TrainerError)

    def init_async(self, model_path: str, cfg: ExperimentConfig) -> list:
        addr, port = get(self.actors[0].node_address.remote(), self.timeout_s, "trainer rank 0", TrainerError)
        return [a.init.remote(addr, port, model_path, cfg) for a in self.actors]

    def logprobs(self, batch: TrainBatch):
        import torch
        parts = get([a.logprobs.remote(s) for a, s in zip(self.actors, shard(batch, len(self.actors)))],
                    self.timeout_s, "trainer logprobs", TrainerError)
        width = batch.input_ids.shape[1]
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])

    def step(self, method: str, batch: TrainBatch) -> dict:
        """Run `train_step` or `sft_step` on every rank's shard; metrics averaged (max for *_max, summed counts)."""
        tokens = float(batch.response_mask.sum())
        shards = shard(batch, len(self.actors))
        return self.step_shards(method, shards, tokens)

    def step_shards(self, method: str, shards: list, tokens: float, extra: list | None = None) -> dict:
        """Like `step`, for a batch already split per rank (object refs from the rollout manager: the
        tensors go from the object store to each rank without passing through the driver). `extra`: one more
        argument per rank (the reference group's logprobs, object refs too)."""
        args = [(s, tokens) if extra is None else (s, tokens, e) for s, e in zip(shards, extra or shards)]
        results = get([getattr(a, method).remote(*arg) for a, arg in zip(self.actors, args)],
                      self.timeout_s, f"trainer {method}", TrainerError)
        return _average(results)

    def step_with_critic(self, shards: list, tokens: float, extra: list | None, critics, values: tuple,
                         warmup_steps: int) -> dict:
        """A token-level step with a critic group of its own (actors/roles.py): `values` is its (step counts and
        seconds, value references) for `shards`; the ranks compute advantages and returns, then the policy and the
        critic train at the same time. Metrics: the ranks' averaged, then the critic ranks' averaged."""
        info, vals = values
        info = get(info, self.timeout_s, "critic values", TrainerError)
        frozen = min(i["steps"] for i in info) < warmup_steps
        extra = extra or [None] * len(shards)
        prep = [a.advantages.remote(s, e, v, frozen) for a, s, e, v in zip(self.actors, shards, extra, vals)]
        adv_refs, ret_refs = zip(*prep)
        critic_refs = critics.train_refs(shards, list(ret_refs), vals, tokens)
        upd = get([a.train_prepared.remote(tokens) for a in self.actors], self.timeout_s, "trainer train_prepared",
                  TrainerError)
        adv = get(list(adv_refs), self.timeout_s, "trainer advantages", TrainerError)
        out = _average([{**a, **u} for a, u in zip(adv, upd)])
        critic = _average(get(critic_refs, self.timeout_s, "critic train", TrainerError))
        return {**out, **critic, "perf/critic_values_s": max(i["seconds"] for i in info)}

    def call(self, method: str, *args):
        return self._all(f"trainer {method}", method, *args)
