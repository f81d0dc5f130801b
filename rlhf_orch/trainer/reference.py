"""The frozen KL reference on a device of its own (`reference.placement: separate`): forward only, logprobs.

By default the reference lives inside every policy rank (DeepSpeedTrainer.snapshot_reference: a second full copy
of the model on the policy's device). A model too big to hold twice on one device gets a separate reference group
instead: the policy ranks save the snapshot once (rank 0, `reference.pt` in the checkpoint folder, as they do
anyway) and keep no copy; each `FrozenReference` loads it on its own device and returns the [B, T] logprobs of the
shards it is given, which the driver hands to the policy ranks beside their batches (TrainBatch.ref_logprobs).

It runs the policy's own forward code (forward.Forward: the same padded, token-budget or packed micro-batches,
logprob chunking and temperature) on the same float32 weights, so the logprobs equal the colocated reference's:
a run with either placement trains the same. Each worker holds a whole copy (data parallel over shards, no
ZeRO-3 partitioning: a model that does not fit one device whole is not served yet). No Ray: actors/roles.py.
"""
from __future__ import annotations

import logging
import os

import torch

from rlhf_orch.errors import TrainerError
from rlhf_orch.trainer import packing as pk
from rlhf_orch.trainer.forward import Forward
from rlhf_orch.types import TrainBatch

logger = logging.getLogger(__name__)


class FrozenReference(Forward):
    def __init__(self, model_path: str, state_path: str, *, device: str = "cpu", temperature: float = 1.0,
                 micro_batch_size: int = 0, max_tokens_per_micro_batch: int = 0, packing: bool = False,
                 attn: str = "auto", logprob_chunk_tokens: int = 0):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.temperature, self.micro_batch_size = temperature, micro_batch_size
        self.budget, self.packing, self.chunk = max_tokens_per_micro_batch, packing, logprob_chunk_tokens
        self.attn = pk.resolve_attn(attn, device) if packing else None   # as the policy resolves it
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if not os.path.exists(state_path):
            raise TrainerError(f"reference: no snapshot at {state_path}; the policy ranks write it when RL starts "
                               "(snapshot_reference) and must run before the reference group loads")
        extra = {"attn_implementation": self.attn} if self.attn else {}
        # Built from the config and filled, as the policy's own snapshot is: freshly allocated weights, where
        # from_pretrained's may keep the file's alignment, and CPU matmul kernels (chunked logprobs) can round
        # differently on differently aligned operands.
        config = AutoConfig.from_pretrained(model_path, **extra)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra)
        model.load_state_dict(torch.load(state_path, map_location="cpu", weights_only=True))
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.state_path = state_path
        logger.info("frozen reference loaded from %s on %s", state_path, self.device)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] logprobs of `batch` under the frozen reference, on CPU (0 at position 0 and on padding)."""
        return self._shard_logprobs(self.model, batch).cpu()

    def device_id(self) -> str:
        if self.device.type == "cuda":
            return "gpu-" + str(torch.cuda.get_device_properties(self.device).uuid)
        return "cpu"
