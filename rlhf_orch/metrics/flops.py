"""Model FLOPs of a training step and model FLOPs utilisation (MFU), for `train/mfu`.

The formula (the usual one of PaLM and Megatron-LM, per sequence of n real tokens):

    forward  = 2 * P * n  +  2 * layers * d_attn * n^2
    training = 3 * forward                  (backward costs twice the forward)

P counts the weights of every linear layer (the LM head included, embedding lookups excluded), so
2 * P * n is the matmul work; d_attn = heads * head_dim, and 2 * d_attn * n^2 per layer is QK^T plus
attention-times-V over the causal half. Only real tokens count: padding, recomputation under gradient
checkpointing, and the no-grad reference/old-policy forwards are not model FLOPs of the step, so a
padded micro-batch shows a lower MFU than a packed one doing the same useful work.

    MFU = training FLOPs of the step / (train seconds * the device's peak FLOP/s)

Peaks are dense (no sparsity) figures from the vendors' data sheets for the training dtype: bf16, or
fp32 without tensor cores. An unknown device (or CPU) has no peak unless `trainer.peak_tflops` gives
one; then MFU is not reported.
"""
from __future__ import annotations

import torch

# Dense peak TFLOP/s by device-name fragment (checked in this order): bf16, fp32.
_PEAKS = (
    ("H200", 989.4, 66.9),
    ("H100 PCIe", 756.0, 51.2),
    ("H100", 989.4, 66.9),
    ("H800", 989.4, 66.9),
    ("B200", 2250.0, 80.0),
    ("A100", 312.0, 19.5),
    ("A800", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("A10G", 70.0, 31.2),
)


def peak_flops(device_name: str, bf16: bool) -> float | None:
    """The device's dense peak FLOP/s for the training dtype, or None if it is not in the table."""
    for fragment, b, f in _PEAKS:
        if fragment in device_name:
            return (b if bf16 else f) * 1e12
    return None


def device_peak_flops(device: torch.device, bf16: bool, override_tflops: float = 0.0) -> float | None:
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), bf16)


class ModelFlops:
    """Training FLOPs of sequences for one causal LM, counted from its modules and config."""

    def __init__(self, module: torch.nn.Module):
        cfg = module.config
        self.params = 0
        for m in module.modules():
            if isinstance(m, torch.nn.Linear):
                # ZeRO-3 partitions weights in place; ds_numel keeps the full count.
                self.params += int(getattr(m.weight, "ds_numel", m.weight.numel()))
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.layers, self.d_attn = cfg.num_hidden_layers, heads * head_dim

    def forward(self, lengths: list[int]) -> float:
        n = sum(lengths)
        return 2.0 * self.params * n + 2.0 * self.layers * self.d_attn * sum(x * x for x in lengths)

    def training(self, lengths: list[int]) -> float:
        return 3.0 * self.forward(lengths)
