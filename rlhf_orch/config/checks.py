"""Config rules that involve more than one field or the outside world (the output folder, the algorithm registry,
the loss names), run by ExperimentConfig's validator. Each problem is one line naming the field and the fix.
Only checks: the sections themselves, their fields and single-field validators are in schema.py."""
from __future__ import annotations

import logging
import math
import os
import tempfile
from pathlib import Path

from rlhf_orch.algorithms.base import algorithm_names, make_algorithm
from rlhf_orch.algorithms.losses import KL_ESTIMATORS, LOSS_AGG_MODES
from rlhf_orch.algorithms.off_policy import resolve_off_policy
from rlhf_orch.config.engines import KINDS, kind_of, kind_problems
from rlhf_orch.config.nodes import node_problems
from rlhf_orch.storage import storage_problems
from rlhf_orch.config.schema import ExperimentConfig, RolloutSection, engine_names
from rlhf_orch.data.tasks import TASKS
from rlhf_orch.models.tiny import BUILTIN_PREFIX, CHARS, SPECIAL_TOKENS
from rlhf_orch.rewards import NO_FUNCTION
from rlhf_orch.rollout.agent_specs import agent_problems
from rlhf_orch.trainer.packing import flash_attn_available
# schema.py imports this module inside its validator (the checks need its sections), so importing the schema (for
# `rlhf-orch --help`) loads none of the above. transformers is imported where a model folder is read.

logger = logging.getLogger(__name__)
_warned: set[str] = set()   # warnings already logged by this process: a config validated again says nothing new


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def resolve_algorithm_defaults(cfg: ExperimentConfig) -> None:
    """Defaults of the algorithm section that depend on other sections, resolved in place so the validated config
    (and the run's config.json) shows the real choice; and warnings for explicit choices that are allowed but
    unsafe. Runs first in the cross-field validator, the one place that sees every section.

    - algorithm.off_policy "auto" -> decoupled when rollout.max_staleness >= 1, none at 0
      (algorithms.off_policy.resolve_off_policy says why decoupled). An explicit none with max_staleness >= 1
      stays, with a warning naming both fields.
    - algorithm.kl_estimator k3 (unclamped, now only by explicit choice) with a KL term in use: a warning.
    """
    resolve_rollout_defaults(cfg)
    a, staleness = cfg.algorithm, cfg.rollout.max_staleness
    resolved = resolve_off_policy(a.off_policy, staleness)
    if resolved != a.off_policy:
        given = "off_policy" in a.model_fields_set
        a.off_policy = resolved
        if not given:   # a resolved default is still not the user's choice (checks that ask "was it set?")
            a.model_fields_set.discard("off_policy")
    elif a.off_policy == "none" and staleness > 0:
        _warn_once(f"algorithm.off_policy: none with rollout.max_staleness {staleness} trains samples up to "
                   f"{staleness} policy version(s) old without any correction (the engine's logprobs never enter the "
                   "loss, and such runs learned worse than on-policy); remove algorithm.off_policy (auto picks "
                   "decoupled) or set it to decoupled or tis, or set rollout.max_staleness: 0")
    if a.kl_estimator == "k3" and (a.kl_coef > 0 or a.use_kl_in_reward):
        _warn_once("algorithm.kl_estimator: k3 is unclamped: one token far from the reference adds up to "
                   "4.85e8 x the KL weight to the loss; set algorithm.kl_estimator: k3_clamped (the default, equal to "
                   "k3 wherever k3 is below 10) or low_var_kl, unless you want the unbounded estimate")


def engines_that_cannot_stop(cfg: ExperimentConfig) -> list[tuple[int, str, str]]:
    """(index, kind, fix) of every engine whose requests cannot stop between two decode steps (park or abort)."""
    out = []
    for i, e in enumerate(cfg.engines):
        kind = kind_of(e)
        if not kind.can_stop_mid_request(e):
            fix = (f"set engines.{i}.streaming: true" if kind.streaming_engine else "use a kind that pauses between "
                   f"decode steps: {', '.join(k.name for k in KINDS.values() if k.parks_mid_request or k.streaming_engine)}")
            out.append((i, e.kind, fix))
    return out


def overlap_allowed(overlap: bool | str, max_staleness: int) -> bool:
    """weight_sync.overlap's own rule: true, or auto at max_staleness >= 1 (driver/overlap.py also needs no GPU
    hand-over at run time)."""
    return overlap is True or (overlap == "auto" and max_staleness >= 1)


def sync_overlapped(cfg: ExperimentConfig, max_staleness: int) -> bool:
    """Whether every weight sync will run while the trainer trains on: allowed (`overlap_allowed`) and no engine
    beside a trainer, whose GPU hand-over could turn it off at run time (colocation offload or sleep)."""
    dedicated = all(e.placement == "dedicated" for e in cfg.engines)
    return overlap_allowed(cfg.weight_sync.overlap, max_staleness) and dedicated


def pause_mode(cfg: ExperimentConfig, rollout: RolloutSection) -> str:
    """How a sync pauses the engines for the steps `rollout` serves (its running_requests may still be "auto"):
    "keep" with partial rollouts, else running_requests, "auto" resolved by `auto_running_requests`."""
    if rollout.partial_rollouts:
        return "keep"
    return auto_running_requests(cfg, rollout) if rollout.running_requests == "auto" else rollout.running_requests


def auto_running_requests(cfg: ExperimentConfig, rollout: RolloutSection, warn: bool = False) -> str:
    """What rollout.running_requests "auto" means for `rollout` (its max_staleness, deterministic) without partial
    rollouts (issue #27):

    - wait: max_staleness 0 (nothing runs during a sync: the synchronous loop exactly); deterministic (which requests
      a sync would catch depends on timing); an overlapped sync (`sync_overlapped`: the trainer does not wait for the
      sync, so waiting costs it nothing, while aborting throws away every running request's tokens and restarts the
      longest ones: bench/RESULTS.md, k1 vs k1a); and, with one warning naming the engine and the fix, engines that
      cannot stop mid-request.
    - abort: otherwise (the sync is on the trainer's path and every engine can stop mid-request: kind hf, or
      vllm/sglang with streaming: true).
    """
    if rollout.max_staleness < 1 or rollout.deterministic or sync_overlapped(cfg, rollout.max_staleness):
        return "wait"
    stuck = engines_that_cannot_stop(cfg)
    if stuck and warn:
        i, kind, fix = stuck[0]
        _warn_once(f"rollout.running_requests: auto resolves to wait because engines.{i} (kind {kind}) cannot stop "
                   f"a request between two decode steps, so every weight sync waits for the running requests "
                   f"(the trainer idles meanwhile); {fix} so they are aborted and re-queued instead, or set "
                   f"rollout.running_requests: wait to keep this")
    return "wait" if stuck else "abort"


def resolve_rollout_defaults(cfg: ExperimentConfig) -> None:
    """rollout.running_requests "auto", resolved in place by `auto_running_requests` (the saved config shows the
    choice; the field stays out of model_fields_set, as the user did not set it). With partial rollouts the pause
    parks running requests ("keep") and this field is not read; it resolves to wait there."""
    r = cfg.rollout
    if r.running_requests != "auto":
        return
    r.running_requests = "wait" if r.partial_rollouts else auto_running_requests(cfg, r, warn=True)
    r.model_fields_set.discard("running_requests")


def output_problems(cfg: ExperimentConfig) -> list[str]:
    """The run folder must be creatable: checked now, not when the first file is written after Ray started."""
    try:   # creating it is what the run would do first anyway; a probe file shows it is writable
        os.makedirs(cfg.experiment.output_dir, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=cfg.experiment.output_dir).close()
    except OSError as e:
        return [f"experiment.output_dir: cannot write to {cfg.experiment.output_dir!r} ({e.strerror or e}); choose a "
                "folder you can write to"]
    return storage_problems(cfg.experiment.storage_uri, cfg.experiment.name)   # reachable and writable now


def cross_field_problems(cfg: ExperimentConfig) -> list[str]:
    """Every rule that involves more than one field. Each message names the field and the fix."""
    resolve_algorithm_defaults(cfg)
    p: list[str] = output_problems(cfg)
    if cfg.algorithm.name not in algorithm_names():
        p.append(f"algorithm.name: unknown algorithm {cfg.algorithm.name!r}; use one of: {', '.join(algorithm_names())}")
    else:
        if cfg.algorithm.kl_estimator not in KL_ESTIMATORS:
            p.append(f"algorithm.kl_estimator: unknown KL estimator {cfg.algorithm.kl_estimator!r}; use one of: "
                     f"{', '.join(KL_ESTIMATORS)}")
        if cfg.algorithm.loss_agg_mode not in LOSS_AGG_MODES:
            p.append(f"algorithm.loss_agg_mode: unknown loss aggregation mode {cfg.algorithm.loss_agg_mode!r}; use one of: "
                     f"{', '.join(LOSS_AGG_MODES)}")
        algo = make_algorithm({**cfg.algorithm.model_dump(), "loss_agg_mode": "token-mean"})   # mode checked above
        p.extend(algo.problems())
        if cfg.algorithm.loss_agg_mode == "seq-mean-token-sum-norm" and not cfg.algorithm.loss_norm_len:
            p.append("algorithm.loss_norm_len: loss_agg_mode seq-mean-token-sum-norm divides by a constant length; "
                     "set it (e.g. the engines' sampling.max_new_tokens)")
        if cfg.algorithm.use_kl_in_reward and not algo.token_level:
            p.append(f"algorithm.use_kl_in_reward: {algo.name} turns one reward per sample into advantages, so a per-token "
                     "KL penalty has nowhere to go; use algorithm.kl_coef (KL in the loss), or algorithm.name: ppo / "
                     "reinforce_pp_gamma")
        p.extend(algorithm_option_problems(cfg, algo))
        p.extend(role_problems(cfg, algo))
        if cfg.reference.model_fields_set and "reference" not in algo.roles:
            p.append(f"reference.{sorted(cfg.reference.model_fields_set)[0]}: {algo.name} as configured has no KL "
                     "reference (algorithm.kl_coef is 0 and use_kl_in_reward is false); remove the reference section or "
                     "set algorithm.kl_coef > 0")
    p.extend(reward_source_problems(cfg))
    colocated = sum(e.count for e in cfg.engines if e.placement == "colocated")
    if colocated > cfg.trainer.num_ranks:
        p.append(f"engines: {colocated} colocated engines but trainer.num_ranks is {cfg.trainer.num_ranks}; "
                 "each colocated engine shares one trainer rank's device, so use at most "
                 f"{cfg.trainer.num_ranks} or set placement: dedicated on some")
    for i, e in enumerate(cfg.engines):
        if e.placement == "colocated" and e.tensor_parallel_size > 1:
            p.append(f"engines.{i}.tensor_parallel_size: colocated engines use one device each; set it to 1 or placement: dedicated")
        p.extend(kind_problems(i, e, cfg))   # what its kind cannot do, and the kind's own checks (config/engines/)
        if e.sampling.max_new_tokens + cfg.data.max_prompt_tokens > cfg.model.tiny.max_position_embeddings and cfg.model.path.startswith("builtin:"):
            p.append(f"engines.{i}.sampling.max_new_tokens: prompt ({cfg.data.max_prompt_tokens}) + response "
                     f"({e.sampling.max_new_tokens}) exceed model.tiny.max_position_embeddings "
                     f"({cfg.model.tiny.max_position_embeddings}); lower one or raise the other")
    temps = {e.sampling.temperature for e in cfg.engines}
    if len(temps) > 1:
        p.append(f"engines.*.sampling.temperature: engines use different temperatures {sorted(temps)}; the trainer scores "
                 "samples with one temperature, so give every engine the same one")
    names = engine_names(cfg)
    if len(set(names)) != len(names):
        p.append("engines: two entries share a name; give each entry a distinct name")
    if cfg.weight_sync.transport == "ipc" and any(e.placement == "dedicated" for e in cfg.engines):
        p.append("weight_sync.transport: ipc needs every engine colocated with a trainer rank; use auto or broadcast")
    for i, e in enumerate(cfg.engines):
        if e.sleep_level and e.placement != "colocated":
            p.append(f"engines.{i}.sleep_level: only colocated engines sleep (they share the trainer's GPU); set it to 0")
    p.extend(rollout_problems(cfg))
    p.extend(ray_problems(cfg) + node_problems(cfg))
    if cfg.trainer.offload and cfg.trainer.zero_stage == 0:
        how = "auto may offload, and offloading" if cfg.trainer.offload == "auto" else "offloading"
        p.append(f"trainer.offload: {how} moves ZeRO's optimizer partitions; set trainer.zero_stage to 1, 2 or 3")
    if cfg.trainer.bf16 and cfg.trainer.device == "cpu":
        p.append("trainer.bf16: bf16 training is for cuda here; set trainer.bf16: false or trainer.device: cuda")
    p.extend(packing_problems(cfg))
    p.extend(data_problems(cfg))
    p.extend(eval_problems(cfg))
    return p


def ray_problems(cfg: ExperimentConfig) -> list[str]:
    """ray-section rules (whether the placement fits the machine or cluster is checked by rlhf_orch.resources)."""
    r, p = cfg.ray, []
    if r.num_cpus is not None and r.address:
        p.append("ray.num_cpus: sizes a local Ray only and ray.address joins a cluster, which has its own CPUs; remove it")
    elif r.num_cpus is not None and r.num_cpus < 1:
        p.append(f"ray.num_cpus: {r.num_cpus:g} is below 1; a local Ray needs at least one whole CPU (the run's actors "
                 f"share it in slots of a quarter CPU); set ray.num_cpus >= 1, or remove it to use this machine's "
                 f"{os.cpu_count()}")
    return p


# algorithm.<field> -> (what reads it, whether it applies): a field set explicitly where it does nothing is an error,
# because the user believes it changes the run.
def algorithm_option_problems(cfg: ExperimentConfig, algo) -> list[str]:
    a, p = cfg.algorithm, []
    given = a.model_fields_set
    rules = (
        ("norm_adv_by_std", "grpo's group normalisation", a.name == "grpo", "algorithm.name: grpo"),
        ("gamma", "the discount of ppo and reinforce_pp_gamma", a.name in ("ppo", "reinforce_pp_gamma"),
         "algorithm.name: ppo or reinforce_pp_gamma"),
        ("lam", "ppo's GAE", algo.needs_critic, "algorithm.name: ppo"),
        ("kl_ctrl", "the KL-in-reward weight", a.use_kl_in_reward, "algorithm.use_kl_in_reward: true"),
        ("tis_cap", "off_policy tis", a.off_policy == "tis", "algorithm.off_policy: tis"),
        ("mis_low", "off_policy mis", a.off_policy == "mis", "algorithm.off_policy: mis"),
        ("mis_high", "off_policy mis", a.off_policy == "mis", "algorithm.off_policy: mis"),
        ("decoupled_cap", "off_policy decoupled", a.off_policy == "decoupled", "algorithm.off_policy: decoupled"),
        ("loss_norm_len", "loss_agg_mode seq-mean-token-sum-norm", a.loss_agg_mode == "seq-mean-token-sum-norm",
         "algorithm.loss_agg_mode: seq-mean-token-sum-norm"),
    )
    for name, reader, applies, needs in rules:
        if name in given and not applies:
            p.append(f"algorithm.{name}: applies to {reader} only and this run does not use it; remove it or set {needs}")
    if cfg.critic.model_fields_set and not algo.needs_critic:
        fields = ", ".join(sorted(cfg.critic.model_fields_set))
        p.append(f"critic.{sorted(cfg.critic.model_fields_set)[0]}: the critic section ({fields}) applies to critic-based "
                 f"algorithms (ppo) and {a.name} has no critic; remove it or set algorithm.name: ppo")
    return p


def role_problems(cfg: ExperimentConfig, algo) -> list[str]:
    """Every model the algorithm needs (`algo.roles`) must be usable as configured: checked here, not when its actor
    loads it after Ray started. (The reward source every algorithm needs: reward_source_problems.)"""
    p: list[str] = []
    if "critic" in algo.roles and cfg.critic.model_path is not None:
        problem = causal_lm_problem(cfg.critic.model_path, policy_vocab_size(cfg))
        if problem:
            p.append(f"critic.model_path: {problem}")
    if "critic" in algo.roles:
        p.extend(_critic_placement_problems(cfg))
    if "reference" in algo.roles:
        ref = cfg.reference
        p.extend(_separate_only("reference", ref, {"num_workers", "gpus_per_worker"},
                                "a colocated reference is a copy inside every policy rank"))
        if ref.placement == "separate" and ref.num_workers > cfg.trainer.num_ranks:
            p.append(f"reference.num_workers: {ref.num_workers} workers but a step has only trainer.num_ranks = "
                     f"{cfg.trainer.num_ranks} shards to score, so {ref.num_workers - cfg.trainer.num_ranks} would never "
                     f"work (each holding a whole model, and a GPU on cuda); set it to at most {cfg.trainer.num_ranks}")
    return p


def _separate_only(name: str, section, fields: set[str], colocated_is: str) -> list[str]:
    """A role's fields that only its separate placement uses, set while it is colocated (the first, by name)."""
    apart = sorted(fields & section.model_fields_set)
    if section.placement != "colocated" or not apart:
        return []
    return [f"{name}.{apart[0]}: applies to {name}.placement: separate only ({colocated_is}); remove it or set "
            f"{name}.placement: separate"]


def _critic_placement_problems(cfg: ExperimentConfig) -> list[str]:
    c, t = cfg.critic, cfg.trainer
    stage = t.zero_stage if c.zero_stage is None else c.zero_stage
    if c.placement == "colocated":
        apart = _separate_only("critic", c, {"num_ranks", "gpus_per_rank"},
                               "a colocated critic has one rank inside every policy rank")
        if apart:
            return apart
        if t.offload and stage == 0:
            return ["critic.zero_stage: a colocated critic leaves the GPU with the policy (trainer.offload), which needs "
                    "a ZeRO optimizer; set critic.zero_stage to 1, 2 or 3, or trainer.offload: false"]
        return []
    if t.num_ranks % c.num_ranks:
        divisors = [d for d in range(1, t.num_ranks + 1) if t.num_ranks % d == 0]
        return [f"critic.num_ranks: {c.num_ranks} critic ranks cannot share trainer.num_ranks = {t.num_ranks} policy "
                f"shards evenly (every critic rank must take the same number, for its collectives); use one of "
                f"{divisors}"]
    return []


def reward_source_problems(cfg: ExperimentConfig) -> list[str]:
    """A reward source that counts: the function with a non-zero weight, or a reward model with one. (No source at
    all, and both weights 0, are refused by RewardSection itself.)"""
    r = cfg.reward
    function = r.function != NO_FUNCTION and r.function_weight != 0
    model = r.model_path is not None and r.model_weight != 0
    if function or model:
        return []
    if r.model_path is None:
        return ["reward.function_weight: 0 and no reward.model_path, so every reward would be 0 and nothing would be "
                "learned; set reward.function_weight to a non-zero weight, or add a reward model (reward.model_path)"]
    return ["reward.model_weight: 0 and reward.function is null, so every reward would be 0 and nothing would be "
            "learned; set reward.model_weight to a non-zero weight, or set reward.function"]


def policy_vocab_size(cfg: ExperimentConfig) -> int | None:
    """The policy's vocabulary size (the token ids its samples can hold); None when its config cannot be read
    (model.path's own check reports that)."""
    if cfg.model.path.startswith(BUILTIN_PREFIX):
        return len(SPECIAL_TOKENS) + len(CHARS)
    try:
        from transformers import AutoConfig
        return int(AutoConfig.from_pretrained(cfg.model.path).vocab_size)
    except Exception:
        return None


def causal_lm_problem(path: str, policy_vocab: int | None) -> str | None:
    """What is wrong with `path` as the critic's starting model (a local causal LM folder: the critic keeps its
    decoder and puts a value head on it), in one sentence with the fix; None if nothing. Reads config.json only."""
    unset = "remove critic.model_path to start the critic from model.path"
    if path.startswith(BUILTIN_PREFIX):
        return (f"{path!r}: built-in models are built for model.path only; {unset} (which may be builtin:tiny-llama), "
                "or give a local causal LM folder")
    folder = Path(path)
    if not folder.is_dir():
        return (f"{path!r} is not a local folder (rlhf_orch does not download models); give a Hugging Face causal LM "
                f"folder (config.json and weights), or {unset}")
    if not (folder / "config.json").is_file():
        return (f"{path!r} has no config.json, so it is not a Hugging Face model folder; point it at the folder "
                f"save_pretrained wrote, or {unset}")
    try:
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(str(folder))
    except Exception as e:   # an unknown model_type, a malformed file
        return (f"its config.json cannot be read by AutoConfig ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                f"fix the folder or {unset}")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    archs = list(getattr(config, "architectures", None) or [])
    causal = [a for a in archs if a.endswith(("ForCausalLM", "LMHeadModel"))]
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (archs and not causal):
        held = "/".join(archs) or f"model_type {config.model_type!r}"
        return (f"the folder holds a {held}, not a causal LM (AutoModelForCausalLM), whose decoder the critic's value "
                f"head sits on; give a causal LM folder (e.g. the policy's family), or {unset}")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
        return (f"the folder has no weights (*.safetensors or pytorch_model*.bin); save the model into it with "
                f"save_pretrained(), or {unset}")
    vocab = getattr(config, "vocab_size", None)
    if policy_vocab is not None and vocab is not None and vocab < policy_vocab:
        return (f"its vocabulary ({vocab} tokens) is smaller than the policy's ({policy_vocab}), but the critic reads "
                f"the policy's token ids; use a critic with the policy's tokenizer, or {unset}")
    return None


def eval_problems(cfg: ExperimentConfig) -> list[str]:
    """eval-section rules that need no file read (its rows are read and checked by rlhf_orch.evaluation)."""
    e, p = cfg.eval, []
    given = e.model_fields_set
    if "temperature" in given and e.n == 1:
        p.append("eval.temperature: eval.n 1 is greedy (argmax), so no temperature applies; set eval.n > 1 to sample "
                 "at this temperature, or remove it")
    source = e.source if e.source is not None else cfg.data.source
    if source.startswith("builtin:"):
        task = source.removeprefix("builtin:")
        if e.source is not None and task not in TASKS:
            p.append(f"eval.source: unknown built-in task {task!r}; use one of: {', '.join('builtin:' + t for t in TASKS)}")
        if "split" in given:
            p.append(f"eval.split: applies to file sources only and the evaluation prompts come from {source}; remove it")
    elif e.source is not None and not Path(e.source).exists():
        p.append(f"eval.source: file {e.source!r} not found; give a .jsonl, .json, .parquet or .arrow file, a folder of "
                 "them, a builtin:<task>, or null for the validation split of data.source")
    return p


FILE_ONLY_DATA_FIELDS = ("split", "prompt_key", "answer_key", "system_prompt", "chat_template", "chat_template_path")


def data_problems(cfg: ExperimentConfig) -> list[str]:
    """data-section rules that need no file read (the rows are checked by rlhf_orch.data.dataset_problems)."""
    d, p = cfg.data, []
    given = d.model_fields_set
    if d.source.startswith("builtin:"):
        for name in FILE_ONLY_DATA_FIELDS:
            if name in given:
                p.append(f"data.{name}: applies to file sources only and data.source is {d.source}; remove it")
        return p
    if "max_operand" in given:
        p.append(f"data.max_operand: applies to builtin:arithmetic only and data.source is the file {d.source!r}; remove it")
    for name in ("prompt_key", "answer_key"):
        key = getattr(d, name)
        if any(not part.strip() for part in key.split(".")):
            p.append(f"data.{name}: {key!r} has an empty part; write a dotted path such as reward_model.ground_truth")
    if d.chat_template_path is not None and not Path(d.chat_template_path).is_file():
        p.append(f"data.chat_template_path: file {d.chat_template_path!r} not found; give a Jinja chat template file "
                 "(e.g. examples/tiny_chat_template.jinja) or remove it to use the tokenizer's own template")
    return p


def packing_problems(cfg: ExperimentConfig) -> list[str]:
    """Token budget, packing and attention settings (checked before any actor starts)."""
    t, p = cfg.trainer, []
    longest = cfg.data.max_prompt_tokens + max(e.sampling.max_new_tokens for e in cfg.engines)
    if t.max_tokens_per_micro_batch and t.max_tokens_per_micro_batch < longest:
        p.append(f"trainer.max_tokens_per_micro_batch: {t.max_tokens_per_micro_batch} is below the longest allowed "
                 f"sequence, data.max_prompt_tokens + the largest engines.*.sampling.max_new_tokens = {longest}; "
                 f"set it to at least {longest} (or 0 for row micro-batches)")
    if t.packing and not t.max_tokens_per_micro_batch:
        p.append(f"trainer.packing: packed micro-batches are formed by a token budget; set trainer.max_tokens_per_micro_batch "
                 f"(at least {longest}) or packing: false")
    if t.attn == "flash_attention_2":
        if t.device != "cuda":
            p.append("trainer.attn: flash_attention_2 runs on cuda only; set trainer.attn: sdpa (or auto) or trainer.device: cuda")
        elif not flash_attn_available():
            p.append("trainer.attn: flash_attention_2 needs the flash_attn package, which is not importable here; install it "
                     "(`pip install flash-attn --no-build-isolation`) or set trainer.attn: auto to fall back to sdpa")
    return p


# Generate calls that may wait for their turn in one engine actor (deterministic mode): the actor runs 64 calls at once
# (actors/rollout.py max_concurrency) and its pause, sync and health calls need threads too.
DETERMINISTIC_MAX_QUEUED_CALLS = 32


def rollout_problems(cfg: ExperimentConfig) -> list[str]:
    r, p = cfg.rollout, []
    if r.partial_rollouts and r.max_staleness == 0:
        p.append("rollout.partial_rollouts: with max_staleness 0 no request runs while weights change; "
                 "set rollout.max_staleness >= 1 or partial_rollouts: false")
    if "partial_extra_lag" in r.model_fields_set and not r.partial_rollouts:   # each token from its admission version
        p.append("rollout.partial_extra_lag: only partial rollouts train a group after its deadline; set "
                 "partial_rollouts: true or remove it")
    stuck = engines_that_cannot_stop(cfg)
    if r.partial_rollouts:
        for i, kind, fix in stuck:
            p.append(f"rollout.partial_rollouts: engines.{i} (kind {kind}) cannot pause between decode steps; "
                     f"{fix}, or set partial_rollouts: false")
    elif r.running_requests == "abort" and r.max_staleness >= 1:
        for i, kind, fix in stuck:
            p.append(f"rollout.running_requests: abort needs engines that stop a request between two decode steps and "
                     f"engines.{i} (kind {kind}) cannot; {fix}, or set running_requests: wait (or remove it: auto)")
    p += agent_problems(r, cfg.reward.function)
    if r.multi_turn is not None:
        mt = r.multi_turn
        total = max(mt.total_tokens(e.sampling.max_new_tokens) for e in cfg.engines)
        if cfg.model.path.startswith("builtin:") and \
                cfg.data.max_prompt_tokens + total > cfg.model.tiny.max_position_embeddings:
            how = "" if mt.max_total_tokens else ", its default: max_turns x (max_new_tokens + max_observation_tokens)"
            p.append(f"rollout.multi_turn.max_total_tokens: prompt ({cfg.data.max_prompt_tokens}) + trajectory "
                     f"({total}{how}) exceed model.tiny.max_position_embeddings "
                     f"({cfg.model.tiny.max_position_embeddings}); set or lower max_total_tokens, or raise the "
                     "model's positions")
        t = cfg.trainer
        if t.max_tokens_per_micro_batch and t.max_tokens_per_micro_batch < cfg.data.max_prompt_tokens + total:
            p.append(f"rollout.multi_turn.max_total_tokens: a trajectory may reach data.max_prompt_tokens + {total} "
                     f"tokens, above trainer.max_tokens_per_micro_batch ({t.max_tokens_per_micro_batch}); raise the "
                     "budget or lower max_total_tokens")
    if r.final_outputs and r.partial_rollouts:
        p.append("rollout.final_outputs: a request kept through a sync (partial_rollouts) needs each token's weight "
                 "version as it is sampled; set final_outputs: false or partial_rollouts: false")
    if r.deterministic and r.partial_rollouts:
        p.append("rollout.deterministic: a parked request continues on the new weights from whichever token it had "
                 "reached, which depends on timing; set partial_rollouts: false or deterministic: false")
    elif r.deterministic and r.running_requests == "abort" and r.max_staleness >= 1:
        p.append("rollout.deterministic: which requests a sync aborts depends on timing; set rollout.running_requests: "
                 "wait (or remove it: auto picks wait when deterministic) or deterministic: false")
    if r.deterministic:
        engines, B = len(engine_names(cfg)), cfg.data.prompts_per_step
        per_call = r.dispatch_groups or math.ceil(B / engines)
        calls = math.ceil(math.ceil(B * (r.max_staleness + 1) / per_call) / engines)
        if calls > DETERMINISTIC_MAX_QUEUED_CALLS:
            fit = math.ceil(B * (r.max_staleness + 1) / (engines * DETERMINISTIC_MAX_QUEUED_CALLS))
            p.append(f"rollout.deterministic: up to {calls} generate calls per engine would queue for their turn, more "
                     f"than the {DETERMINISTIC_MAX_QUEUED_CALLS} an engine actor holds beside its sync and health calls; "
                     f"set rollout.dispatch_groups to at least {fit} (or 0: one call per engine per step)")
    if r.max_staleness:
        for i, e in enumerate(cfg.engines):
            if e.sleep_level:
                p.append(f"engines.{i}.sleep_level: a sleeping colocated engine cannot generate while the trainer "
                         "trains, so rollout.max_staleness >= 1 gains nothing; set sleep_level: 0 or max_staleness: 0")
    if r.filter_groups and cfg.algorithm.group_size < 2:
        p.append("rollout.filter_groups: a group of one sample has no reward spread to filter on; "
                 "set algorithm.group_size >= 2 or filter_groups: false")
    return p
