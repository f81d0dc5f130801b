"""The vLLM 0.26.0 rollout engine: an in-process `vllm.LLM` behind the RolloutEngine Protocol.

Generation is one `LLM.generate` call over token-id prompts with `logprobs=0` (the sampled token's
logprob only) and `logprobs_mode="processed_logprobs"`, so each logprob is log_softmax of the logits
after temperature (and after top-k/top-p masking; with top_p=1 that is exactly log_softmax(logits / T),
the quantity the trainer computes). Weight sync runs inside vLLM's workers through
`rlhf_orch.engines.vllm_worker.WeightSyncWorkerExtension`: this class only forwards setup/receive
calls with `collective_rpc` and reconciles the per-worker answers (TP workers must agree).

It does not put the engine to sleep on `pause()`: `sleep(level)` / `wake_up(tags)` are separate so the
colocation logic decides when to free memory. It does not support quantized models, pipeline
parallelism or data parallelism. API references: docs/vllm_api_notes.md.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import torch

from rlhf_orch.engines.base import WAKE_TAGS, Capabilities, EngineLifecycle, per_prompt_params
from rlhf_orch.engines.vllm_worker import pack_arg
from rlhf_orch.errors import EngineError
from rlhf_orch.types import Sample

logger = logging.getLogger(__name__)

EXTENSION = "rlhf_orch.engines.vllm_worker.WeightSyncWorkerExtension"


def multicast_free(tensor_parallel_size: int) -> dict[str, Any]:
    """LLM options that keep a tensor-parallel engine off NVLink multicast where the environment turned it off.

    With CUDA graphs on, vLLM 0.26.0 fuses all-reduce with RMSNorm through FlashInfer and picks its "mnnvl"
    backend (flashinfer_all_reduce.py:97-121), which builds NVSwitch multicast memory. NCCL_NVLS_ENABLE=0 is the
    documented way a cluster says multicast is off, and there the fused kernel failed at graph capture with an
    illegal memory access (TP=2 on 4x H200, 2026-11-27). So there the fusion is off; elsewhere vLLM decides."""
    if tensor_parallel_size > 1 and os.environ.get("NCCL_NVLS_ENABLE") == "0":
        return {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}
    return {}


class VLLMEngine(EngineLifecycle):
    checksums_mode = "received"   # checksums describe received tensors (see vllm_worker.py)
    # Its workers run the receivers, which verify what they load (a sync is one call over either transport) and
    # poll the rollout actor's abort flag (weight_sync/abort.py).
    capabilities = Capabilities(own_receivers=True, aborts_syncs=True)

    def __init__(self, name: str, model_path: str, device: str = "cuda", device_id: str = "",
                 dtype: str = "bfloat16", seed: int = 0, gpu_memory_utilization: float = 0.5,
                 enable_sleep_mode: bool = True, enforce_eager: bool = False, tensor_parallel_size: int = 1,
                 max_model_len: int | None = None, load_format: str = "auto", kv_cache_memory_gb: float | None = None,
                 max_num_seqs: int | None = None, streaming: bool = False, **_ignored: Any):
        if _ignored:
            logger.debug("engine %s: ignoring options %s", name, sorted(_ignored))
        self.name = name
        self.weight_version = -1          # nothing synced yet: the first sync makes it 0
        self.enable_sleep_mode = enable_sleep_mode
        self.tensor_parallel_size = tensor_parallel_size
        self._placement_id = device_id
        self._init_lifecycle()
        self._ids: list[str] | None = None
        extra: dict[str, Any] = {}
        if kv_cache_memory_gb:
            # A fixed KV size instead of a share of the GPU: room for a colocated trainer. (It also bounds the
            # block count that reset_prefix_cache walks in Python, block_pool.py:784: ~140 ms for a tiny model
            # given half an H200; only the streaming engine still resets per sync, see finish_sync.)
            extra["kv_cache_memory_bytes"] = int(kv_cache_memory_gb * 2**30)
        if max_num_seqs:
            extra["max_num_seqs"] = max_num_seqs
        if tensor_parallel_size > 1:
            # Inside a Ray actor in a placement group vLLM would pick its Ray executor (config/parallel.py:915)
            # and place workers itself; the actor already holds its TP GPUs, so workers are its subprocesses.
            extra["distributed_executor_backend"] = "mp"
            extra.update(multicast_free(tensor_parallel_size))
        try:
            self.llm = self._start_llm(model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                                       gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                                       enforce_eager=enforce_eager, seed=seed, max_model_len=max_model_len,
                                       load_format=load_format, worker_extension_cls=EXTENSION,
                                       logprobs_mode="processed_logprobs", **extra)
        except Exception as e:
            raise EngineError(f"engine {name}: vLLM failed to start from {model_path!r}: {type(e).__name__}: {e}") from e
        logger.info("engine %s: vLLM up (tp=%d, dtype=%s, sleep_mode=%s)", name, tensor_parallel_size, dtype,
                    enable_sleep_mode)

    def _start_llm(self, model_path: str, **kw):
        try:
            from vllm import LLM
        except ImportError as e:
            raise EngineError(f"engine {self.name}: vLLM is not installed (pip install 'rlhf_orch[vllm]'): {e}") from e
        return LLM(model=model_path, **kw)

    # ---- helpers ----------------------------------------------------------------------------------
    def _rpc(self, method: str, *args) -> list:
        try:
            return self.llm.collective_rpc(method, args=args)
        except Exception as e:
            raise EngineError(f"engine {self.name}: {method} failed in a vLLM worker: {e}") from e

    def _agree(self, method: str, results: list) -> Any:
        """Every TP worker received the same full tensors, so their answers must be equal."""
        first = results[0]
        for rank, other in enumerate(results[1:], start=1):
            if other != first:
                raise EngineError(f"engine {self.name}: {method}: worker {rank} disagrees with worker 0")
        return first

    def device_ids(self) -> list[str]:
        if self._ids is None:
            self._ids = [str(x) for x in self._rpc("rlhf_device_id")]
        return list(self._ids)

    # ---- generation -------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params) -> list[Sample]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        self._check_can_generate()
        if not prompts:
            return []
        prompt_ids = [[int(t) for t in p] for p in prompts]
        each = per_prompt_params(params, len(prompt_ids))
        try:   # one vLLM SamplingParams per distinct setting (rows may bound their own length)
            made = {p: VSamplingParams(n=p.n, temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_new_tokens,
                                       logprobs=0, seed=p.seed, detokenize=True, ignore_eos=p.ignore_eos)
                    for p in set(each)}
            sp = [made[p] for p in each]
        except Exception as e:   # e.g. vLLM allows temperature in [0, 2] only
            raise EngineError(f"engine {self.name}: sampling parameters rejected by vLLM: {e}") from e
        with self._lock:
            try:
                # The salt keys the prefix cache by weight version: blocks computed with older weights never match
                # again, so a sync needs no prefix-cache reset (which walks every KV block in Python, ~20 ms for a
                # tiny model's 2 GiB cache). The same prompt shares its blocks within a version, as before.
                salt = f"rlhf-v{self.weight_version}"
                outs = self.llm.generate([TokensPrompt(prompt_token_ids=p, cache_salt=salt) for p in prompt_ids], sp,
                                         use_tqdm=False)
            except Exception as e:
                raise EngineError(f"engine {self.name}: generate failed: {type(e).__name__}: {e}") from e
        if len(outs) != len(prompt_ids):
            raise EngineError(f"engine {self.name}: vLLM returned {len(outs)} outputs for {len(prompt_ids)} prompts")
        samples: list[Sample] = []
        for i, (p, out) in enumerate(zip(prompt_ids, outs)):
            for c in sorted(out.outputs, key=lambda c: c.index):
                samples.append(self._sample(i, p, c))
        return samples

    def _sample(self, prompt_index: int, prompt: list[int], c) -> Sample:
        reason = c.finish_reason
        if reason not in ("stop", "length"):
            raise EngineError(f"engine {self.name}: a request finished with {reason!r} (stop_reason={c.stop_reason!r})")
        resp = [int(t) for t in c.token_ids]
        if c.logprobs is None or len(c.logprobs) != len(resp):
            raise EngineError(f"engine {self.name}: vLLM returned no per-token logprobs for a completion")
        # Each position is {token_id: Logprob}; with logprobs=0 it holds the sampled token (v1/engine/logprobs.py:107).
        lps = [float(pos[tok].logprob) for tok, pos in zip(resp, c.logprobs)]
        return Sample(prompt_index=prompt_index, prompt_ids=prompt, response_ids=resp, logprobs=lps,
                      finish_reason=reason, weight_version=self.weight_version, engine=self.name, text=c.text)

    # ---- weight sync (the actor shell forwards these; receivers live in the vLLM workers) ----------
    def setup_receiver(self, layouts, transport: str, spec: dict, verify: bool, timeout_s: float,
                       replay: bool = True, abort_flag: str | None = None) -> float:
        """Build a receiver in every worker and open its side of `transport` (weight_sync/transport.py; worker k of a
        group member takes the spec's rank + k). Returns seconds. `replay`: load by replaying the recorded copies
        after the first sync (vllm_worker.py). `abort_flag`: the actor's flag (its file path), which every worker maps
        so that an aborted sync ends there at once."""
        self._need_weights_awake("setup_receiver")
        secs = self._rpc("rlhf_setup_receiver", pack_arg(list(layouts)), str(transport), dict(spec), bool(verify),
                         float(timeout_s), bool(replay), abort_flag)
        return max(float(s) for s in secs)

    def connect(self, offer):
        """Setup's second round in every worker; the answer (ipc: a mailbox) comes from a single-worker engine only
        (plan.py streams to single-worker engines), or None where the transport answers nothing (broadcast)."""
        self._need_weights_awake("connect")
        answers = [a for a in self._rpc("rlhf_connect", pack_arg(offer)) if a is not None]
        if not answers:
            return None
        if len(answers) != 1:
            raise EngineError(f"engine {self.name}: {len(answers)} workers answered the trainer's offer; a transport "
                              "that answers (ipc) needs a single-worker engine")
        return bytes(answers[0])

    def receive(self, sync_id: int, verify: bool = True) -> tuple[list[int], dict[str, float]]:
        """Every bucket of sync `sync_id` over the transport set up: the colocated stream (one worker) or the broadcast
        group (every worker; their checksums must agree). Returns (checksums, seconds by phase, the slowest worker's)."""
        self._need_weights_awake("receive")
        results = self._rpc("rlhf_receive", int(sync_id), bool(verify))
        sums = self._agree("receive", [[int(x) for x in r[0]] for r in results])
        metrics: dict[str, float] = {}
        for _, m in results:
            for k, v in m.items():
                metrics[k] = max(metrics.get(k, float("-inf")), float(v))
        return sums, metrics

    def set_replay(self, enabled: bool) -> None:
        self._rpc("rlhf_set_replay", bool(enabled))

    def replay_status(self) -> list[dict]:
        """Per worker: the buckets loaded by replay and why any others are not (weight_sync/replay.py)."""
        return self._rpc("rlhf_replay_status")

    def abort_stream(self) -> None:
        self._rpc("rlhf_abort_stream")

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy (hf_name, tensor) pairs into the model through the workers (pickled on CPU: tests, small models)."""
        self._need_weights_awake("load_weights")
        self._rpc("rlhf_load_weights", pack_arg([(n, t.detach().cpu()) for n, t in named]))

    def checksums(self, names: list[str]) -> list[int]:
        """Checksums of the most recently received tensors of `names` (mode "received")."""
        results = self._rpc("rlhf_checksums", list(names))
        return self._agree("checksums", [[int(x) for x in r] for r in results])

    # ---- lifecycle --------------------------------------------------------------------------------
    def finish_sync(self, version: int) -> None:
        """New weights are loaded: record `version`. KV blocks of older weights are not reset but never reused:
        prompts carry the version as their prefix-cache salt (generate)."""
        self.weight_version = version

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory: level 1 offloads weights to CPU and drops the KV cache, level 2 drops both."""
        if not self.enable_sleep_mode:
            raise EngineError(f"engine {self.name}: sleep needs enable_sleep_mode: true")
        if level not in (1, 2):
            raise EngineError(f"engine {self.name}: sleep level must be 1 or 2, got {level}")
        with self._lock:
            self.llm.sleep(level=level)
            self._asleep = set(WAKE_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate `tags` (["weights"], then ["kv_cache"]; None: both). After level 2, sync before generating."""
        tags = self._tags_to_wake(tags)
        if tags:
            self.llm.wake_up(tags=tags)
            self._asleep -= set(tags)


    def shutdown(self) -> None:
        try:
            self._rpc("rlhf_close")
        except EngineError:
            logger.warning("engine %s: closing the workers' receivers failed", self.name, exc_info=True)
