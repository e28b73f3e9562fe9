"""What PromQL expressions read, and what /metrics endpoints export, for checking
that the dashboard and the alert rules name only metrics the project exports.

`metric_names` is a small lexer, not a parser: promtool (which parses) checks that
each expression is valid; this only has to find the metric names in valid ones.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

# Words that precede a parenthesised list of labels, not an expression.
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
# Operators, modifiers and aggregations that may stand without parentheses after them.
KEYWORDS = GROUPING | {
    "and", "or", "unless", "bool", "offset", "atan2", "inf", "nan",
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
}  # fmt: skip
IDENT_START = re.compile(r"[A-Za-z_:]")
IDENT = re.compile(r"[A-Za-z0-9_:]*")
NAME_MATCHER = re.compile(r"""__name__\s*=\s*["']([A-Za-z_:][A-Za-z0-9_:]*)["']""")
# Grafana's variables, replaced by values PromQL accepts.
GRAFANA_VALUES = {
    "$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h",
    "$ttft_target": "2.0", "$tpot_target": "0.05",
}  # fmt: skip
GRAFANA_VARIABLE = re.compile(r"\$\{?(\w+)\}?")
LABEL_VALUES = re.compile(r"^label_values\((.*),\s*\w+\)$")
TYPE_LINE = re.compile(r"^# TYPE (\S+) (\w+)$", re.MULTILINE)
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "untyped": ("",),
    "info": ("_info",),
}


def _closing(text: str, start: int, close: str) -> int:
    """The index after the `close` that ends the group opened at `start` (strings
    inside it skipped)."""
    i = start + 1
    while i < len(text) and text[i] != close:
        i = _after_string(text, i) if text[i] in "\"'`" else i + 1
    return i + 1


def _after_string(text: str, start: int) -> int:
    quote, i = text[start], start + 1
    while i < len(text) and text[i] != quote:
        i += 2 if text[i] == "\\" and quote != "`" else 1
    return i + 1


def _next_char(text: str, i: int) -> str:
    while i < len(text) and text[i].isspace():
        i += 1
    return text[i] if i < len(text) else ""


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    names: set[str] = set()
    i = 0
    while i < len(expr):
        c = expr[i]
        if c in "\"'`":
            i = _after_string(expr, i)
        elif c == "{":
            end = _closing(expr, i, "}")
            names.update(NAME_MATCHER.findall(expr[i:end]))
            i = end
        elif c == "[":
            i = _closing(expr, i, "]")
        elif c == "#":
            end = expr.find("\n", i)
            i = len(expr) if end < 0 else end
        elif c == "$" or c.isdigit() or c == ".":
            i += 1
            while i < len(expr) and (expr[i].isalnum() or expr[i] in "_."):
                i += 1
        elif IDENT_START.match(c):
            rest = IDENT.match(expr, i + 1)
            word = c + (rest.group() if rest else "")
            i += len(word)
            following = _next_char(expr, i)
            if word in GROUPING and following == "(":
                i = _closing(expr, expr.index("(", i), ")")
            elif following != "(" and word.lower() not in KEYWORDS:
                names.add(word)
        else:
            i += 1
    return names


def exported_names(exposition: str) -> set[str]:
    """The sample names a /metrics page can carry, from its `# TYPE` lines (so that a
    labelled metric counts before its first sample)."""
    names: set[str] = set()
    for family, kind in TYPE_LINE.findall(exposition):
        base = family.removesuffix("_total") if kind == "counter" else family
        names.update(base + suffix for suffix in SUFFIXES.get(kind, ("",)))
    return names


def from_grafana(expr: str) -> str:
    """A dashboard query with Grafana's variables replaced (a selected variable
    becomes a regular expression that matches anything)."""
    for variable, value in GRAFANA_VALUES.items():
        expr = expr.replace(variable, value)
    return GRAFANA_VARIABLE.sub(".*", expr)


def dashboard_queries(path: Path) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every query of a Grafana dashboard: panel targets and the
    selectors of label_values() variables."""
    dashboard: dict[str, Any] = json.loads(path.read_text())
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else ""
        selector = LABEL_VALUES.match(text)
        if selector:
            yield f"variable {variable['name']}", from_grafana(selector.group(1))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", from_grafana(target["expr"])


def rule_queries(path: Path) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every rule of a Prometheus rules file."""
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            yield f"rule {rule.get('alert') or rule.get('record')}", rule["expr"]


def as_rules_file(queries: Iterator[tuple[str, str]]) -> dict[str, Any]:
    """Queries as recording rules, for promtool to parse."""
    rules = [{"record": f"check:query_{i}", "expr": q} for i, (_, q) in enumerate(queries)]
    return {"groups": [{"name": "queries", "rules": rules}]}
