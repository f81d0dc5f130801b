"""Variable-length attention for packed micro-batches, registered with transformers as `rlhf_varlen`.

A packed micro-batch is one row of several sequences. With `trainer.attn: varlen` the model's attention
layers get the sequences' boundaries (`cu_seq_lens_q`, `max_length_q`: the keyword arguments transformers
already forwards to attention for flash-attn) and attend within each sequence only, causally:

- CUDA: PyTorch's own flash kernel, `torch.nn.attention.varlen.varlen_attn` (no flash-attn package
  needed). Its work is the sum of the sequences' squares, not the square of the packed row.
- CPU, float32 on CUDA (the kernel takes half precision only), or a torch without the kernel: one
  `scaled_dot_product_attention(is_causal=True)` per sequence; no [L, L] mask is built.

A call without boundaries (a right-padded batch: the supervised warm start) runs causal SDPA over whole
rows with no padding mask. That is exact for the real tokens, because right padding only follows them and
causal attention never looks ahead; the padded positions' outputs are garbage the loss masks out. So
`rlhf_varlen` registers no mask builder: transformers then builds no [L, L] mask at all.

It does not pack (packing.py does) and does not choose the implementation (packing.resolve_attn does).
"""
from __future__ import annotations

import inspect
import logging

import torch

from rlhf_orch.errors import TrainerError

logger = logging.getLogger(__name__)

NAME = "rlhf_varlen"
_registered = False


def torch_varlen_available() -> bool:
    """Whether this torch has the flash varlen kernel and a GPU to run it (torch >= 2.9 with CUDA)."""
    try:
        from torch.nn.attention import varlen   # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _flash(q, k, v, cu, max_len: int, scale):
    """[T, H, D] q and [T, Hkv, D] k/v through torch's varlen flash kernel, causal within each sequence."""
    from torch.nn.attention.varlen import varlen_attn
    params = inspect.signature(varlen_attn).parameters
    kw = {"scale": scale}
    if "window_size" in params:          # torch >= 2.11: (-1, 0) is causal
        kw["window_size"] = (-1, 0)
    else:                                # torch 2.9/2.10
        kw["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def _sdpa_loop(q, k, v, cu, scale):
    """The same result on any device: causal SDPA per sequence ([T, H, D] in and out)."""
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs = q[s:e].transpose(0, 1)[None]                      # [1, H, n, D]
        ks = k[s:e].transpose(0, 1)[None]
        vs = v[s:e].transpose(0, 1)[None]
        if rep > 1:
            ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        out[s:e] = o[0].transpose(0, 1)
    return out


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:   # right-padded rows (see the module docstring)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=True)
    if query.shape[0] != 1:
        raise TrainerError("trainer.attn varlen: packed-sequence boundaries came with a batch of several rows; "
                           "a packed micro-batch is one row")
    if dropout:
        raise TrainerError("trainer.attn varlen: attention dropout is not supported; set the model's attention_dropout to 0")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))   # [T, H, D]
    # The flash kernel takes half precision only; a float32 model on CUDA (the frozen KL reference is kept in
    # float32) goes through the per-sequence SDPA loop, which gives the same result.
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and torch_varlen_available():
        out = _flash(q.contiguous(), k.contiguous(), v.contiguous(), cu.to(torch.int32), int(kwargs["max_length_q"]), scaling)
    else:
        out = _sdpa_loop(q, k, v, cu, scaling)
    return out[None], None


def register() -> str:
    """Make `rlhf_varlen` a known attn_implementation in this process (idempotent); returns the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        AttentionInterface.register(NAME, varlen_attention_forward)
        _registered = True
    return NAME


def boundaries(lengths: list[int], device) -> dict:
    """The keyword arguments a packed forward passes to reach varlen attention."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(lengths, device=device), 0)
    m = max(lengths, default=1)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": m, "max_length_k": m}
