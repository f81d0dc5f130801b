"""Forward passes shared by every model a trainer-side process holds: the policy (DeepSpeedTrainer) and a frozen
reference on devices of its own (reference.py). Token logprobs of a right-padded batch, of one micro-batch (one
packed row with `packing`), and of a whole shard cut into micro-batches by rows or by a token budget.

A mixin over a few attributes its host sets: `device`, `temperature`, `chunk` (logprob_chunk_tokens), `budget`
(max_tokens_per_micro_batch), `packing`, `attn` (the varlen attention when packing) and `micro_batch_size`. Both
hosts run the very same code, so a reference held apart gives the numbers the colocated one gives. No optimizer,
no DeepSpeed, no Ray.
"""
from __future__ import annotations

import torch

from rlhf_orch.trainer import packing as pk
from rlhf_orch.trainer.batch import row_slices, trimmed
from rlhf_orch.trainer.logprob import model_logprobs
from rlhf_orch.types import TrainBatch


class Forward:
    device: torch.device
    temperature: float
    chunk: int
    budget: int
    packing: bool
    attn: str | None
    micro_batch_size: int

    def _logprobs(self, module, batch: TrainBatch, with_entropy: bool = False, entropy_grad: bool = False):
        """([B, T] logprobs, [B, T] entropies or None) of a right-padded batch; position 0 predicts nothing."""
        ids = batch.input_ids.to(self.device)
        attn = batch.attention_mask.to(self.device)
        tok, ent = model_logprobs(module, ids, self.temperature, self.chunk, with_entropy, entropy_grad,
                                  attention_mask=attn)
        pad = torch.nn.functional.pad
        return pad(tok, (1, 0)), (pad(ent, (1, 0)) if ent is not None else None)

    def _mb_logprobs(self, module, mb: TrainBatch, with_entropy: bool = False, entropy_grad: bool = False):
        """One micro-batch's [b, w] logprobs (and entropies, with a gradient for an entropy bonus): one packed row
        with `packing`, the padded forward otherwise."""
        if self.packing:
            return pk.packed_logprobs(module, mb, self.temperature, self.attn, self.device, self.chunk, with_entropy,
                                      entropy_grad)
        return self._logprobs(module, mb, with_entropy, entropy_grad)

    def _shard_logprobs(self, module, batch: TrainBatch) -> torch.Tensor:
        """[B, T] logprobs of a whole shard (callers hold no_grad). With a token budget it goes one
        micro-batch at a time, so a no-grad pass never needs more memory than a training micro-batch."""
        if not self.budget:
            return self._logprobs(module, batch)[0]
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        for rows in self._micro_batches(batch):
            mb, width = trimmed(batch, rows)
            out[rows, :width] = self._mb_logprobs(module, mb)[0]
        return out

    def _micro_batches(self, batch: TrainBatch) -> list[slice] | list[list[int]]:
        """Row selections of a shard: token-budget groups (packing.micro_batch_plan) when a budget is set,
        else contiguous slices of `micro_batch_size` rows (the whole shard when 0)."""
        n = len(batch)
        if self.budget and n:
            return pk.micro_batch_plan(pk.seq_lengths(batch), self.budget, self.packing)
        return row_slices(n, self.micro_batch_size)
