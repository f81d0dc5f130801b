"""The critic role: a value model (a causal LM's decoder with a scalar head) trained by DeepSpeed.

`ValueModel` loads a Hugging Face causal LM folder, keeps its decoder and adds `value_head`, a linear map
from the hidden state to one number; the LM head is dropped. The value at position t is read from the
hidden state of position t-1, so it estimates the return before token t is generated (the same position
that predicts token t's logprob); position 0 holds 0.

`DeepSpeedCritic` is one data-parallel rank of it, with its own DeepSpeed engine, optimizer and learning
rate. By default it lives in the same process as a policy rank (the process group is the policy's) and its states
leave the GPU with the policy's under trainer.offload; with `critic.placement: separate` it is a rank of a critic group
of its own (actors/roles.py joins that group's process group first) and may serve several policy shards per step. It
computes values (no grad), takes value-loss steps (verl's clipped loss, aggregated by the global token count
as the policy's loss is), and saves/loads its checkpoint. It knows no algorithm: PPO (algorithms/ppo.py)
turns its values into advantages and returns. It cuts a shard into micro-batches as the policy does (rows, or the
trainer's token budget: forward.Forward) and with `packing` runs each as one packed row (packing.packed_values).
It never syncs weights to engines.
"""
from __future__ import annotations

import logging
import os

import torch

from rlhf_orch.algorithms.losses import value_loss
from rlhf_orch.distributed import import_deepspeed
from rlhf_orch.errors import TrainerError
from rlhf_orch.trainer import packing as pk
from rlhf_orch.trainer.batch import trimmed
from rlhf_orch.trainer.deepspeed_trainer import ds_config
from rlhf_orch.trainer.forward import Forward
from rlhf_orch.trainer.offload import Offloadable
from rlhf_orch.types import TrainBatch

logger = logging.getLogger(__name__)


class ValueModel(torch.nn.Module):
    def __init__(self, model_path: str, seed: int, attn: str | None = None):
        super().__init__()
        from transformers import AutoModelForCausalLM
        extra = {"attn_implementation": attn} if attn else {}
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **extra)
        self.config = lm.config
        self.decoder = lm.get_decoder()
        torch.manual_seed(seed + 1)   # its own head, reproducibly: not the policy's draw
        self.value_head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.normal_(self.value_head.weight, std=1.0 / (lm.config.hidden_size + 1))
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask=None, **kw) -> torch.Tensor:
        """`kw`: a packed row's position ids and attention boundaries (packing.packed_values)."""
        hidden = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kw).last_hidden_state
        v = self.value_head(hidden).squeeze(-1).float()            # [B, T]: value after each position
        return torch.nn.functional.pad(v[:, :-1], (1, 0))           # position t: the value before token t


class DeepSpeedCritic(Forward, Offloadable):
    role = "critic"   # offload.Offloadable: moves with its policy rank under trainer.offload (colocated)

    def __init__(self, model_path: str, rank: int, world_size: int, *, device: torch.device, zero_stage: int,
                 lr: float, weight_decay: float = 0.0, grad_clip: float = 1.0, bf16: bool = False, seed: int = 0,
                 micro_batch_size: int = 0, cliprange_value: float = 0.5, gradient_checkpointing: bool = False,
                 max_tokens_per_micro_batch: int = 0, packing: bool = False, attn: str = "auto", vf_coef: float = 1.0):
        deepspeed = import_deepspeed()   # not `import deepspeed`: a critic group's first import leaves out mlflow
        self.rank, self.world_size, self.device = rank, world_size, device
        self.micro_batch_size, self.cliprange_value, self.vf_coef = micro_batch_size, cliprange_value, vf_coef
        self.budget, self.packing = max_tokens_per_micro_batch, packing
        if packing and not self.budget:
            raise TrainerError("critic: packing needs trainer.max_tokens_per_micro_batch > 0")
        self.attn = pk.resolve_attn(attn, device.type) if packing else None
        # Micro-batches accumulate by hand, as in the policy trainer.
        config = ds_config(world_size, zero_stage, lr, weight_decay, grad_clip, bf16, manual_accumulation=True)
        try:
            model = ValueModel(model_path, seed, self.attn)
            if gradient_checkpointing:
                model.decoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        except Exception as e:
            raise TrainerError(f"critic rank {rank}: DeepSpeed initialisation failed: {type(e).__name__}: {e}") from e
        self.steps, self.zero_stage, self.offloaded = 0, zero_stage, False

    def _values(self, batch: TrainBatch) -> torch.Tensor:
        if self.packing:
            return pk.packed_values(self.engine, batch, self.attn, self.device)
        return self.engine(batch.input_ids.to(self.device), batch.attention_mask.to(self.device))

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] values of a shard (0 at position 0; garbage at padding: callers mask)."""
        self._need_states("values")
        self.engine.module.eval()
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        for rows in self._micro_batches(batch):
            mb, width = trimmed(batch, rows)
            out[rows, :width] = self._values(mb)
        return out

    def train_step(self, batch: TrainBatch, returns: torch.Tensor, old_values: torch.Tensor,
                   num_tokens_global: float) -> dict[str, float]:
        """One optimizer step of the clipped value loss on this rank's shard; flat `critic/` metrics."""
        return self.train_parts([(batch, returns, old_values)], num_tokens_global)

    def train_parts(self, parts: list[tuple[TrainBatch, torch.Tensor, torch.Tensor]],
                    num_tokens_global: float) -> dict[str, float]:
        """One optimizer step over several (shard, returns, old values): a critic rank of a group of its own serves
        more than one policy shard; gradients accumulate over all their micro-batches."""
        self._need_states("train")
        self.engine.module.train()
        total, clipped, tokens = 0.0, 0.0, 0.0
        for batch, returns, old_values in parts:
            mask = batch.response_mask.to(self.device)
            returns, old_values = returns.to(self.device), old_values.to(self.device)
            for rows in self._micro_batches(batch):
                mb, width = trimmed(batch, rows)
                vpred = self._values(mb)
                loss, m = value_loss(vpred, old_values[rows, :width], returns[rows, :width], mask[rows, :width],
                                     self.cliprange_value, num_tokens_global=num_tokens_global)
                # DeepSpeed averages gradients over ranks; each rank's loss is over the global token count.
                self.engine.backward(loss * self.vf_coef * self.world_size, scale_wrt_gas=False)
                total += float(loss.detach())
                clipped += m["vf_clipfrac"] * float(mask[rows, :width].sum())
            tokens += float(mask.sum())
        self.engine.step()
        self.steps += 1
        gn = self.engine.get_global_grad_norm()
        return {"critic/vf_loss": total * self.world_size, "critic/vf_clipfrac": clipped / max(tokens, 1.0),
                "critic/grad_norm": float(gn) if gn is not None else float("nan")}

    def save_checkpoint(self, directory: str, tag: str) -> None:
        with self._states_loaded():
            self.engine.save_checkpoint(directory, tag=tag, client_state={"critic_steps": self.steps}, save_latest=False)

    def load_checkpoint(self, directory: str, tag: str) -> None:
        self.reload_states()
        if not os.path.isdir(os.path.join(directory, tag)):
            raise TrainerError(f"critic rank {self.rank}: no critic checkpoint {tag!r} in {directory}")
        path, client = self.engine.load_checkpoint(directory, tag=tag, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        if path is None:
            raise TrainerError(f"critic rank {self.rank}: could not load critic checkpoint {tag!r} from {directory}")
        self.steps = int(client.get("critic_steps", 0))
