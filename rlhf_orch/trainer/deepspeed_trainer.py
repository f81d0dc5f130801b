"""One data-parallel rank of the policy trainer: a DeepSpeed engine over a Hugging Face causal LM.

It computes token logprobs, takes policy-gradient steps on the loss its `Algorithm` defines (with the
frozen reference's logprobs when the algorithm keeps KL in the loss), runs the optional supervised warm start, saves checkpoints, and yields `(hf_name,
full_tensor)` for weight sync, gathering ZeRO-3 partitions one bucket-sized group at a time. This is
one of the two modules that import DeepSpeed (critic.py, the value model, is the other; both take
their engine configuration from `ds_config` here). It knows nothing of Ray or of the engines: the actor shell
sets the rendezvous environment and calls these methods on every rank in lockstep.

Loss scaling: every rank divides its summed token loss by the *global* number of response tokens and
multiplies by the world size, because DeepSpeed averages gradients over ranks; the result equals the
token-mean over the whole batch however samples are split.

Token budgets (`max_tokens_per_micro_batch`): a rank's shard is cut into micro-batches by token count
(packing.micro_batch_plan) instead of by rows; with `packing` each micro-batch runs as one packed row
without padding (packing.packed_logprobs). Both leave the loss scaling above unchanged, so gradient
accumulation over micro-batches stays exact. `logprob_chunk_tokens` runs the LM head a chunk of positions
at a time (logprob.py) so the full-vocabulary logits of a micro-batch are never all in memory.

Throughput metrics per rank: tokens/s over the train loop, and MFU (metrics/flops.py: real tokens'
model FLOPs over the device's peak) where the device's peak is known.
"""
from __future__ import annotations

import gc
import logging
import os
import time
import warnings
from typing import Iterator

import torch

from rlhf_orch.algorithms import aggregate_token_loss, masked_mean
from rlhf_orch.algorithms.base import make_algorithm
from rlhf_orch.distributed import import_deepspeed, init_rank
from rlhf_orch.errors import TrainerError
from rlhf_orch.metrics.flops import ModelFlops, device_peak_flops
from rlhf_orch.trainer import packing as pk
from rlhf_orch.trainer.batch import trimmed
from rlhf_orch.trainer.export import ExportSpec, write_tokenizer_and_generation
from rlhf_orch.trainer.forward import Forward
from rlhf_orch.trainer.offload import Offloadable
from rlhf_orch.types import ParamSpec, TrainBatch, dtype_from_name
from rlhf_orch.weight_sync.buckets import plan_buckets

# DeepSpeed 0.19's ZeRO calls torch's deprecated all_gather_into_tensor at every step: a warning only its maintainers
# can act on, printed (with a stray `return func(*args, **kwargs)` line) into every run's output.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
logger = logging.getLogger(__name__)


def ds_config(world_size: int, zero_stage: int, lr: float, weight_decay: float, grad_clip: float, bf16: bool,
              manual_accumulation: bool) -> dict:
    """DeepSpeed's configuration for one of our engines (the policy's, the critic's)."""
    cfg = {
        # We hand each rank its whole shard per step, so DeepSpeed's batch arithmetic is nominal.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay,
                                                  "torch_adam": True}},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if manual_accumulation:
        # A rank's shard splits into however many micro-batches it needs (shards differ by a row), so
        # DeepSpeed must not count micro-steps: backward() only accumulates, step() reduces and updates.
        cfg["managed_gradient_accumulation"] = False
    return cfg


def _combine(parts: list[dict[str, float]]) -> dict[str, float]:
    """Micro-batch metrics -> one step's: losses add up (each is already over the global token count),
    maxima take the max, the rest are token-weighted means."""
    tokens = sum(p["_tokens"] for p in parts) or 1.0
    out = {}
    for key in parts[0]:
        if key == "_tokens":
            continue
        vals = [p[key] for p in parts]
        if key == "loss":
            out[key] = sum(vals)
        elif key.endswith("_max"):
            out[key] = max(vals)
        else:
            out[key] = sum(v * p["_tokens"] for v, p in zip(vals, parts)) / tokens
    return out


class DeepSpeedTrainer(Forward, Offloadable):
    def __init__(self, model_path: str, rank: int, world_size: int, *, device: str = "cpu", zero_stage: int = 2,
                 lr: float = 1e-3, weight_decay: float = 0.0, grad_clip: float = 1.0, bf16: bool = False,
                 algorithm: dict | None = None, temperature: float = 1.0, ppo_epochs: int = 1, seed: int = 0,
                 micro_batch_size: int = 0, gradient_checkpointing: bool = False, max_tokens_per_micro_batch: int = 0,
                 packing: bool = False, attn: str = "auto", logprob_chunk_tokens: int = 0, peak_tflops: float = 0.0):
        deepspeed = import_deepspeed()   # here, not `import deepspeed`: the first import of DeepSpeed leaves out mlflow
        from transformers import AutoModelForCausalLM

        self.rank, self.world_size = rank, world_size
        self.zero_stage = zero_stage
        self.algo = make_algorithm(algorithm or {})   # the algorithm section (its defaults when not given)
        self.kl_coef = self.algo.kl_coef
        self.temperature, self.ppo_epochs = temperature, ppo_epochs
        self.micro_batch_size = micro_batch_size
        self.budget, self.packing = max_tokens_per_micro_batch, packing
        self.chunk = logprob_chunk_tokens
        if packing and not self.budget:
            raise TrainerError("trainer.packing needs trainer.max_tokens_per_micro_batch > 0")
        # Resolved only when packing: the default load (and so the off path) stays exactly as before.
        self.attn = pk.resolve_attn(attn, device) if packing else None
        torch.manual_seed(seed)
        # Our own store (bound to MASTER_ADDR only, see rlhf_orch/distributed.py); DeepSpeed adopts the group.
        self.device = init_rank(rank, world_size, device)
        config = ds_config(world_size, zero_stage, lr, weight_decay, grad_clip, bf16, bool(micro_batch_size or self.budget))
        try:
            extra = {"attn_implementation": self.attn} if self.attn else {}
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **extra)
            if gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                        config=config)
        except Exception as e:
            raise TrainerError(f"trainer rank {rank}: DeepSpeed initialisation failed: {type(e).__name__}: {e}") from e
        self.flops = ModelFlops(self.engine.module)
        self.peak = device_peak_flops(self.device, bf16, peak_tflops)
        self.ref_model = None
        self._ref_host: list[torch.Tensor] | None = None   # pinned copy of the frozen reference (CUDA)
        self.steps = 0
        self.offloaded = False
        # DeepSpeed's offload_states runs gc.collect(); over the ~10^6 objects torch, transformers and
        # DeepSpeed leave after start-up that costs ~0.3-0.7 s per step. Frozen objects are skipped.
        gc.freeze()

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] logprobs of `batch` under the current policy (no grad), on CPU."""
        self._need_states("logprobs")
        self.engine.module.eval()
        return self._shard_logprobs(self.engine.module, batch).cpu()

    @torch.no_grad()
    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] logprobs of `batch` under the frozen reference, on CPU (KL in the reward): the separate reference
        group's, when the batch carries them."""
        if batch.ref_logprobs is not None:
            return batch.ref_logprobs.cpu()
        self._need_states("reference logprobs")
        return self._shard_logprobs(self.ref_model, batch).cpu()

    def snapshot_reference(self, path: str | None = None, reuse: bool = False, keep: bool = True) -> None:
        """Freeze the KL reference: the policy as RL starts (call on every rank together). Built from the
        gathered weights, so it works for every ZeRO stage; a full copy per rank, fine for models that fit
        one device (a separate reference group is the plan for larger ones). With `path`, rank 0 saves it
        there; a resumed run (`reuse`) loads it back instead of freezing the resumed policy, and a fresh
        run in the same folder overwrites it. `keep=False` (reference.placement: separate): only write the
        snapshot to `path` for the reference group; this rank holds no copy."""
        if "reference" not in self.algo.roles:
            return
        if not keep and reuse and path and os.path.exists(path):
            return          # the resumed run's reference is already there for the group to load
        if not keep and self.rank != 0:
            for _ in self.iter_named_tensors(self._gather_groups(256 << 20)):
                pass        # the gather is collective (ZeRO-3); only rank 0 writes the snapshot
            return
        from transformers import AutoModelForCausalLM
        ref = AutoModelForCausalLM.from_config(self.engine.module.config, dtype=torch.float32)
        params = dict(ref.named_parameters())
        with torch.no_grad():
            if reuse and path and os.path.exists(path):
                ref.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            else:
                for name, t in self.iter_named_tensors(self._gather_groups(256 << 20)):
                    params[name].copy_(t)
                if path and self.rank == 0:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    torch.save(ref.state_dict(), path + ".tmp")
                    os.replace(path + ".tmp", path)
        if not keep:
            return
        self.ref_model = ref.to(self.device).eval().requires_grad_(False)
        self._ref_host = None
        if self.device.type == "cuda":
            # Frozen, so one pinned host copy serves every offload: offloading only frees the GPU copy and
            # reloading is one fast host-to-device copy (moving 4 GiB to pageable memory took ~2 s per step).
            self._ref_host = [torch.empty_like(t, device="cpu").pin_memory().copy_(t) for t in self._ref_tensors()]

    # ---- steps ------------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch, num_tokens_global: float) -> dict[str, float]:
        """`ppo_epochs` optimizer steps on this rank's shard; returns flat `train/` metrics (this rank)."""
        self._need_states("train_step")
        mask = batch.response_mask.to(self.device)
        adv = batch.advantages.to(self.device)
        ref = None
        if self.kl_coef > 0 and batch.ref_logprobs is not None:   # from the separate reference group
            ref = batch.ref_logprobs.to(self.device)
        elif self.kl_coef > 0:
            if self.ref_model is None:
                raise TrainerError(f"trainer rank {self.rank}: algorithm.kl_coef > 0 but no KL reference was taken; "
                                   "call snapshot_reference() before the first train step")
            with torch.no_grad():
                ref = self._shard_logprobs(self.ref_model, batch)
        if self.ppo_epochs > 1 and batch.old_logprobs is None:
            batch.old_logprobs = self.logprobs(batch)   # every epoch clips against the policy before the update
        old = batch.old_logprobs.to(self.device) if batch.old_logprobs is not None else None
        eng = batch.engine_logprobs.to(self.device)
        metrics: dict[str, float] = {}
        self.engine.module.train()
        start = time.perf_counter()
        num_seqs = self._global_seqs(batch) if self.algo.needs_seq_count else None
        computed = real = flops = 0.0   # positions the forwards computed, the real tokens among them, model FLOPs
        n_micro = 0
        for epoch in range(self.ppo_epochs):
            parts: list[dict[str, float]] = []
            first_old = torch.zeros_like(mask) if old is None else None
            for rows in self._micro_batches(batch):
                # Micro-batches drop the right padding beyond their own longest row (a long-tailed batch is
                # mostly padding otherwise); the whole-shard path keeps the batch's width, as before.
                if self.micro_batch_size or self.budget:
                    mb, width = trimmed(batch, rows)
                else:
                    mb, width = batch.select(rows), max(batch.input_ids.shape[1], 1)
                cols = slice(0, width)
                mmask = mask[rows, cols]
                madv = adv[rows] if adv.dim() == 1 else adv[rows, cols]   # per sequence, or per token (critic-based)
                lp, ent = self._mb_logprobs(self.engine.module, mb, True, bool(self.algo.entropy_coeff))
                flops += self.flops.training(pk.seq_lengths(mb))
                mb_real = float(mb.attention_mask.sum())
                real += mb_real
                computed += mb_real if self.packing else float(mb.input_ids.numel())
                n_micro += 1
                if old is None:
                    old_mb = lp.detach()   # on-policy first pass: ratio is exactly 1 (saves a forward)
                    first_old[rows, cols] = old_mb
                else:
                    old_mb = old[rows, cols]
                # old = the trainer's policy before the update (proximal), engine = the behaviour policy
                per_tok, m = self.algo.policy_loss(lp, old_mb, eng[rows, cols], madv, mmask,
                                                   ref[rows, cols] if ref is not None else None)
                m["entropy"] = float(masked_mean(ent.detach(), mmask))
                # Each micro-batch's token sum over the *global* token count: summing them is the token mean.
                loss = self.algo.aggregate(per_tok, mmask, ent, num_tokens_global, num_seqs) * self.world_size
                self.engine.backward(loss, scale_wrt_gas=False)
                if not (self.micro_batch_size or self.budget):
                    self.engine.step()
                # loss = local sum / global tokens * world; the group averages ranks, giving the global mean
                m["loss"] = float(loss.detach())
                m["_tokens"] = float(mmask.sum())
                parts.append(m)
            if self.micro_batch_size or self.budget:
                self.engine.step()
            if old is None:
                old = first_old
            gn = self.engine.get_global_grad_norm()
            metrics = _combine(parts)
            metrics["grad_norm"] = float(gn) if gn is not None else float("nan")
        diff = (old - eng).abs() * mask
        metrics["logprob_diff_sum"] = float(diff.sum())
        metrics["logprob_diff_max"] = float(diff.max()) if diff.numel() else 0.0
        metrics["tokens"] = float(mask.sum())
        metrics["padding_frac"] = (computed - real) / computed if computed else 0.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # the clock below must see the GPU's work done
        train_s = max(time.perf_counter() - start, 1e-9)
        metrics["tokens_per_s"] = real / train_s
        if self.peak:
            metrics["mfu"] = flops / train_s / self.peak
        metrics["micro_batches"] = n_micro / self.ppo_epochs
        # This rank's prompt + response tokens; actors/trainer.py turns the ranks' values into rank_imbalance.
        metrics["seq_tokens"] = float(batch.attention_mask.sum())
        # This rank's model FLOPs and seconds: the ranks wait for each other in the collectives, so their seconds
        # come out alike; the FLOPs say how unequal the work was (actors/trainer.py: rank_flops_imbalance).
        metrics["flops"] = float(flops)
        metrics["time_s"] = train_s
        self.steps += 1
        return {f"train/{k}": v for k, v in metrics.items()}

    def _global_seqs(self, batch: TrainBatch) -> float:
        """Sequences with a response token in the whole step (all ranks), for the seq-mean loss modes."""
        import torch.distributed as dist
        n = torch.tensor([float((batch.response_mask.sum(1) > 0).sum())], device=self.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(n)
        return float(n)

    def sft_step(self, batch: TrainBatch, num_tokens_global: float) -> dict[str, float]:
        """One supervised step (negative log-likelihood of the response tokens)."""
        self._need_states("sft_step")
        mask = batch.response_mask.to(self.device)
        self.engine.module.train()
        if not self.budget:   # the whole shard at once, as before token budgets
            lp = self._logprobs(self.engine.module, batch)[0]
            loss = aggregate_token_loss(-lp, mask, num_tokens_global) * self.world_size
            self.engine.backward(loss)
            self.engine.step()
            return {"warm_start/loss": float(loss.detach())}   # averaged over ranks: the global token mean
        total = 0.0   # token-budget micro-batches as in train_step (packed or not): the same exact accumulation
        for rows in self._micro_batches(batch):
            mb, width = trimmed(batch, rows)
            lp = self._mb_logprobs(self.engine.module, mb)[0]
            loss = aggregate_token_loss(-lp, mask[rows, :width], num_tokens_global) * self.world_size
            self.engine.backward(loss, scale_wrt_gas=False)
            total += float(loss.detach())
        self.engine.step()
        return {"warm_start/loss": total}

    # ---- colocation (offload.Offloadable moves the engine's states; the frozen reference moves with them) ------
    def _before_offload(self) -> None:
        if self._ref_host is not None:
            for t in self._ref_tensors():
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    def _after_reload(self) -> None:
        if self._ref_host is not None:
            for t, host in zip(self._ref_tensors(), self._ref_host):
                t.data = host.to(self.device, non_blocking=True)
            torch.cuda.synchronize(self.device)

    def _ref_tensors(self) -> list[torch.Tensor]:
        return [*self.ref_model.parameters(), *self.ref_model.buffers()]

    # ---- weight sync ------------------------------------------------------------------------------
    def _named(self):
        return list(self.engine.module.named_parameters())

    def param_specs(self, dtype: str) -> list[ParamSpec]:
        """HF names, the sync dtype and full shapes (ZeRO-3 shapes come from ds_shape)."""
        dtype_from_name(dtype)
        out = []
        for name, p in self._named():
            shape = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
            out.append(ParamSpec(name, dtype, shape))
        return out

    def iter_named_tensors(self, groups: list[list[str]] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors in `named_parameters()` order. Under ZeRO-3 each of `groups` (consecutive names;
        the sync passes its bucket layout) is gathered together and stays valid until the first tensor of
        the next group is requested. Every rank must iterate to the end together: gathers are collectives."""
        self._need_states("weight sync")
        named = self._named()
        if self.zero_stage != 3:
            for name, p in named:
                yield name, p.data
            return
        deepspeed = import_deepspeed()

        if groups is None:
            groups = [[n for n, _ in named]]
        params = dict(named)
        for group in groups:
            ps = [params[n] for n in group]
            with deepspeed.zero.GatheredParameters(ps, modifier_rank=None):
                for n, p in zip(group, ps):
                    yield n, p.data
                if self.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()   # copies done before the partitions are freed

    def _gather_groups(self, nbytes: int) -> list[list[str]]:
        """Consecutive names in groups of about `nbytes` (for gathers outside a sync): the sync's own
        bucket planner, so both gather the same way."""
        return [layout.names for layout in plan_buckets(self.param_specs("float32"), nbytes)]

    def device_id(self) -> str:
        if self.device.type == "cuda":
            return f"gpu-{torch.cuda.get_device_properties(self.device).uuid}"
        return ""

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, directory: str, tag: str, client_state: dict | None = None) -> str:
        with self._states_loaded():
            return self._save_checkpoint(directory, tag, client_state)

    def _save_checkpoint(self, directory: str, tag: str, client_state: dict | None) -> str:
        state = dict(client_state or {}, torch_rng=torch.get_rng_state(), train_steps=self.steps)
        if self.algo.kl_ctrl is not None:
            state["kl_ctrl_value"] = self.algo.kl_ctrl.value   # an adaptive controller's state: exact resume
        self.engine.save_checkpoint(directory, tag=tag, client_state=state, save_latest=False)   # checkpoint.py owns `latest`
        return os.path.join(directory, tag)

    def load_checkpoint(self, directory: str, tag: str) -> dict:
        """Model, optimizer and this rank's RNG from a DeepSpeed checkpoint; returns its client state."""
        path, client = self.engine.load_checkpoint(directory, tag=tag, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        if path is None:
            raise TrainerError(f"trainer rank {self.rank}: no DeepSpeed checkpoint {tag!r} in {directory}")
        if "torch_rng" in client:
            torch.set_rng_state(client["torch_rng"])
        if self.algo.kl_ctrl is not None and "kl_ctrl_value" in client:
            self.algo.kl_ctrl.value = float(client["kl_ctrl_value"])
        self.steps = int(client.get("train_steps", 0))
        return {k: v for k, v in client.items() if k != "torch_rng"}

    def export_hf(self, directory: str, spec=None) -> None:
        """Rank 0 writes a loadable HF folder of the current policy into `directory` (inside the checkpoint's
        staging folder, so it appears only when the checkpoint is committed): safetensors weights, config.json,
        the run's tokenizer and chat template and generation_config.json (trainer/export.py; `spec`: an
        ExportSpec, default: the tokenizer of the model folder this trainer loaded, sampling at temperature 1).
        Every rank must call it: ZeRO-3 gathers are collectives. Only the policy is exported, never the critic."""
        with self._states_loaded():
            self._export_hf(directory, spec)

    def _export_hf(self, directory: str, spec) -> None:
        if self.zero_stage == 3:   # every rank joins each gather; only rank 0 keeps a host copy
            state = {n: t.detach().cpu().clone() if self.rank == 0 else None
                     for n, t in self.iter_named_tensors(self._gather_groups(1 << 30))}
        elif self.rank == 0:
            state = {n: p.detach().cpu().clone() for n, p in self._named()}
        if self.rank != 0:
            return
        module = self.engine.module
        module.save_pretrained(directory, state_dict=state)
        write_tokenizer_and_generation(directory, module, spec or ExportSpec())

