"""The metric names a Grafana dashboard's PromQL uses, read out of its JSON (tests of dashboards/rlhf_orch.json).

`dashboard_metrics` walks every panel target's `expr` (rows and nested panels included) and every query variable
(`label_values(<selector>, label)`) and returns the plain metric names and the `__name__=~"regex"` patterns they
select. It is a small reader of the PromQL a dashboard uses, not a PromQL parser: strings, label matchers, range
and subquery brackets, and grouping clauses are removed first, then every identifier not followed by "(" that is not
a keyword is a metric name.
"""
from __future__ import annotations

import ast
import re

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME_MATCHER = re.compile(r"__name__\s*(=~|!~|!=|=)\s*\"(\d+)\"")
_IDENT = re.compile(r"(?<![\w.$:])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless",
             "atan2", "inf", "nan", "start", "end"}
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*[a-zA-Z_]\w*\s*\)\s*$", re.S)


def promql_metrics(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, __name__ regex patterns) of one PromQL expression."""
    strings: list[str] = []

    def hold(m: re.Match) -> str:      # strings out of the way: a regex may hold braces, a label value anything
        strings.append(m.group(0))
        return f'"{len(strings) - 1}"'

    text = _STRING.sub(hold, expr)
    names, patterns = set(), set()
    for block in _BRACES.findall(text):
        for op, index in _NAME_MATCHER.findall(block):
            value = ast.literal_eval(strings[int(index)]) if strings[int(index)][0] != "`" else strings[int(index)][1:-1]
            if op == "=":
                names.add(value)
            elif op == "=~":
                patterns.add(value)
    text = _BRACES.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r'"\d+"', " ", text)
    names.update(t for t in _IDENT.findall(text) if t not in _KEYWORDS)
    return names, patterns


def _queries(node, in_templating: bool = False):
    """Every PromQL string of a dashboard: panel targets' expr, and query variables' query."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif in_templating and key == "query" and node.get("type") == "query":
                query = value.get("query") if isinstance(value, dict) else value
                if isinstance(query, str):
                    m = _LABEL_VALUES.match(query)
                    if m:
                        yield m.group(1)
                    elif not query.lstrip().startswith(("label_names(", "query_result(")):
                        yield query
            else:
                yield from _queries(value, in_templating or key == "templating")
    elif isinstance(node, list):
        for item in node:
            yield from _queries(item, in_templating)


def dashboard_metrics(dashboard: dict) -> tuple[set[str], set[str]]:
    """(metric names, __name__ regex patterns) of every query in a Grafana dashboard JSON."""
    names, patterns = set(), set()
    for expr in _queries(dashboard):
        n, p = promql_metrics(expr)
        names |= n
        patterns |= p
    return names, patterns


def not_exported(dashboard: dict, exported: set[str], ignore=lambda name: False) -> list[str]:
    """What the dashboard asks for that `exported` lacks: names, and patterns that match no exported name.
    `ignore(name_or_pattern)`: those left out (metrics the run cannot produce, e.g. CUDA-only ones on CPU)."""
    names, patterns = dashboard_metrics(dashboard)
    missing = [n for n in sorted(names) if n not in exported and not ignore(n)]
    missing += [f"{{__name__=~{p!r}}}" for p in sorted(patterns)
                if not ignore(p) and not any(re.fullmatch(p, e) for e in exported)]
    return missing
