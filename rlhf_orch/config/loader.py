"""Load an experiment config: YAML file + overrides -> validated ExperimentConfig.

Overrides are written as Hydra writes them: `section.key=value` sets, `~section.key` removes a key (so a
shipped config's option can be dropped), and a bare item for a list-valued field is a list of one.
Every problem found is reported at once as one `ConfigError` whose lines each name the field and the
fix: malformed YAML (with line and column), unknown keys (with "did you mean" and the valid ones, nested
keys and each engine kind's own keys included), wrong types, unknown engine kinds, cross-field rules, a
reward function that does not import or has the wrong signature, and a dataset whose rows do not fit the
config (rlhf_orch/data/prepare.py). `resolved_config` / `config_yaml` give the validated config back as the
YAML `rlhf-orch print-config` shows. Nothing here starts Ray or touches a device.
"""
from __future__ import annotations

import difflib
import types
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from rlhf_orch.config.engines import ENGINE_KINDS
from rlhf_orch.config.schema import ExperimentConfig
from rlhf_orch.errors import ConfigError, RewardError
from rlhf_orch.rewards import NO_FUNCTION, is_dense, load_reward_fn


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read `path` (or start empty), apply overrides, validate; raise ConfigError listing every problem."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(path)
    problems: list[str] = []
    for ov in overrides or []:
        try:
            apply_override(raw, ov)
        except ValueError as e:
            problems.append(str(e))
    try:
        cfg = ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(problems + format_validation_error(e, raw)) from None
    try:
        fn = load_reward_fn(cfg.reward.function)
        if is_dense(fn):
            cfg.reward.dense = True      # decorated: every part of the run (manager, workers, checks) reads the field
        if cfg.reward.dense and cfg.reward.function == NO_FUNCTION:
            problems.append("reward.dense: true needs a reward.function that returns one value per response token "
                            "(a reward model scores whole responses); set reward.function or drop reward.dense")
    except RewardError as e:
        problems.append(f"reward.function: {e}")
    # Reads, renders and checks data.source's rows (and keeps them). Imported here: rlhf_orch.data brings torch
    # in, and importing rlhf_orch.config (the schema for `rlhf-orch --help`) must not.
    from rlhf_orch.data import dataset_problems
    problems.extend(dataset_problems(cfg))
    if problems:
        raise ConfigError(problems)
    return cfg


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: file {str(p)!r} not found; pass the path of a YAML file such as configs/tiny_cpu.yaml")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{p}: malformed YAML{where}: {problem}; fix the syntax (indentation, ':' after keys, quotes)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections (experiment:, trainer:, engines: ...), not a {type(data).__name__}")
    return data


def apply_override(raw: dict, override: str) -> None:
    """Apply one command-line override to the raw (not yet validated) config, as Hydra writes them:

    - `a.b.c=value`: set (value parsed as YAML; list entries addressed by index, e.g. engines.0.count=2). A bare
      item for a list-valued field is that list's one item: `metrics.trackers=wandb` is `[wandb]`.
      `+a.b=value` and `++a.b=value` (Hydra's add / force-add) mean the same here: every key can be set.
    - `~a.b.c`: remove the key, so the field takes its default (or, for an option that does not apply, is
      absent); `~a.b.c=value` removes it only if it holds that value. Removing a key the config does not
      have is an error naming it.
    Raises ValueError with one line naming the override and the fix.
    """
    text = override
    delete = text.startswith("~")
    text = text[1:] if delete else text.lstrip("+")
    key, sep, value = text.partition("=")
    if not key or (not sep and not delete):
        raise ValueError(f"override {override!r}: expected section.key=value (e.g. trainer.lr=1e-4), or ~section.key "
                         f"to remove a key (e.g. ~data.max_operand)")
    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    parts = key.split(".")
    if delete:
        _delete(raw, parts, parsed if sep else _MISSING, override)
        return
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ValueError(f"override {override!r}: {'.'.join(parts[:i])} has {len(node)} entries; index {part} does not exist")
            node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise ValueError(f"override {override!r}: {'.'.join(parts[:i])} is a value ({node!r}), not a section "
                             f"with keys; set it with {'.'.join(parts[:i])}=...")
        if part not in node or node[part] is None:
            node[part] = [] if nxt.isdigit() else {}
        node = node[part]
    last = parts[-1]
    if not isinstance(parsed, list) and parsed is not None and parsed != "" and _is_list_field(parts, raw):
        parsed = [parsed]   # a bare item for a list-valued field: `metrics.trackers=wandb` is [wandb]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ValueError(f"override {override!r}: index {last} does not exist")
        node[int(last)] = parsed
    elif isinstance(node, dict):
        node[last] = parsed
    else:
        where = ".".join(parts[:-1])
        raise ValueError(f"override {override!r}: {where} is a value ({node!r}), not a section with keys; "
                         f"set it with {where}=...")


_MISSING = object()


def _delete(raw: dict, parts: list[str], expected: Any, override: str) -> None:
    """`~a.b.c` (or `~a.b.c=value`): remove the key from the raw config; ValueError naming it when it is not there."""
    node: Any = raw
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            found, holder, k = True, node, int(part)
        elif isinstance(node, dict) and part in node:
            found, holder, k = True, node, part
        else:
            found = False
        if not found:
            if isinstance(node, list):
                why = f"{'.'.join(parts[:i])} has {len(node)} entries; index {part} does not exist"
            elif isinstance(node, dict) and part in _valid_keys(parts[:i], raw):
                why = f"{here} is not set in the config, so it already has its default; there is nothing to remove"
            elif isinstance(node, dict):
                close = _closest(part, sorted(set(node) | set(_valid_keys(parts[:i], raw))))
                hint = f"; did you mean {'.'.join([*parts[:i], close])!r}?" if close else ""
                why = f"{here} is not in the config, so there is nothing to remove{hint}"
            else:
                why = f"{'.'.join(parts[:i])} is a value ({node!r}), not a section with keys"
            raise ValueError(f"override {override!r}: {why}")
        if i == len(parts) - 1:
            if expected is not _MISSING and holder[k] != expected:
                raise ValueError(f"override {override!r}: {here} is {holder[k]!r}, not {expected!r}; write ~{here} "
                                 "to remove it whatever it holds")
            del holder[k]
            return
        node = holder[k]


def resolved_config(cfg: ExperimentConfig) -> dict:
    """Every field of `cfg` that applies to the run, defaults included, as plain data: what `rlhf-orch
    print-config` shows, and a config that load_config reads back to the same values. A default that the
    cross-field checks refuse when it is written out ("applies to ppo only ...; remove it") is left out, as
    the run ignores it; a field the user set always stays."""
    out = cfg.model_dump(mode="json")
    for _ in range(64):   # each pass drops the defaults the checks name (some name only a section's first field)
        try:
            ExperimentConfig.model_validate(out)
            return out
        except ValidationError as e:
            lines = format_validation_error(e, out)
        dropped = False
        for line in lines:
            path = line.split(":", 1)[0].strip().split(".")
            if _user_set(cfg, path):
                continue
            # A section none of whose fields the user set (critic: under grpo) goes as a whole: all defaults.
            if len(path) == 2 and not _user_set(cfg, path[:1]) and _pop(out, path[:1]):
                dropped = True
            elif _pop(out, path):
                dropped = True
        if not dropped:
            break
    return out


def config_yaml(cfg: ExperimentConfig) -> str:
    """resolved_config as YAML, sections in the schema's order."""
    return yaml.safe_dump(resolved_config(cfg), sort_keys=False, default_flow_style=False, width=120,
                          allow_unicode=True)


def _user_set(cfg: ExperimentConfig, path: list[str]) -> bool:
    """Whether the file or an override set the field at `path` (a default's value was not the user's choice)."""
    node: Any = cfg
    for part in path[:-1]:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, BaseModel) and part in type(node).model_fields:
            node = getattr(node, part)
        else:
            return True   # not a field path (a message about something else): keep everything
    if not isinstance(node, BaseModel) or path[-1] not in type(node).model_fields:
        return True
    value = getattr(node, path[-1])
    if isinstance(value, BaseModel) and value.model_fields_set:
        return True   # a section counts as the user's when any of its fields is
    return path[-1] in node.model_fields_set


def _pop(raw: dict, path: list[str]) -> bool:
    node = _raw_at(raw, path[:-1])
    if isinstance(node, dict) and path[-1] in node:
        del node[path[-1]]
        return True
    return False


def format_validation_error(err: ValidationError, raw: dict) -> list[str]:
    """One line per pydantic error, naming the dotted field and what to do."""
    lines: list[str] = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(x) for x in e["loc"] if not _is_union_tag(x))
        kind = e["type"]
        if kind == "extra_forbidden":
            lines.append(f"{loc}: unknown key; {_suggest([str(x) for x in e['loc'] if not _is_union_tag(x)], raw)}")
        elif kind == "list_type" and not isinstance(e.get("input"), (dict, list)):
            got = e.get("input")
            lines.append(f"{loc}: must be a list (got {got!r}); write it as [{'' if got is None else got}] in YAML, or "
                         f"{loc}={'' if got is None else got} on the command line (a bare item is a list of one)")
        elif kind in ("union_tag_invalid", "union_tag_not_found"):
            got = e.get("input", {}).get("kind") if isinstance(e.get("input"), dict) else None
            what = f"unknown engine kind {got!r}" if got is not None else "missing 'kind'"
            lines.append(f"{loc}.kind: {what}; use one of: {', '.join(ENGINE_KINDS)}")
        elif kind == "missing":
            lines.append(f"{loc}: required; add it to the config")
        elif kind == "value_error" and not e["loc"]:
            msg = str(e["msg"]).removeprefix("Value error, ")
            lines.extend(msg.splitlines())
        else:
            got = e.get("input")
            shown = f" (got {got!r})" if not isinstance(got, (dict, list)) else ""
            lines.append(f"{loc}: {e['msg']}{shown}")
    return lines


def _is_union_tag(x) -> bool:
    return isinstance(x, str) and x in ENGINE_KINDS


def _suggest(parts: list[str], raw: Any = None) -> str:
    """Name the valid keys of the section that holds `parts` (a dotted key split, list indices included), with the
    closest match first. `raw` (the loaded YAML) picks the engine class of `engines.N` by its `kind`."""
    valid = _valid_keys(parts[:-1], raw)
    if not valid:
        return "remove it"
    close = _closest(parts[-1], valid)
    hint = f"did you mean {close!r}? " if close else ""
    return f"{hint}valid keys here: {', '.join(valid)}"


def _closest(key: str, valid: list[str]) -> str | None:
    """The valid key `key` most likely meant: difflib's closest, else one it abbreviates (gpu_mem)."""
    close = difflib.get_close_matches(key, valid, n=1)
    if close:
        return close[0]
    starts = [v for v in valid if v.startswith(key) or (len(key) >= 3 and key in v)]
    return starts[0] if len(starts) == 1 else None


def _valid_keys(parts: list[str], raw: Any = None) -> list[str]:
    """The field names of the section at `parts` ([] when `parts` is not a section of the schema)."""
    model = _model_of(_annotation_at(parts, raw), _raw_at(raw, parts))
    return sorted(model.model_fields) if model is not None else []


def _is_list_field(parts: list[str], raw: Any) -> bool:
    ann = _strip_optional(_annotation_at(parts, raw))
    return get_origin(ann) is list


def _annotation_at(parts: list[str], raw: Any) -> Any:
    """The schema's type at the dotted key `parts` (ExperimentConfig for []), or None when it leaves the schema."""
    ann: Any = ExperimentConfig
    for i, part in enumerate(parts):
        ann = _strip_optional(ann)
        if get_origin(ann) is list:
            if not str(part).isdigit():
                return None
            ann = get_args(ann)[0]
            continue
        model = _model_of(ann, _raw_at(raw, parts[:i]))
        field = model.model_fields.get(str(part)) if model is not None else None
        if field is None:
            return None
        ann = field.annotation
    return ann


def _model_of(ann: Any, node: Any) -> type[BaseModel] | None:
    """The pydantic model `ann` stands for; of a union of models (the engine entries), the one whose `kind`
    literal is node['kind']."""
    ann = _strip_optional(ann)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    members = [a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
    kind = node.get("kind") if isinstance(node, dict) else None
    for m in members:
        f = m.model_fields.get("kind")
        if f is not None and kind in get_args(f.annotation):
            return m
    return None


def _strip_optional(ann: Any) -> Any:
    """`X | None` -> X and `Annotated[X, ...]` -> X (a union of several types stays as it is)."""
    while True:
        if get_origin(ann) is Annotated:
            ann = get_args(ann)[0]
            continue
        if get_origin(ann) in (Union, types.UnionType):
            rest = [a for a in get_args(ann) if a is not type(None)]
            if len(rest) == 1:
                ann = rest[0]
                continue
        return ann


def _raw_at(raw: Any, parts: list[str]) -> Any:
    node = raw
    for part in parts:
        if isinstance(node, dict):
            node = node.get(str(part))
        elif isinstance(node, list) and str(part).isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
