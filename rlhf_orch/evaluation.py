"""Evaluation of the policy: which prompts, which sampling parameters and seeds, and the metrics (pass@k).

`eval_set_for(cfg, tokenizer)` reads and checks the evaluation prompts once, in the driver, before Ray starts
(`eval.source`: a built-in task or a file like data.source, read with the data section's keys and chat template;
null: the validation split of data.source). A capped set (`eval.max_prompts`) is a seeded subset, the same at
every evaluation, so the curve compares like with like. `request_params` gives each prompt its sampling
parameters: greedy (temperature 0) for eval.n 1, otherwise eval.temperature with a seed of the prompt's own,
derived from experiment.seed, the step and the prompt's place in the set, so sampled evaluations are
reproducible, do not depend on how prompts are split over engines, and never draw from an engine's own RNG
(the training stream). `aggregate` turns per-sample rewards into the `eval/` metrics, with the unbiased pass@k
estimator of the Codex paper (Chen et al. 2021): 1 - C(n - c, k) / C(n, k) for c passing samples of n.

This module is pure: no Ray, no engines. driver/evaluation.py runs an evaluation on the cluster.
"""
from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass
from pathlib import Path

from rlhf_orch.data.dataset import load_rows
from rlhf_orch.data.prepare import _answer_needed_by, prepare_rows, token_problems
from rlhf_orch.data.rows import DataSpec
from rlhf_orch.engines.base import SamplingParams
from rlhf_orch.errors import DataError

logger = logging.getLogger(__name__)

VALIDATION_SPLITS = ("validation", "val", "valid", "test")   # tried in order when eval.split is not given
_SEED_SPACE = 2**31 - 1   # SGLang and vLLM take 32-bit seeds comfortably


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples passes) from c passing samples out of n (k <= n).
    Computed as a product (the Codex paper's numerically stable form), never through large binomials."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_fail = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_fail *= 1.0 - k / i
    return 1.0 - prob_all_fail


def aggregate(rewards: list[list[float]], lengths: list[list[int]], k: int, threshold: float) -> dict[str, float]:
    """`eval/` metrics from per-prompt lists of sample rewards and response lengths (tokens): the mean reward and
    response length over all samples, and pass@1 and pass@k (a sample passes when reward >= threshold) averaged
    over prompts. Every prompt must have the same number of samples n >= k."""
    if not rewards:
        raise ValueError("aggregate: no prompts were evaluated")
    n = len(rewards[0])
    if any(len(r) != n for r in rewards) or [len(x) for x in lengths] != [len(r) for r in rewards]:
        raise ValueError("aggregate: every prompt needs the same number of samples, with one length per reward")
    flat = [r for rs in rewards for r in rs]
    passed = [sum(r >= threshold for r in rs) for rs in rewards]
    return {
        "eval/reward_mean": sum(flat) / len(flat),
        "eval/pass@1": sum(pass_at_k(n, c, 1) for c in passed) / len(rewards),
        "eval/pass@k": sum(pass_at_k(n, c, k) for c in passed) / len(rewards),
        "eval/k": float(k),
        "eval/response_len_mean": sum(x for xs in lengths for x in xs) / len(flat),
        "eval/prompts": float(len(rewards)),
    }


def select_prompts(count: int, max_prompts: int, seed: int) -> list[int]:
    """Indices of the prompts to evaluate: all (max_prompts 0 or >= count), else a seeded subset in source order."""
    if max_prompts == 0 or max_prompts >= count:
        return list(range(count))
    return sorted(random.Random(f"rlhf_orch-eval-subset/{seed}").sample(range(count), max_prompts))


def eval_seed(seed: int, step: int, index: int, n: int) -> int:
    """The seed of prompt `index`'s samples at `step` (sample j uses this + j): a hash of (seed, step, index)."""
    return random.Random(f"rlhf_orch-eval/{seed}/{step}/{index}").randrange(_SEED_SPACE - n)


def shard(count: int, parts: int) -> list[tuple[int, int]]:
    """`count` items split into at most `parts` contiguous, near-equal, non-empty [start, end) ranges."""
    parts = max(1, min(parts, count))
    size, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append((start, end))
        start = end
    return [r for r in out if r[1] > r[0]]


@dataclass(frozen=True)
class EvalPrompt:
    index: int              # position in the evaluation set (its seeds derive from it)
    token_ids: list[int]
    row: dict


@dataclass
class EvalSet:
    """The evaluation prompts and settings of a run (made once by eval_set_for)."""

    prompts: list[EvalPrompt]
    source: str             # where they came from, for logs ("examples/gsm8k (split test)")
    every: int
    final: bool
    n: int
    temperature: float
    threshold: float
    seed: int

    def due(self, step: int, last_step: int) -> bool:
        """Evaluate after `step`? Every `every` steps, and after the last one when `final`."""
        return bool(self.every and step % self.every == 0) or (self.final and step == last_step)

    def request_params(self, sampling, step: int, indices: range | list[int]) -> list[SamplingParams]:
        """One SamplingParams per prompt at positions `indices`, from an engine's `sampling` config (its response
        length and top_p): greedy for n 1; otherwise eval.temperature and the prompt's own seed. A row's own
        max_new_tokens / ignore_eos bound its responses as in training."""
        greedy = self.n == 1
        base = SamplingParams(temperature=0.0 if greedy else self.temperature, top_p=1.0 if greedy else sampling.top_p,
                              max_new_tokens=sampling.max_new_tokens, n=self.n)
        out = []
        for i in indices:
            p = self.prompts[i]
            out.append(dataclasses.replace(
                base, max_new_tokens=int(p.row.get("max_new_tokens", base.max_new_tokens)),
                ignore_eos=bool(p.row.get("ignore_eos", base.ignore_eos)),
                seed=None if greedy else eval_seed(self.seed, step, p.index, self.n)))
        return out


def eval_source(cfg) -> tuple[str, list[str | None]]:
    """(source, splits to try in order): eval.source, else data.source; a built-in task has no split ([None])."""
    e = cfg.eval
    source = e.source if e.source is not None else cfg.data.source
    if source.startswith("builtin:"):
        return source, [None]
    if e.split is not None:
        return source, [e.split]
    if e.source is None:
        # A validation split of the training source: never the split it trains on.
        return source, [s for s in VALIDATION_SPLITS if s != cfg.data.split]
    return source, [*VALIDATION_SPLITS, "train"]   # a file given for evaluation: its held-out split, else all of it


def eval_rows(cfg, tokenizer) -> tuple[list[dict], str]:
    """The evaluation rows (checked like training rows) and a label of where they came from; DataError naming the
    eval field and the fix."""
    source, splits = eval_source(cfg)
    if splits == [None]:
        return load_rows(source, cfg.data.max_operand, cfg.experiment.seed), source
    if cfg.eval.source is None and not Path(source).is_dir():
        raise DataError(f"eval.source: data.source {source!r} is one file, which has no validation split; set "
                        "eval.source to a file or folder of held-out prompts (or to data.source itself to evaluate "
                        "on the training prompts)")
    spec = DataSpec.from_config(cfg, _answer_needed_by(cfg))
    tried, known = [], ""
    for split in splits:
        try:
            rows = prepare_rows(dataclasses.replace(spec, source=source, split=split), tokenizer)
        except DataError as e:
            if f"has no split {split!r}" in str(e):
                tried.append(split)
                known = str(e).partition("its splits: ")[2].partition(";")[0] or known
                continue
            raise DataError("\n".join(f"eval.source ({source}, split {split}): {line}"
                                      for line in str(e).splitlines())) from None
        return rows, source if Path(source).is_file() else f"{source} (split {split})"   # one file is one split
    field = "eval.split" if cfg.eval.split is not None else "eval.source"
    raise DataError(f"{field}: {source!r} has no split {' or '.join(map(repr, tried))} (its splits: {known or '?'}); "
                    "set eval.split to one of them, or eval.source to held-out prompts")


def eval_set_for(cfg, tokenizer) -> EvalSet | None:
    """The run's EvalSet, or None when evaluation is off. Raises DataError (every problem at once) before Ray."""
    e = cfg.eval
    if not e.enabled:
        return None
    rows, label = eval_rows(cfg, tokenizer)
    problems = token_problems(rows, tokenizer, cfg.data.max_prompt_tokens, f"the eval source {label}",
                              builtin=cfg.model.path.startswith("builtin:"))
    if problems:
        raise DataError("\n".join(problems))
    keep = select_prompts(len(rows), e.max_prompts, cfg.experiment.seed)
    ids = tokenizer([rows[i]["prompt"] for i in keep], add_special_tokens=False).input_ids
    prompts = [EvalPrompt(j, list(t), rows[i]) for j, (i, t) in enumerate(zip(keep, ids))]
    final = e.final if e.final is not None else e.every > 0
    logger.info("evaluation: %d prompts of %s, %s, every %s steps%s", len(prompts), label,
                "greedy" if e.n == 1 else f"{e.n} samples at temperature {e.temperature}", e.every or "-",
                " and after the last" if final else "")
    return EvalSet(prompts, label, e.every, final, e.n, e.temperature, e.pass_threshold, cfg.experiment.seed)


def last_eval(records: list[dict]) -> dict | None:
    """{"step": s, eval/...} of the last record holding an evaluation (summary.json's "eval"), or None."""
    for rec in reversed(records):
        if "eval/reward_mean" in rec:
            return {"step": rec.get("step"), **{k: v for k, v in rec.items() if k.startswith("eval/")}}
    return None
