"""Padding-free training helpers: token-budget micro-batches, token-balanced rank shards, packed forward.

- `micro_batch_plan`: a rank's rows grouped into micro-batches of at most `budget` computed positions,
  sorted by length so similar lengths share a micro-batch.
- `balance_rows`: a step's rows split over data-parallel ranks by token count (longest first, each to the
  rank with the fewest tokens so far), instead of contiguous equal-count shards.
- `packed_logprobs`: one micro-batch's sequences concatenated into a single row (position ids restarting
  at 0 per sequence, block-diagonal causal attention), its per-token logprobs unpacked back into the
  usual right-padded [B, W] layout, so the loss code is the same for both paths. `packed_values` does the same
  for a value model (the critic).
- `resolve_attn`: the attention implementation for the packed path: flash_attention_2 (the flash_attn
  package), varlen (torch's own flash varlen kernel on CUDA, per-sequence SDPA elsewhere: varlen.py), or
  sdpa with a block-diagonal [L, L] mask.

Pure torch plus a Hugging Face causal LM passed in: no DeepSpeed, no Ray, no distributed calls. It does not
change the loss or its normalisation: gradient accumulation stays exact because every micro-batch's loss is
already divided by the global token count (see `aggregate_token_loss`).
"""
from __future__ import annotations

import heapq
import importlib.util
import logging

import torch

from rlhf_orch.errors import ConfigError
from rlhf_orch.trainer import varlen
from rlhf_orch.trainer.logprob import model_logprobs
from rlhf_orch.types import TrainBatch

logger = logging.getLogger(__name__)

ATTN_CHOICES = ("auto", "varlen", "sdpa", "flash_attention_2")


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attn(attn: str, device: str = "cpu") -> str:
    """The attention implementation to load the model with for packed training (a transformers
    attn_implementation name; varlen registers its own)."""
    if attn not in ATTN_CHOICES:
        raise ConfigError(f"trainer.attn: unknown attention {attn!r}; use one of: {', '.join(ATTN_CHOICES)}")
    if attn == "flash_attention_2":
        if not flash_attn_available():
            raise ConfigError("trainer.attn: flash_attention_2 needs the flash_attn package; install it with "
                              "`pip install flash-attn --no-build-isolation` (CUDA only), or set trainer.attn: auto/sdpa")
        return attn
    if attn == "auto":
        if device == "cuda" and flash_attn_available():
            return "flash_attention_2"
        how = ("torch's flash varlen kernel" if device == "cuda" and varlen.torch_varlen_available()
               else "one causal SDPA call per sequence")
        logger.info("trainer.attn auto: packed sequences attend through %s (flash_attn %s)", how,
                    "is for cuda only" if device != "cuda" else "is not installed")
        attn = "varlen"
    if attn == "varlen":
        return varlen.register()
    return "sdpa"


def seq_lengths(batch: TrainBatch) -> list[int]:
    """Real tokens (prompt + response) per row; padding is always on the right."""
    return [int(n) for n in batch.attention_mask.sum(1).tolist()]


def micro_batch_plan(lengths: list[int], budget: int, packed: bool) -> list[list[int]]:
    """Row indices of each micro-batch, every row exactly once, each micro-batch within `budget` positions.

    Rows are sorted longest first (stable) and filled greedily in that order. The cost counted is what the
    forward computes: the sum of lengths when packed, rows x longest row when padded (a padded micro-batch
    trims to its own longest row, and the sort keeps that close to the sum). A single row longer than the
    budget still gets a micro-batch of its own (config validation prevents it for sampled sequences).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    plans: list[list[int]] = []
    cur: list[int] = []
    total = longest = 0
    for i in order:
        n = lengths[i]
        nl = max(longest, n)
        cost = total + n if packed else (len(cur) + 1) * nl
        if cur and cost > budget:
            plans.append(cur)
            cur, total, nl = [], 0, n
        cur.append(i)
        total += n
        longest = nl
    if cur:
        plans.append(cur)
    return plans


def balance_rows(lengths: list[int], world: int) -> list[list[int]]:
    """Row indices per rank, balanced by token count (longest-processing-time greedy). Each rank's rows are
    in ascending order; with at least `world` non-empty rows every rank gets one."""
    heap = [(0, r) for r in range(world)]   # (tokens so far, rank): ties go to the lower rank
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        tokens, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (tokens + lengths[i], r))
    return [sorted(rows) for rows in out]


def imbalance(tokens_per_rank: list[float]) -> float:
    """(max - mean) / mean of the per-rank token counts (0 for an empty step)."""
    if not tokens_per_rank:
        return 0.0
    mean = sum(tokens_per_rank) / len(tokens_per_rank)
    return (max(tokens_per_rank) - mean) / mean if mean > 0 else 0.0


def pack(input_ids: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] ids -> ([1, sum(lengths)] ids, [1, L] position ids restarting at 0 per row)."""
    ids = torch.cat([input_ids[b, :n] for b, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths])[None]
    return ids, pos


def block_causal_mask(lengths: list[int], device) -> torch.Tensor:
    """[1, 1, L, L] bool, True where a query may attend: same sequence and not in the future."""
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.tensor(lengths, device=device))
    L = seq.numel()
    causal = torch.ones((L, L), dtype=torch.bool, device=device).tril()
    return (causal & (seq[:, None] == seq[None, :]))[None, None]


def packed_logprobs(module, batch: TrainBatch, temperature: float, attn: str, device, chunk_tokens: int = 0,
                    with_entropy: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs (and entropy) of `batch` from one packed forward, as right-padded [B, W] (W = longest row).

    Same layout as the padded path: position t holds the logprob of token t, position 0 and padding are 0.
    sdpa gets an explicit block-diagonal causal mask (a 4D mask is used as given by transformers);
    varlen gets the sequences' boundaries (cu_seq_lens); flash_attention_2 derives them from the
    restarting position ids.
    """
    lengths = seq_lengths(batch)
    B, W = len(lengths), max(lengths, default=1)
    ids, pos = pack(batch.input_ids.to(device), lengths)
    kw = {"position_ids": pos, **attention_kwargs(lengths, attn, ids.device)}
    tok, ent = model_logprobs(module, ids, temperature, chunk_tokens, with_entropy, entropy_grad, **kw)
    # Packed position p predicts token p + 1; at each sequence's last token that is the next sequence's
    # first token, a meaningless value the scatter below leaves out.
    rows = torch.repeat_interleave(torch.arange(B, device=ids.device), torch.tensor(lengths, device=ids.device))
    keep = pos[0, :-1] < (torch.tensor(lengths, device=ids.device)[rows[:-1]] - 1)
    where = (rows[:-1][keep], pos[0, :-1][keep] + 1)

    def unpack(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros((B, W), dtype=v.dtype, device=ids.device).index_put(where, v[0][keep])
    return unpack(tok), (unpack(ent) if ent is not None else None)


def attention_kwargs(lengths: list[int], attn: str, device) -> dict:
    """What a packed row's forward needs to keep its sequences apart: sdpa an explicit block-diagonal causal mask
    (a 4D mask is used as given by transformers), varlen the sequences' boundaries (cu_seq_lens), flash_attention_2
    nothing (it derives them from the restarting position ids)."""
    if attn == varlen.NAME:
        return varlen.boundaries(lengths, device)
    if attn != "flash_attention_2":
        return {"attention_mask": block_causal_mask(lengths, device)}
    return {}


def packed_values(module, batch: TrainBatch, attn: str, device) -> torch.Tensor:
    """A value model's [B, W] values of `batch` from one packed forward (W = longest row), in the padded path's
    layout: `module(ids, position_ids=..., **attention)` returns [1, L] with position p holding the value read
    from the hidden state of p - 1 (critic.ValueModel); each sequence's position 0 (which would read the previous
    sequence's last token) and the padding are 0."""
    lengths = seq_lengths(batch)
    B, W = len(lengths), max(lengths, default=1)
    ids, pos = pack(batch.input_ids.to(device), lengths)
    v = module(ids, position_ids=pos, **attention_kwargs(lengths, attn, ids.device))
    rows = torch.repeat_interleave(torch.arange(B, device=ids.device), torch.tensor(lengths, device=ids.device))
    keep = pos[0] > 0
    return torch.zeros((B, W), dtype=v.dtype, device=ids.device).index_put((rows[keep], pos[0][keep]), v[0][keep])
