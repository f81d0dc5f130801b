"""Turn raw records into dataset rows: find the prompt and the answer by dotted keys, render chat prompts.

A row keeps every original column and gets "prompt" (the text the engines continue: a plain string as
given, or chat messages rendered with the tokenizer's chat template, `add_generation_prompt=True`) and
"answer" (the value at `answer_key`, as a string; with rollout.agent a prompt given as chat messages is also kept as
"messages", for agent functions), so rule rewards such as
`rlhf_orch.rewards.builtin:exact_match` work on any layout (verl's GSM8K parquet: `prompt` is a list of
messages, the answer is `reward_model.ground_truth`). A JSONL file of string prompts with the default
keys gives back its rows exactly as parsed (the format this project started with).

Every bad row is reported at once (the first 20 lines), each naming the row and the fix; a prompt that is
empty or only whitespace (a string, or messages without text) is a bad row. This module does
not read files (sources.py), tokenize for length or unknown characters (prepare.py) or know about Ray.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlhf_orch.data.sources import BadLine, RawRows
from rlhf_orch.errors import DataError

MAX_SHOWN = 20
_MISSING = object()


@dataclass(frozen=True)
class DataSpec:
    """How to read a file source (the file-related fields of the config's `data` section)."""

    source: str
    split: str = "train"
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    system_prompt: str | None = None
    chat_template: bool = False           # wrap string prompts as one user message and render them
    chat_template_path: str | None = None
    answer_needed_by: str | None = None   # why every row needs an answer (None: rows without one are fine)
    model_path: str = "the model"         # named in messages about the tokenizer
    keep_messages: bool = False           # rollout.agent: a chat-message prompt is also kept as row["messages"]

    @classmethod
    def from_config(cls, cfg, answer_needed_by: str | None = None) -> "DataSpec":
        d = cfg.data
        return cls(source=d.source, split=d.split, prompt_key=d.prompt_key, answer_key=d.answer_key,
                   system_prompt=d.system_prompt, chat_template=d.chat_template,
                   chat_template_path=d.chat_template_path, answer_needed_by=answer_needed_by,
                   model_path=cfg.model.path, keep_messages=cfg.rollout.agent is not None)


def lookup(record, key: str):
    """The value at dotted `key` ('reward_model.ground_truth', 'prompt.0.content'), or _MISSING.
    None counts as missing: Arrow-backed formats fill absent fields with None."""
    if isinstance(record, dict) and key in record:   # a column whose name itself has a dot
        return _MISSING if record[key] is None else record[key]
    node = record
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
        if node is None:
            return _MISSING
    return node


def describe_missing(record, key: str) -> str:
    """Which part of `key` is missing and which keys exist there, e.g. "reward_model has keys: style"."""
    node, seen = record, []
    for part in key.split("."):
        here = ".".join(seen) or "the row"
        if isinstance(node, dict):
            if node.get(part) is None:
                keys = ", ".join(sorted(k for k, v in node.items() if v is not None)) or "none"
                return f"{here} has keys: {keys}"
            node = node[part]
        elif isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                return f"{here} is a list of {len(node)} items"
            node = node[int(part)]
        else:
            return f"{here} is a {type(node).__name__}, not a mapping"
        seen.append(part)
    return "found"


class ChatRenderer:
    """Renders message lists with the tokenizer's chat template (or `chat_template_path`'s)."""

    def __init__(self, spec: DataSpec, tokenizer):
        self.spec, self.tokenizer = spec, tokenizer
        self.template = None
        if spec.chat_template_path:
            self.template = Path(spec.chat_template_path).read_text(encoding="utf-8")
        elif tokenizer is not None:
            self.template = getattr(tokenizer, "chat_template", None) or None
        self.used = False

    def missing_template(self, why: str) -> str:
        if self.tokenizer is None:
            return (f"{why}, and rendering chat needs the model's tokenizer; load the experiment with "
                    "rlhf_orch.config.load_config (it prepares file sources) or call rlhf_orch.data.prepare_rows(spec, tokenizer)")
        return (f"{why}, but the tokenizer of model.path {self.spec.model_path!r} has no chat template; set "
                "data.chat_template_path to a Jinja template file (e.g. examples/tiny_chat_template.jinja) or use a "
                "model whose tokenizer has one")

    def render(self, messages: list[dict]) -> str:
        if self.spec.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.spec.system_prompt}, *messages]
        self.used = True
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  chat_template=self.template)


def messages_problem(value) -> tuple[list[dict] | None, str | None]:
    """A list of {role, content} messages (None-valued fields dropped), or why it is not one."""
    if not value:
        return None, "is an empty list of chat messages"
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None, (f"message {j} is not a {{\"role\": str, \"content\": str}} mapping "
                          f"(got {type(m).__name__}{': keys ' + ', '.join(m) if isinstance(m, dict) else ''})")
        out.append({k: v for k, v in m.items() if v is not None})
    return out, None


def build_rows(raw: RawRows, spec: DataSpec, tokenizer=None) -> list[dict]:
    """Rows of `raw` under `spec`; raises DataError with one line per problem (per-row ones capped at 20)."""
    legacy = raw.fmt == "jsonl"
    problems, rows = [], []           # per-row problems in file order
    renderer = ChatRenderer(spec, tokenizer)
    no_prompt, no_answer, need_template, string_prompts = [], [], [], 0
    template_error = None
    for record, where in zip(raw.records, raw.where):
        if isinstance(record, BadLine):
            problems.append(record.message)
            continue
        if not isinstance(record, dict):
            problems.append(f"{where}: row is a {type(record).__name__}, not a JSON object with a "
                            f"{spec.prompt_key!r} field")
            continue
        value = lookup(record, spec.prompt_key)
        if value is _MISSING:
            no_prompt.append((len(problems), record))
            problems.append(f"{where}: " + _missing_line(record, spec.prompt_key, "prompt_key", None))
            continue
        if isinstance(value, str):
            if not value:
                problems.append(f"{where}: {spec.prompt_key!r} must be a non-empty string or a list of chat messages")
                continue
            if not value.strip():   # a model would be trained on continuing nothing: refuse it like an empty one
                problems.append(f"{where}: {spec.prompt_key!r} is only whitespace ({value!r}); give the row a prompt "
                                "with text, or remove the row")
                continue
            string_prompts += 1
            messages = [{"role": "user", "content": value}] if spec.chat_template else None
        elif isinstance(value, list):
            messages, why = messages_problem(value)
            if not why and not any(m["content"].strip() for m in messages):
                why = ("is chat messages whose content is all empty or whitespace; give a message text, or remove "
                       "the row")
            if why:
                problems.append(f"{where}: {spec.prompt_key!r} {why}")
                continue
        else:
            problems.append(f"{where}: {spec.prompt_key!r} must be a non-empty string or a list of chat messages "
                            f"({{\"role\", \"content\"}}), got {type(value).__name__}")
            continue
        text = value
        if messages is not None:
            if renderer.template is None:
                need_template.append(where)
                continue
            try:
                text = renderer.render(messages)
            except Exception as e:   # a Jinja error (e.g. the template's raise_exception): the row and the reason
                template_error = template_error or f"{where}: the chat template failed on this row ({type(e).__name__}: {e})"
                continue
            if not text:
                problems.append(f"{where}: the chat template rendered an empty prompt")
                continue
        problem = _extra_fields_problem(record, legacy)
        if problem:
            problems.append(f"{where}: {problem}")
            continue
        answer = lookup(record, spec.answer_key)
        if answer is _MISSING and spec.answer_needed_by:
            no_answer.append((len(problems), record))
            problems.append(f"{where}: " + _missing_line(record, spec.answer_key, "answer_key", spec.answer_needed_by))
            continue
        if spec.prompt_key != "prompt" or text is not value:
            record["prompt"] = text
        if spec.keep_messages and isinstance(value, list) and "messages" not in record:
            record["messages"] = value   # an agent's chat() starts from them (builtin:tool_chat; rollout/agent.py)
        if answer is not _MISSING and not (legacy and spec.answer_key == "answer"):   # JSONL rows stay as parsed
            record["answer"] = answer if isinstance(answer, str) else str(answer)
        rows.append(record)
    n = len(raw.records)
    for missing, key, field, needed_by in ((no_prompt, spec.prompt_key, "prompt_key", None),
                                           (no_answer, spec.answer_key, "answer_key", spec.answer_needed_by)):
        if n > 1 and len(missing) == n:   # a wrong key rather than a few bad rows: say it once
            drop = {i for i, _ in missing}
            problems = [p for i, p in enumerate(problems) if i not in drop]
            why = f" ({needed_by})" if needed_by else ""
            problems.insert(0, f"data.{field}: {key!r} is in no row of {spec.source} ({describe_missing(missing[0][1], key)}); "
                               f"set data.{field} to the field that holds it (dotted for nested fields, e.g. "
                               f"reward_model.ground_truth){why}")
            break   # with no prompt found, no row got as far as its answer
    head = []
    if need_template:
        why = ("data.chat_template is true" if string_prompts and spec.chat_template else
               f"data.prompt_key: {spec.prompt_key!r} holds chat messages (a list of {{role, content}}) in "
               f"{len(need_template)} rows of {spec.source} (first: {need_template[0]})")
        head.append(renderer.missing_template(why))
    if template_error:
        head.append(f"data.chat_template_path: {template_error}" if spec.chat_template_path else template_error)
    if spec.system_prompt and string_prompts and not spec.chat_template:
        head.append(f"data.system_prompt: {string_prompts} prompts at data.prompt_key {spec.prompt_key!r} are plain "
                    "strings, which get no system message; set data.chat_template: true to render them as chat")
    if spec.chat_template_path and not renderer.used and not need_template and not template_error and rows:
        head.append("data.chat_template_path: no prompt is rendered with it (the prompts are plain strings); set "
                    "data.chat_template: true to wrap them as user messages, or remove data.chat_template_path")
    if problems or head:
        shown = problems[:MAX_SHOWN] + ([f"... and {len(problems) - MAX_SHOWN} more bad rows"]
                                        if len(problems) > MAX_SHOWN else [])
        raise DataError("\n".join(head + shown))
    if not rows:
        raise DataError(f"data.source: {spec.source!r} has no rows; add lines like "
                        "{\"prompt\": \"2+2=\", \"answer\": \"4\"}")
    return rows


def _missing_line(record: dict, key: str, field: str, needed_by: str | None) -> str:
    if key == "prompt":   # the message JSONL users have always seen
        return f"row has no 'prompt' field (keys: {', '.join(sorted(record)) or 'none'}); add \"prompt\": \"...\""
    why = f" ({needed_by})" if needed_by else ""
    return f"row has no {key!r} ({describe_missing(record, key)}); add it, or set data.{field}{why}"


def _extra_fields_problem(row: dict, legacy: bool) -> str | None:
    """Per-row sampling bounds. Arrow-backed rows carry None where a row has no value: those are dropped."""
    if not legacy:
        for k in ("max_new_tokens", "ignore_eos"):
            if k in row and row[k] is None:
                del row[k]
    m = row.get("max_new_tokens")
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        return f"'max_new_tokens' must be a positive integer (this prompt's response bound), got {m!r}"
    if "ignore_eos" in row and not isinstance(row["ignore_eos"], bool):
        return f"'ignore_eos' must be true or false, got {row['ignore_eos']!r}"
    return None
