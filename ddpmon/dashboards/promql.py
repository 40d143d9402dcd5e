"""Which metrics a PromQL expression reads, checked against ddpmon's metric catalog.

The boards and the alert rules may use only names from ddpmon/metrics/catalog.py (and the few
series Prometheus makes itself); checking each expression when it is written turns a renamed
metric into an error that names it, instead of an empty panel.
"""

from __future__ import annotations

import re

from ..metrics import catalog

PROMETHEUS_OWN = frozenset({"up", "ALERTS"})
"""Series that Prometheus itself makes and the boards and rules may use besides the catalog
(``ALERTS``: a rule quiet while another alert stands)."""

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_VARIABLES = re.compile(r"\$\{[^}]*\}|\$\w+")
_IDENT = re.compile(r"(?<![\w.:$])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "inf",
        "nan",
        "atan2",
    }
)
_RATE_FUNCS = re.compile(r"\b(?:rate|irate|increase|resets)\s*\(\s*([A-Za-z_:][\w:]*)")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.*?)\s*,\s*(\w+)\s*\)\s*$", re.S)
_HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (Grafana variables allowed) reads.

    Strings, label matchers, ranges, grouping clauses and function calls are taken out;
    what is left that looks like an identifier and is not a keyword is a metric name.
    """
    label_values = _LABEL_VALUES.match(expr)
    if label_values:  # Grafana's variable query: label_values(selector, label)
        expr = label_values.group(1)
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _VARIABLES.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        name, call = match.group(1), match.group(2)
        if call or name in _KEYWORDS:
            continue
        names.add(name)
    return names


def check_expr(expr: str) -> set[str]:
    """Raise ValueError when ``expr`` reads a metric that is not in the catalog, or takes a
    rate of something that is not a counter; return the names it reads."""
    names = metric_names(expr)
    known = catalog.series_names() | catalog.RECORD_NAMES | PROMETHEUS_OWN
    unknown = sorted(names - known)
    if unknown:
        raise ValueError(
            f"{unknown[0]!r} in {expr!r} is not in ddpmon's metric catalog "
            "(ddpmon/metrics/catalog.py); use a catalog name or add it there first"
        )
    for name in _RATE_FUNCS.findall(_STRINGS.sub('""', expr)):
        if not _is_counter(name):
            raise ValueError(f"rate/increase of {name!r} in {expr!r}: it is not a counter")
    return names


def _is_counter(name: str) -> bool:
    for suffix in ("_bucket", "_sum", "_count"):
        base = name[: -len(suffix)]
        if (
            name.endswith(suffix)
            and base in catalog.BY_NAME
            and catalog.BY_NAME[base].kind == "histogram"
        ):
            return True
    spec = catalog.BY_NAME.get(name)
    return spec is not None and spec.kind == "counter"


def source_of(expr: str) -> set[str]:
    """Where the series an expression reads come from: rank, gpu, host, daemon, prometheus,
    recorded (a recording rule's)."""
    out = set()
    for name in metric_names(expr):
        if name in PROMETHEUS_OWN:
            out.add("prometheus")
            continue
        if name in catalog.RECORD_NAMES:
            out.add("recorded")
            continue
        spec = catalog.BY_NAME.get(name) or catalog.BY_NAME.get(_HISTOGRAM_SERIES.sub("", name))
        if spec is not None:
            out.add(spec.source)
    return out
