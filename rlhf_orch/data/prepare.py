"""Prepare a file dataset when the config loads: read, render, tokenize-check, and keep the rows for load_rows.

`dataset_problems(cfg)` is what config loading calls (rlhf_orch/config/loader.py): for a file source it
reads every row, renders chat prompts with the model's tokenizer (the built-in character tokenizer, or the
model folder's), and checks what only the data can tell: keys that are missing, prompts longer than
data.max_prompt_tokens, characters the tokenizer cannot encode (it would map them to <unk> silently), fewer
rows than data.prompts_per_step, rows without an answer where the warm start or a built-in reward needs one.
Each problem is one line naming the field and the fix, reported with the rest of the config's problems
before Ray or any actor starts.

The rows it made are kept in this process under the data section they were made for, so `rows_for(cfg)`
(launch.py) returns exactly them without reading the file again; a config whose data section differs is
prepared afresh. Built-in tasks are not touched here beyond counting their rows.
"""
from __future__ import annotations

from rlhf_orch.data.rows import DataSpec, build_rows
from rlhf_orch.data.sources import read_records
from rlhf_orch.data.tasks import TASKS, arithmetic_rows
from rlhf_orch.errors import DataError
from rlhf_orch.models.tiny import build_tokenizer
from rlhf_orch.rollout.agent_specs import row_agent_problems

_PREPARED: dict[DataSpec, list[dict]] = {}   # the data section's file fields -> rows (the driver only)
ANSWER_REWARDS = "rlhf_orch.rewards.builtin:"   # every built-in rule reward reads row["answer"]


def prepare_rows(spec: DataSpec, tokenizer=None) -> list[dict]:
    """Rows of the file source `spec.source`; chat prompts need `tokenizer`. Raises DataError (all problems)."""
    return build_rows(read_records(spec.source, spec.split), spec, tokenizer)


def load_rows(source: str, max_operand: int = 9, seed: int = 0) -> list[dict]:
    """Rows of `source`: 'builtin:<task>', or a .jsonl/.json/.parquet/.arrow file or folder of them read with the
    defaults ("prompt" and "answer" fields, split "train", string prompts; `prepare.rows_for(cfg)` applies a
    config's data section). Raises DataError listing every bad row."""
    if source.startswith("builtin:"):
        task = source.removeprefix("builtin:")
        if task not in TASKS:
            raise DataError(f"data.source: unknown built-in task {task!r}; use one of: {', '.join('builtin:' + t for t in TASKS)}")
        return arithmetic_rows(max_operand, seed=seed) if task == "arithmetic" else TASKS[task](seed=seed)
    return prepare_rows(DataSpec(source=source))   # the defaults; launch.py uses prepare.rows_for(cfg)


def rows_for(cfg) -> list[dict]:
    """The rows of cfg.data: a built-in task's, or the file rows dataset_problems prepared for exactly this data
    section (prepared again if it has not, e.g. a config built without load_config)."""
    d = cfg.data
    if d.source.startswith("builtin:"):
        return load_rows(d.source, d.max_operand, cfg.experiment.seed)
    spec = DataSpec.from_config(cfg, _answer_needed_by(cfg))
    if spec not in _PREPARED:
        tokenizer, problem = _tokenizer(cfg)
        if problem:
            raise DataError(problem)
        _PREPARED[spec] = prepare_rows(spec, tokenizer)
    return _PREPARED[spec]


def dataset_problems(cfg) -> list[str]:
    """Every problem of cfg.data that needs the rows; on success the rows are kept for load_rows."""
    d = cfg.data
    if d.source.startswith("builtin:"):
        try:
            n = len(load_rows(d.source, d.max_operand, cfg.experiment.seed))
        except DataError as e:
            return str(e).splitlines()
        return _count_problems(cfg, n)
    tokenizer, problem = _tokenizer(cfg)
    if problem:
        return [problem]
    spec = DataSpec.from_config(cfg, _answer_needed_by(cfg))
    try:
        rows = prepare_rows(spec, tokenizer)
    except DataError as e:
        return str(e).splitlines()
    problems = token_problems(rows, tokenizer, d.max_prompt_tokens, d.source,
                              builtin=cfg.model.path.startswith("builtin:")) + _count_problems(cfg, len(rows))
    problems += row_agent_problems(rows, cfg.rollout, d.agent_key, d.source)
    if not problems:
        _PREPARED[spec] = rows
    return problems


def token_problems(rows: list[dict], tokenizer, max_prompt_tokens: int, source: str, builtin: bool = False) -> list[str]:
    """Prompts over the token limit or empty, and prompts or answers with characters the tokenizer cannot encode."""
    p: list[str] = []
    prompts = [r["prompt"] for r in rows]
    ids = tokenizer(prompts, add_special_tokens=False).input_ids
    long = [i for i, x in enumerate(ids) if len(x) > max_prompt_tokens]
    if long:
        longest = max(len(ids[i]) for i in long)
        p.append(f"data.max_prompt_tokens: {len(long)} of {len(rows)} prompts of {source} are longer than "
                 f"{max_prompt_tokens} tokens (longest {longest}, first: row {long[0]}); raise data.max_prompt_tokens"
                 f"{' (and model.tiny.max_position_embeddings)' if builtin else ''} or shorten them")
    empty = [i for i, x in enumerate(ids) if not x]
    if empty:
        p.append(f"data.prompt_key: {len(empty)} prompts of {source} tokenize to zero tokens (first: row {empty[0]}); "
                 "check the rows and the tokenizer")
    unk = tokenizer.unk_token_id
    if unk is None:
        return p   # byte-level tokenizers encode every character
    answers = [(i, str(r["answer"])) for i, r in enumerate(rows) if "answer" in r]
    answer_ids = tokenizer([a for _, a in answers], add_special_tokens=False).input_ids if answers else []
    for field, what, texts, encoded in (
            ("data.prompt_key", "prompts", [(i, t) for i, t in enumerate(prompts)], ids),
            ("data.answer_key", "answers", answers, answer_ids)):
        bad = [(i, t) for (i, t), x in zip(texts, encoded) if unk in x]
        if not bad:
            continue
        chars = sorted({c for _, t in bad for c in set(t)
                        if unk in tokenizer(c, add_special_tokens=False).input_ids})
        shown = ", ".join(repr(c) for c in chars[:30]) + (f" and {len(chars) - 30} more" if len(chars) > 30 else "")
        known = ("; the built-in tokenizer knows only lowercase a-z, digits, space and + - * = ( ) ? : . ,"
                 if builtin else "")
        tail = "; a response could never match them" if what == "answers" else ""
        p.append(f"{field}: {len(bad)} {what} of {source} hold characters the tokenizer cannot encode "
                 f"({shown or 'some'}; first: row {bad[0][0]}), which would silently become "
                 f"{tokenizer.unk_token}{tail}; remove or replace them{known}")
    return p


def _count_problems(cfg, n: int) -> list[str]:
    if cfg.data.prompts_per_step > n:
        return [f"data.prompts_per_step: {cfg.data.prompts_per_step} prompts per step but {cfg.data.source} has "
                f"{n} rows, so a step would repeat prompts; set data.prompts_per_step to at most {n} or add rows"]
    return []


def _answer_needed_by(cfg) -> str | None:
    """Why every row needs an answer, or None when rows without one are fine."""
    if "answer_key" in cfg.data.model_fields_set:
        return "data.answer_key is set"
    if cfg.trainer.warm_start_steps:
        # Even the format-only warm start needs answers: it pairs each prompt with another row's answer.
        return ("trainer.warm_start_steps trains on rows' answers, even on the format only (warm_start_real_answers: "
                "false pairs each prompt with another row's answer); or set trainer.warm_start_steps: 0")
    if (cfg.reward.function or "").startswith(ANSWER_REWARDS):
        return f"reward.function {cfg.reward.function} reads row['answer']"
    return None


def _tokenizer(cfg):
    """(tokenizer, None) or (None, problem): the built-in character tokenizer, or the model folder's."""
    path = cfg.model.path
    if path.startswith("builtin:"):
        return build_tokenizer(), None
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path), None
    except Exception as e:   # a missing folder or one without tokenizer files
        return None, (f"model.path: cannot load a tokenizer from {path!r} ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}); data.source's prompts "
                      "are rendered and checked with it, so give a model folder that holds its tokenizer")
