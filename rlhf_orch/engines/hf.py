"""The built-in rollout engine: batched `transformers` generation on CPU or one GPU.

It exists so the whole system runs and is tested without vLLM or SGLang: same Protocol, same weight
receivers, same checksum verification. Generation is left-padded and batched (`max_batch_size`
sequences per call); per-token logprobs are log_softmax(logits / temperature) of the sampled tokens,
the same quantity the trainer computes, so their difference measures train/inference mismatch.
Temperature 0 is greedy (argmax; logprobs of log_softmax(logits)). A request with a seed (SamplingParams.seed:
evaluation) samples each row from its own generator, so the engine's RNG, and with it the training stream,
is left exactly where it was.

`sleep(level)`/`wake_up(tags)` free the weights' memory while a colocated trainer trains, with vLLM's
meaning: level 1 moves them to CPU memory, level 2 drops them; waking re-allocates them (after level 2
filled with NaN, so a wake without the sync that must follow cannot go unnoticed). There is no
persistent KV cache, so the "kv_cache" tag only records state.

A "keep" pause parks the decode loop between two steps (its KV cache, computed with the old weights, is
kept); tokens sampled after the sync carry the new version in `Sample.token_versions`. An "abort" pause
returns the batch at once with finish_reason "abort".

It does not do continuous batching, paged KV caches or tensor parallelism: use vLLM for speed.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from typing import Sequence

import torch

from rlhf_orch.engines.base import TRANSPORTS, Capabilities, EngineLifecycle, per_prompt_params
from rlhf_orch.errors import EngineError
from rlhf_orch.types import Sample, dtype_from_name
from rlhf_orch.weight_sync.buckets import checksums

logger = logging.getLogger(__name__)


def cache_arg(model) -> str:
    """The name the model's forward takes its KV cache under: `cache` in newer transformers 5.x (where
    `past_key_values` warns at every decode step, and goes in 5.40), `past_key_values` before (4.x, and 5.x releases
    as late as 5.17). Read from the forward's signature, not the version: a name the forward does not know would
    vanish into its **kwargs and every decode step would run without its context (what happened on the GPU machine's
    transformers 5.17: logprobs off by up to ~1, checksums all equal; bench/RESULTS.md, 2026-11-28)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out):
    return out["cache"] if "cache" in out else out.past_key_values


class HFEngine(EngineLifecycle):
    def __init__(self, name: str, model_path: str, device: str = "cpu", dtype: str = "float32",
                 device_id: str = "", max_batch_size: int = 256, seed: int = 0, decode_delay_s: float = 0.0,
                 unchecked_broadcast: bool = False, sync_delay_s: float = 0.0, start_delay_s: float = 0.0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if start_delay_s:
            time.sleep(start_delay_s)   # test hook: a start as slow as vLLM's (~50 s), so a replacement takes a while

        self.name = name
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
        self.max_batch_size = max_batch_size
        self.decode_delay_s = decode_delay_s   # test hook: a slow engine
        self.sync_delay_s = sync_delay_s       # test hook: a slow sync (a bucket's load)
        # unchecked_broadcast, a test hook: over broadcast the coordinator checks this engine's loads before it resumes
        # it, as it does tensor-parallel SGLang's (the trainer's checksums then travel to no broadcast receiver)
        self.capabilities = Capabilities(partial_rollouts=True, reports_decode_steps=True, saves_rng=True,
                                         checks_loads=frozenset({"ipc"}) if unchecked_broadcast else TRANSPORTS)
        self.weight_version = -1        # nothing synced yet: the first sync makes it 0
        self._device_id = device_id
        self._init_lifecycle()
        self._sleep_level = 0
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype_from_name(dtype)).to(self.device)
        except Exception as e:
            raise EngineError(f"engine {name}: cannot load model from {model_path!r}: {type(e).__name__}: {e}") from e
        self.model.eval()
        self._cache_arg = cache_arg(self.model)
        self.params = dict(self.model.named_parameters())
        self._shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self._gen = torch.Generator(device=self.device).manual_seed(seed)

    def device_ids(self) -> list[str]:
        if self.device.type == "cuda":   # the physical GPU, whatever index this process sees it under
            return [f"gpu-{torch.cuda.get_device_properties(self.device).uuid}"]
        return [self._device_id]

    # ---- generation -------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params) -> list[Sample]:
        self._check_can_generate()
        each = per_prompt_params(params, len(prompts))
        flat = [(i, list(p), each[i] if each[i].seed is None else dataclasses.replace(each[i], seed=each[i].seed + j))
                for i, p in enumerate(prompts) for j in range(each[i].n)]   # a seeded request: one seed per sample
        out: list[Sample] = []
        with self._lock, self._decoding():
            for start in range(0, len(flat), self.max_batch_size):
                out.extend(self._generate_batch(flat[start:start + self.max_batch_size]))
        return out

    def _generate_batch(self, items) -> list[Sample]:
        params = items[0][2]        # temperature and top_p are shared; lengths, ignore_eos and seeds are per row
        # Seeded rows (evaluation) sample from their own generators, so the engine's RNG (training) is untouched.
        gens = None if params.seed is None else [torch.Generator(device=self.device).manual_seed(sp.seed)
                                                 for _, _, sp in items]
        greedy = params.temperature == 0   # argmax; its logprobs are log_softmax(logits), as in vLLM and SGLang
        limits = torch.tensor([sp.max_new_tokens for _, _, sp in items], device=self.device)
        stops = torch.tensor([not sp.ignore_eos for _, _, sp in items], device=self.device)
        width = max(len(p) for _, p, _ in items)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (_, p, _) in enumerate(items):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        # Sampling by hand (not model.generate) keeps the logprobs exactly log_softmax(logits / T) and
        # lets us use our own RNG, so a seeded run is reproducible whatever else shares the process.
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        aborted = not self._between_steps()
        version = self.weight_version      # the weights that compute the next logits
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        past = _cache_of(out)
        logits = out.logits[:, -1].float()
        done = torch.zeros(len(items), dtype=torch.bool, device=self.device)
        tokens, logps, versions = [], [], []
        next_pos = pos[:, -1:] + 1
        for step in range(int(limits.max())):
            if aborted:
                break
            logp = torch.log_softmax(logits / (1.0 if greedy else params.temperature), dim=-1)
            tok = logp.argmax(-1) if greedy else self._sample(logp, params.top_p, gens)
            tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
            tokens.append(tok)
            logps.append(logp.gather(-1, tok[:, None]).squeeze(-1))
            versions.append(version)
            done |= (tok == self.eos_id) & stops
            done |= limits <= step + 1
            if bool(done.all()):
                break
            if not self._between_steps():   # an "abort" pause: hand the batch back unfinished
                aborted = True
                break
            version = self.weight_version
            if self.decode_delay_s:
                time.sleep(self.decode_delay_s)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                             use_cache=True, **{self._cache_arg: past})
            past, logits, next_pos = _cache_of(out), out.logits[:, -1].float(), next_pos + 1
        toks = torch.stack(tokens, 1).tolist() if tokens else [[] for _ in items]
        lps = torch.stack(logps, 1).tolist() if logps else [[] for _ in items]
        samples = []
        for row, (pi, p, sp) in enumerate(items):
            cap = sp.max_new_tokens
            resp, lp, ver = toks[row][:cap], lps[row][:cap], list(versions)[:cap]
            if self.eos_id in resp and not sp.ignore_eos:
                cut = resp.index(self.eos_id) + 1
                resp, lp, ver, reason = resp[:cut], lp[:cut], ver[:cut], "stop"
            else:
                reason = "abort" if aborted and len(resp) < cap else "length"
            samples.append(Sample(prompt_index=pi, prompt_ids=p, response_ids=resp, logprobs=lp,
                                  finish_reason=reason, weight_version=ver[0] if ver else self.weight_version,
                                  engine=self.name, text=self.tokenizer.decode(resp, skip_special_tokens=True),
                                  token_versions=ver))
        return samples

    def _sample(self, logp: torch.Tensor, top_p: float, gens: list | None = None) -> torch.Tensor:
        probs = logp.exp()
        idx = None
        if top_p < 1.0:
            sorted_p, idx = probs.sort(dim=-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < top_p    # always keeps the most likely token
            probs = sorted_p * keep
        if gens is None:
            choice = torch.multinomial(probs, 1, generator=self._gen)
        else:   # one generator per row (a seeded request)
            choice = torch.cat([torch.multinomial(probs[r:r + 1], 1, generator=g) for r, g in enumerate(gens)])
        return choice.squeeze(-1) if idx is None else idx.gather(-1, choice).squeeze(-1)

    # ---- weights ----------------------------------------------------------------------------------
    def _before_load(self) -> None:
        self._need_weights_awake("load_weights")
        if self.sync_delay_s:
            time.sleep(self.sync_delay_s)

    @torch.no_grad()
    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self._before_load()
        missing = [n for n, _ in named if n not in self.params]
        if missing:
            raise EngineError(f"engine {self.name}: no parameter named {missing[0]!r} in the model")
        # One multi-tensor copy per bucket instead of a launch per parameter.
        torch._foreach_copy_([self.params[n] for n, _ in named], [t for _, t in named], non_blocking=True)

    def checksums(self, names: list[str]) -> list[int]:
        return checksums(self.params[n] for n in names)

    def replay_params(self) -> dict[str, torch.Tensor]:
        """The parameters a `LoadReplay` writes into in place of `load_weights` (refused while asleep, as it is)."""
        self._before_load()
        return self.params

    def rng_state(self) -> torch.Tensor:
        """The sampling generator's state, so a resumed run samples exactly as an uninterrupted one."""
        return self._gen.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._gen.set_state(state)

    def finish_sync(self, version: int) -> None:
        self.weight_version = version   # no prefix cache here; the KV cache lives per call

    # ---- colocation -------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the weights' device memory: level 1 keeps a CPU copy, level 2 drops them (sync refills)."""
        if level not in (1, 2):
            raise EngineError(f"engine {self.name}: sleep level must be 1 or 2, got {level}")
        with self._lock:
            if "weights" not in self._asleep:
                for p in self.params.values():
                    p.data = p.data.to("cpu") if level == 1 else torch.empty(0, dtype=p.dtype, device=p.device)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            self._sleep_level = level
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = self._tags_to_wake(tags)
        if "weights" in tags:
            shapes = self._shapes
            for n, p in self.params.items():
                if self._sleep_level == 1:
                    p.data = p.data.to(self.device)
                else:
                    p.data = torch.full(shapes[n], float("nan"), dtype=p.dtype, device=self.device)
        self._asleep -= set(tags)

