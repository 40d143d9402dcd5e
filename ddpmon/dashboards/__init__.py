"""ddpmon's Grafana dashboards, generated from code.

The JSON in dashboards/ is the output of ``build()``; writing the boards in code rather than by
hand lets every PromQL expression be checked against the metric catalog when it is made, and
keeps panel ids, layout, units and descriptions consistent. Plain data only: no torch, no
Grafana client (``ddpmon dashboards push`` does the talking).

One concept per module:

- ``promql``: the metric names an expression reads, checked against ddpmon/metrics/catalog.py;
- ``model``: Grafana's JSON model (``Panel``/``Query``, panel JSON, layout, variables, envelope);
- ``boards``: the two boards, DDP job overview and DDP GPUs;
- ``kubernetes``: the dashboards ConfigMap and the PrometheusRule;
- ``files``: writing them, into a directory the user names or a source checkout's generated files.

Users write the boards with ``ddpmon dashboards export [DIR]``; after a change, developers
regenerate the checked-in files with ``make dashboards`` (``python -m tools.dashboards
--write-repo ROOT``).
"""

from __future__ import annotations

from .boards import BOARDS, build, gpus, overview
from .files import export, generated_files, source_root, stale_files, write_generated
from .kubernetes import configmap, prometheus_rule
from .model import (
    DATASOURCE,
    GRAFANA_VERSIONS,
    SCHEMA_VERSION,
    Panel,
    Query,
    panels,
    render,
)
from .promql import PROMETHEUS_OWN, check_expr, metric_names, source_of

__all__ = [
    "BOARDS",
    "DATASOURCE",
    "GRAFANA_VERSIONS",
    "PROMETHEUS_OWN",
    "SCHEMA_VERSION",
    "Panel",
    "Query",
    "build",
    "check_expr",
    "configmap",
    "export",
    "generated_files",
    "gpus",
    "metric_names",
    "overview",
    "panels",
    "prometheus_rule",
    "render",
    "source_of",
    "source_root",
    "stale_files",
    "write_generated",
]
