"""Metric families from plain samples: the one place a sample becomes Prometheus' type.

Everything else in ddpmon produces plain ``Sample`` tuples ``(name, labels, value)`` named
from the catalog; this module turns them into metric families, typed and documented by the
catalog, so a scrape costs nothing until Prometheus asks. The rank's collector
(``rank/exporter.py``) and the node daemon both build their families here; ``httpd.py``
serves them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from . import catalog

Sample = tuple[str, dict[str, str], float]
SampleSource = Callable[[], Iterable[Sample]]

Family = Metric  # a metric family, as prometheus_client builds and exposes it


def families(samples: Iterable[Sample]) -> list[Family]:
    """Group plain samples into metric families, typed and documented by the catalog."""
    by_name: dict[str, Family] = {}
    for name, labels, value in samples:
        family = by_name.get(name)
        if family is None:
            spec = catalog.get(name)
            cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            family = by_name[name] = cls(name, spec.help, labels=list(labels))
        family.add_metric([str(v) for v in labels.values()], value)  # type: ignore[attr-defined]
    return list(by_name.values())


def state_set(
    name: str, labels: dict[str, str], label: str, states: Iterable[str], current: str
) -> list[Sample]:
    """A state set (Prometheus' convention for an enumeration): one sample per state, under
    ``label``, 1 for ``current`` and 0 for the others, so a change moves no series."""
    return [(name, {**labels, label: state}, 1.0 if state == current else 0.0) for state in states]


def histogram(name: str, label_names: list[str], label_values: list[str], h: Any) -> Family:
    """One histogram family of one series; ``h`` has ``cumulative()`` and ``sum``
    (``rank.books.Histogram``)."""
    family = histogram_family(name, label_names)
    family.add_metric(label_values, h.cumulative(), h.sum)
    return family


def histogram_family(name: str, label_names: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, catalog.get(name).help, labels=label_names)


def summary(fams: Iterable[Family]) -> Iterator[Family]:
    """What ``metrics_detail="summary"`` keeps of ``fams``: the families the catalog marks
    ``summary``, a histogram with only its ``summary_bounds`` (and ``+Inf``, sum, count)."""
    for family in fams:
        spec = catalog.BY_NAME.get(family.name) or catalog.BY_NAME.get(family.name + "_total")
        if spec is None or not spec.summary:
            continue
        if spec.kind == "histogram":
            kept = {*spec.summary_bounds, math.inf}
            family.samples = [
                s
                for s in family.samples
                if not s.name.endswith("_bucket") or float(s.labels["le"]) in kept
            ]
        yield family
