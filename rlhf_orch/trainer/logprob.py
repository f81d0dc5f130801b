"""Per-token logprobs (and entropy) of a causal LM, with or without the full-vocabulary logits in memory.

`model_logprobs(module, ids, temperature, chunk_tokens)` returns the logprob of each next token, [B, L-1]:

- `chunk_tokens == 0`: the model's own forward gives [B, L, V] logits, log-softmaxed and gathered: the
  trainer's original path, kept op for op (a run with chunking off reproduces earlier numbers exactly).
- `chunk_tokens > 0`: the decoder gives hidden states; the LM head, log-softmax and gather run on
  `chunk_tokens` positions at a time under activation checkpointing, so forward and backward hold the
  logits of one chunk only. With a 152k vocabulary, full fp32 logits cost 0.6 MB per token (a 16k-token
  micro-batch: ~10 GB, twice over with the log-softmax); chunked they cost chunk_tokens x V x 4 bytes.
  The values are the same ops on the same rows, so they equal the full path's up to matmul rounding.

Entropy (`with_entropy`) is computed from the same logits (inside the chunk), without a gradient for the
`train/entropy` metric, or with one (`entropy_grad`) when the loss has an entropy bonus. It handles plain LM heads only: a model with logit soft-capping or a logit scale is refused for
chunking (its head is more than a linear layer).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from rlhf_orch.errors import TrainerError

_ENTROPY_ROWS = 4096   # rows per no-grad entropy piece on the full path: bounds its extra memory


def _entropy(logp: torch.Tensor, grad: bool = False) -> torch.Tensor:
    """-(p * log p).sum over the vocabulary: with `grad` as one differentiable op (an entropy bonus), else
    without a gradient in row pieces (a metric)."""
    if grad:
        return -(logp.exp() * logp).sum(-1)
    with torch.no_grad():
        flat = logp.detach().reshape(-1, logp.shape[-1])
        out = torch.cat([-(p.exp() * p).sum(-1) for p in flat.split(_ENTROPY_ROWS)]) if flat.numel() else flat.sum(-1)
        return out.reshape(logp.shape[:-1])


def _head_chunk(hidden: torch.Tensor, targets: torch.Tensor, head, temperature: float, with_entropy: bool,
                entropy_grad: bool = False):
    logits = head(hidden).float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    tok = logp.gather(-1, targets[:, None]).squeeze(-1)
    return tok, (_entropy(logp, entropy_grad) if with_entropy else tok.new_zeros(()))


def _check_plain_head(module) -> None:
    cfg = module.config
    cap = getattr(cfg, "final_logit_softcapping", None)
    scale = getattr(cfg, "logit_scale", None)
    if cap or (scale not in (None, 1, 1.0)):
        raise TrainerError(f"trainer.logprob_chunk_tokens: {type(module).__name__} post-processes its logits "
                           "(soft-capping or a logit scale), which the chunked path does not reproduce; set it to 0")


def model_logprobs(module, input_ids: torch.Tensor, temperature: float, chunk_tokens: int = 0,
                   with_entropy: bool = False, entropy_grad: bool = False,
                   **model_kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([B, L-1] logprob of token t+1 at position t, entropy of that distribution or None; the entropy
    carries a gradient only with `entropy_grad`, for an entropy bonus in the loss)."""
    targets = input_ids[:, 1:]
    if not chunk_tokens:
        logits = module(input_ids=input_ids, use_cache=False, **model_kwargs).logits[:, :-1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        tok = logp.gather(-1, targets[..., None]).squeeze(-1)
        return tok, (_entropy(logp, entropy_grad) if with_entropy else None)
    _check_plain_head(module)
    hidden = module.get_decoder()(input_ids=input_ids, use_cache=False, **model_kwargs).last_hidden_state[:, :-1]
    B, W, H = hidden.shape
    head = module.get_output_embeddings()
    flat, tflat = hidden.reshape(B * W, H), targets.reshape(B * W)
    toks, ents = [], []
    for s in range(0, B * W, chunk_tokens):
        args = (flat[s:s + chunk_tokens], tflat[s:s + chunk_tokens], head, temperature, with_entropy, entropy_grad)
        # With a gradient, backward recomputes this chunk's logits instead of keeping them.
        tok, ent = checkpoint(_head_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else _head_chunk(*args)
        toks.append(tok)
        ents.append(ent)
    tok = torch.cat(toks).reshape(B, W) if toks else flat.new_zeros((B, W), dtype=torch.float32)
    ent = (torch.cat(ents).reshape(B, W) if ents else tok.new_zeros((B, W))) if with_entropy else None
    return tok, ent
