"""Turn samples into padded `TrainBatch` tensors, and split a batch over data-parallel ranks.

Right padding, the token convention of rlhf_orch.types. The default split is contiguous and as even as
possible in rows; `shard_balanced` (used with a token budget) balances the ranks' token counts instead,
moving whole rows so every per-sample tensor stays attached to its row. Each rank also receives the global number of response tokens so the token-mean loss does
not depend on how samples are split. Pure tensor code: no model, no distributed calls.
"""
from __future__ import annotations

from typing import Sequence

import torch

from rlhf_orch.trainer.packing import balance_rows, imbalance, seq_lengths
from rlhf_orch.types import Sample, TrainBatch


def build_train_batch(samples: Sequence[Sample], advantages: torch.Tensor, pad_id: int,
                      rewards: torch.Tensor | None = None) -> TrainBatch:
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    width = max(len(s) for s in seqs)
    B = len(samples)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    attn = torch.zeros((B, width), dtype=torch.long)
    resp = torch.zeros((B, width), dtype=torch.float32)
    eng_lp = torch.zeros((B, width), dtype=torch.float32)
    for b, (s, seq) in enumerate(zip(samples, seqs)):
        n, p = len(seq), len(s.prompt_ids)
        ids[b, :n] = torch.tensor(seq)
        attn[b, :n] = 1
        resp[b, p:n] = 1.0 if not s.loss_mask else torch.tensor(s.loss_mask, dtype=torch.float32)
        eng_lp[b, p:n] = torch.tensor(s.logprobs, dtype=torch.float32)
    return TrainBatch(ids, attn, resp, advantages.float().clone(), eng_lp,
                      rewards=None if rewards is None else rewards.float().clone())


def build_sft_batch(prompts: Sequence[list[int]], answers: Sequence[list[int]], pad_id: int) -> TrainBatch:
    """Supervised batch: the response tokens are `answers` (advantages 1, engine logprobs unused)."""
    samples = [Sample(i, list(p), list(a), [0.0] * len(a), "stop", -1) for i, (p, a) in enumerate(zip(prompts, answers))]
    return build_train_batch(samples, torch.ones(len(samples)), pad_id)


def row_slices(n: int, size: int) -> list[slice]:
    """Contiguous slices of `size` rows over n rows (one slice of them all when size is 0)."""
    size = size or max(n, 1)
    return [slice(i, min(i + size, n)) for i in range(0, max(n, 1), size)]


def trimmed(batch: TrainBatch, rows) -> tuple[TrainBatch, int]:
    """Rows `rows` of `batch` cut after their own longest row (the rest is right padding), and that width."""
    mb = batch.select(rows)
    width = max(int(mb.attention_mask.sum(1).max()), 1)
    return mb.trim(width), width


def shard_bounds(n: int, world: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) row ranges, sizes differing by at most one."""
    base, extra = divmod(n, world)
    out, start = [], 0
    for r in range(world):
        end = start + base + (1 if r < extra else 0)
        out.append((start, end))
        start = end
    return out


def shard(batch: TrainBatch, world: int) -> list[TrainBatch]:
    return [batch.select(slice(a, b)) for a, b in shard_bounds(len(batch), world)]


def shard_balanced(batch: TrainBatch, world: int) -> tuple[list[TrainBatch], float]:
    """Shards balanced by token count (see packing.balance_rows), and their imbalance (max - mean) / mean."""
    lengths = seq_lengths(batch)
    ranks = balance_rows(lengths, world)
    return [batch.select(rows) for rows in ranks], imbalance([float(sum(lengths[i] for i in r)) for r in ranks])
