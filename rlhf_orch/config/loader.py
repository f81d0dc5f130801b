"""Load an experiment config: YAML file + `section.key=value` overrides -> validated ExperimentConfig.

Every problem found is reported at once as one `ConfigError` whose lines each name the field and the
fix: malformed YAML (with line and column), unknown keys (with the valid ones), wrong types, unknown
engine kinds, cross-field rules, a reward function that does not import or has the wrong
signature, and a dataset whose rows do not fit the config (rlhf_orch/data/prepare.py). Nothing here starts
Ray or touches a device.
"""
from __future__ import annotations

import difflib
import inspect
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlhf_orch.config.schema import ENGINE_KINDS, ExperimentConfig
from rlhf_orch.errors import ConfigError, RewardError


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
        from rlhf_orch.rewards import NO_FUNCTION, is_dense
        if is_dense(fn):
            cfg.reward.dense = True      # decorated: every part of the run (manager, workers, checks) reads the field
        if cfg.reward.dense and cfg.reward.function == NO_FUNCTION:
            problems.append("reward.dense: true needs a reward.function that returns one value per response token "
                            "(a reward model scores whole responses); set reward.function or drop reward.dense")
    except RewardError as e:
        problems.append(f"reward.function: {e}")
    from rlhf_orch.data import dataset_problems   # reads, renders and checks data.source's rows (and keeps them)
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
    """Apply `a.b.c=value` (value parsed as YAML; list entries addressed by index, e.g. engines.0.count=2)."""
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise ValueError(f"override {override!r}: expected section.key=value, e.g. trainer.lr=1e-4")
    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    parts = key.split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ValueError(f"override {override!r}: {'.'.join(parts[:i])} has {len(node)} entries; index {part} does not exist")
            node = node[int(part)]
            continue
        if part not in node or node[part] is None:
            node[part] = [] if nxt.isdigit() else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ValueError(f"override {override!r}: index {last} does not exist")
        node[int(last)] = parsed
    else:
        node[last] = parsed


def format_validation_error(err: ValidationError, raw: dict) -> list[str]:
    """One line per pydantic error, naming the dotted field and what to do."""
    lines: list[str] = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(x) for x in e["loc"] if not _is_union_tag(x))
        kind = e["type"]
        if kind == "extra_forbidden":
            lines.append(f"{loc}: unknown key; {_suggest(loc)}")
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


def _suggest(loc: str) -> str:
    """Name the valid keys of the section that holds `loc`, with the closest match first."""
    parts = loc.split(".")
    model: type[BaseModel] | None = ExperimentConfig
    for part in parts[:-1]:
        if model is None or part.isdigit():
            continue
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    if model is None:
        return "remove it"
    valid = sorted(model.model_fields)
    close = difflib.get_close_matches(parts[-1], valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}valid keys here: {', '.join(valid)}"


def load_reward_fn(path: str):
    """Import `package.module:function` and check it can be called as fn(response, row)."""
    import importlib

    mod_name, sep, fn_name = path.partition(":")
    if not sep or not mod_name or not fn_name:
        raise RewardError(f"{path!r} is not of the form 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # any import-time failure of user code is a config problem
        raise RewardError(f"cannot import module {mod_name!r} ({type(e).__name__}: {e}); check the path and that it is on PYTHONPATH") from None
    fn = getattr(mod, fn_name, None)
    if fn is None or not callable(fn):
        raise RewardError(f"module {mod_name!r} has no function {fn_name!r}")
    try:
        inspect.signature(fn).bind("response", {"prompt": "p"})
    except TypeError:
        raise RewardError(f"{path} must accept (response: str, row: dict) and return a float") from None
    except ValueError:
        pass  # builtins without a signature: trust them
    return fn
