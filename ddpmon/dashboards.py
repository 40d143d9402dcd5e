"""ddpmon's Grafana dashboards, generated from code.

The JSON in dashboards/ is the output of ``build()``; writing the boards here rather than by
hand lets every PromQL expression be checked against the metric catalog when it is made, and
keeps panel ids, layout, units and descriptions consistent. Plain data only: no torch, no
Grafana client (``ddpmon dashboards push`` does the talking).

Regenerate the checked-in files after a change: ``python -m ddpmon.dashboards``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .metrics import catalog

SCHEMA_VERSION = 39
"""Grafana's dashboard schema version of the generated JSON (Grafana 10.4 wrote 39; newer
Grafanas migrate it on load, and the later migrations, 40-42, change nothing here)."""

GRAFANA_VERSIONS = "Grafana 10.4 to 12.x"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
"""Every panel and target queries the dashboard's ``datasource`` variable, so the boards work
when provisioned from files (no ``__inputs``/``${DS_PROMETHEUS}`` placeholders)."""

PROMETHEUS_OWN = frozenset({"up"})
"""Series that Prometheus itself makes and the boards and rules may use besides the catalog."""

GRID_WIDTH = 24

# Selectors shared by the panels: one DDP job, the chosen ranks.
SEL = '{job="$job", rank=~"$rank"}'
JOB = '{job="$job"}'
RATE = "$__rate_interval"

# -- PromQL metric names -----------------------------------------------------------------------

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_VARIABLES = re.compile(r"\$\{[^}]*\}|\$\w+")
_IDENT = re.compile(r"(?<![\w.:$])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = frozenset({
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan", "atan2",
})
_RATE_FUNCS = re.compile(r"\b(?:rate|irate|increase|resets)\s*\(\s*([A-Za-z_:][\w:]*)")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.*?)\s*,\s*(\w+)\s*\)\s*$", re.S)


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
    known = catalog.series_names() | PROMETHEUS_OWN
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
        if name.endswith(suffix) and base in catalog.BY_NAME and catalog.BY_NAME[base].kind == "histogram":
            return True
    spec = catalog.BY_NAME.get(name)
    return spec is not None and spec.kind == "counter"


def source_of(expr: str) -> set[str]:
    """Where the series an expression reads come from: rank, gpu, host, daemon, prometheus."""
    out = set()
    for name in metric_names(expr):
        if name in PROMETHEUS_OWN:
            out.add("prometheus")
            continue
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        spec = catalog.BY_NAME.get(name) or catalog.BY_NAME.get(base)
        if spec is not None:
            out.add(spec.source)
    return out


# -- building blocks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """One PromQL target of a panel; ``legend`` is Grafana's legend format."""

    expr: str
    legend: str = ""
    instant: bool = False


@dataclass
class Panel:
    """A panel before layout: what it shows; ``_layout`` gives it an id and a grid position."""

    kind: str  # timeseries | stat | bargauge | state-timeline
    title: str
    description: str
    unit: str
    queries: Sequence[Query]
    w: int = 12
    h: int = 8
    defaults: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


def _thresholds(*steps: tuple[float | None, str]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


GREEN = _thresholds((None, "green"))


def _mapping(*states: tuple[int, str, str]) -> list[dict[str, Any]]:
    return [{
        "type": "value",
        "options": {str(v): {"text": text, "color": color, "index": i} for i, (v, text, color) in enumerate(states)},
    }]


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    for q in panel.queries:
        check_expr(q.expr)
    defaults: dict[str, Any] = {"unit": panel.unit, "color": {"mode": "palette-classic"}, "thresholds": GREEN}
    options: dict[str, Any]
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
            "spanNulls": False, "axisSoftMin": 0, "stacking": {"mode": "none", "group": "A"},
        }
        options = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif panel.kind == "stat":
        defaults["color"] = {"mode": "thresholds"}
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value", "graphMode": "area", "justifyMode": "auto",
            "orientation": "auto", "textMode": "auto",
        }
    elif panel.kind == "bargauge":
        defaults["color"] = {"mode": "thresholds"}
        defaults["min"] = 0
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True,
            "valueMode": "color", "minVizHeight": 16, "minVizWidth": 0,
        }
    elif panel.kind == "state-timeline":
        defaults["color"] = {"mode": "thresholds"}
        defaults["custom"] = {"lineWidth": 0, "fillOpacity": 70}
        options = {
            "mergeValues": True, "showValue": "auto", "alignValue": "left", "rowHeight": 0.9,
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "single", "sort": "none"},
        }
    else:
        raise ValueError(f"panel type {panel.kind!r} is not one the generator knows")
    _merge(defaults, panel.defaults)
    _merge(options, panel.options)
    targets = []
    for i, q in enumerate(panel.queries):
        targets.append({
            "refId": chr(ord("A") + i), "datasource": DATASOURCE, "editorMode": "code",
            "expr": q.expr, "legendFormat": q.legend or "__auto",
            "range": not q.instant, "instant": q.instant,
        })
    return {
        "id": pid, "type": panel.kind, "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE, "gridPos": {"h": panel.h, "w": panel.w, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options,
        "targets": targets,
    }


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _layout(panels: Sequence[Panel]) -> list[dict[str, Any]]:
    """Place panels left to right in rows of GRID_WIDTH columns; ids count from 1."""
    out, x, y, row_h = [], 0, 0, 0
    for pid, panel in enumerate(panels, start=1):
        if x + panel.w > GRID_WIDTH:
            x, y, row_h = 0, y + row_h, 0
        out.append(_panel_json(panel, pid, x, y))
        x += panel.w
        row_h = max(row_h, panel.h)
    return out


def _variables() -> list[dict[str, Any]]:
    job_query = "label_values(ddpmon_rank_info, job)"
    rank_query = 'label_values(ddpmon_rank_info{job="$job"}, rank)'
    for q in (job_query, rank_query):
        check_expr(q)
    common = {"hide": 0, "options": [], "current": {}, "regex": "", "skipUrlSync": False}
    return [
        {**common, "type": "datasource", "name": "datasource", "label": "Data source",
         "query": "prometheus", "refresh": 1, "multi": False, "includeAll": False},
        {**common, "type": "query", "name": "job", "label": "DDP job", "datasource": DATASOURCE,
         "query": job_query, "definition": job_query, "refresh": 2, "sort": 1,
         "multi": False, "includeAll": False},
        {**common, "type": "query", "name": "rank", "label": "Rank", "datasource": DATASOURCE,
         "query": rank_query, "definition": rank_query, "refresh": 2, "sort": 3,
         "multi": True, "includeAll": True, "allValue": ".*",
         "current": {"selected": True, "text": ["All"], "value": ["$__all"]}},
    ]


def _dashboard(uid: str, title: str, description: str, panels: Sequence[Panel]) -> dict[str, Any]:
    return {
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard",
        }]},
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [{
            "type": "dashboards", "title": "ddpmon", "tags": ["ddpmon"], "asDropdown": False,
            "includeVars": True, "keepTime": True, "icon": "external link", "targetBlank": False,
            "tooltip": "", "url": "",
        }],
        "liveNow": False,
        "panels": _layout(panels),
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["ddpmon", "pytorch", "ddp"],
        "templating": {"list": _variables()},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }


# -- DDP job overview --------------------------------------------------------------------------


def _rate(name: str, sel: str = SEL) -> str:
    return f"rate({name}{sel}[{RATE}])"


def _per_step(numerator: Sequence[str], by: str = "rank", sel: str = SEL,
              count: str = "ddpmon_step_seconds_count") -> str:
    """Mean seconds per step of the summed histogram sums ``numerator``, grouped ``by``."""
    grouping = f"sum by ({by}) " if by else "sum "
    num = " + ".join(_rate(n, sel) for n in numerator)
    return f"{grouping}({num}) / {grouping}({_rate(count, sel)})"


COMPUTE = ("ddpmon_forward_seconds_sum", "ddpmon_backward_seconds_sum")


def overview() -> dict[str, Any]:
    """The DDP job overview: progress, stragglers, communication, health."""
    ratio_thresholds = _thresholds((None, "green"), (0.2, "orange"), (0.3, "red"))
    straggler_median = f"scalar(quantile(0.5, {_per_step(COMPUTE, sel=JOB)}))"
    state_defaults = {"min": 0, "max": 1}
    panels = [
        # -- at a glance
        Panel("stat", "Steps per second",
              "Training steps per second, averaged over the selected ranks. Every rank of a DDP "
              "job steps in lockstep, so this is the job's speed. Bad: a drop from the usual "
              "value (a straggler, slow data loading, a slower network) or 0 (a hang).",
              "suffix:steps/s",
              [Query(f"avg({_rate('ddpmon_steps_total')})", "steps/s")], w=4, h=4),
        Panel("stat", "Mean step time",
              "Mean wall time of one training step over the selected ranks, from one forward "
              "start to the next. Bad: growing over time or well above what this model usually "
              "takes; look at the step phases below to see which part grew.",
              "s",
              [Query(f"sum({_rate('ddpmon_step_seconds_sum')}) / "
                     f"sum({_rate('ddpmon_step_seconds_count')})", "step time")], w=4, h=4),
        Panel("stat", "Exposed communication",
              "Share of step time spent waiting for gradient all-reduces after backward compute "
              "finished (communication not hidden behind compute). Bad: above about 30% (orange "
              "from 20%): the network is too slow for this model size, buckets are badly sized, "
              "or the ranks wait for a straggler.",
              "percentunit",
              [Query(f"sum({_rate('ddpmon_exposed_comm_seconds_sum')}) / "
                     f"sum({_rate('ddpmon_step_seconds_sum')})", "exposed")],
              w=4, h=4, defaults={"thresholds": ratio_thresholds, "min": 0, "max": 1}),
        Panel("stat", "Ranks reporting",
              "Ranks of this job whose metrics endpoint Prometheus scraped. Bad: fewer than the "
              "job's world size (the world_size label of ddpmon_rank_info): a rank died, or its "
              "endpoint is not scraped.",
              "short",
              [Query(f"count(ddpmon_rank_info{JOB})", "ranks")], w=4, h=4),
        Panel("stat", "Ranks suspected hung",
              "Ranks whose watchdog (or the node daemon, from the rank's state file) reports a "
              "suspected hang. Good: 0. Bad: 1 or more: run `ddpmon doctor` on the node for "
              "the culprit rank and its Python stack.",
              "short",
              [Query(f"count(max by (rank) (ddpmon_hang_suspected{SEL} == 1 or "
                     f"ddpmon_rank_hang_suspected{SEL} == 1)) or vector(0)", "hung ranks")],
              w=4, h=4, defaults={"thresholds": _thresholds((None, "green"), (1, "red"))}),
        Panel("stat", "Unused parameters",
              "Most parameters that got no gradient in the last step, on any selected rank. "
              "Bad: above 0 when the model should use every parameter (a skipped branch), or "
              "rising during training; with find_unused_parameters=False DDP will fail.",
              "short",
              [Query(f"max(ddpmon_unused_parameters{SEL})", "unused")],
              w=4, h=4, defaults={"thresholds": _thresholds((None, "green"), (1, "orange"))}),
        # -- progress
        Panel("timeseries", "Step time per rank",
              "Mean and 90th percentile step time of each rank. All ranks of a DDP job take "
              "the same time per step (they synchronise every step). Bad: a rising trend, "
              "spikes, or a p90 far above the mean (irregular stalls such as data loading).",
              "s",
              [Query(f"sum by (rank) ({_rate('ddpmon_step_seconds_sum')}) / "
                     f"sum by (rank) ({_rate('ddpmon_step_seconds_count')})", "rank {{rank}} mean"),
               Query(f"histogram_quantile(0.9, sum by (rank, le) ({_rate('ddpmon_step_seconds_bucket')}))",
                     "rank {{rank}} p90")]),
        Panel("timeseries", "Steps per second per rank",
              "Training throughput of each rank in steps per second. Ranks move together; "
              "bad: a fall to 0 on every rank (a hang or a dead rank) or a slow decline.",
              "suffix:steps/s",
              [Query(f"sum by (rank) ({_rate('ddpmon_steps_total')})", "rank {{rank}}")]),
        # -- stragglers
        Panel("bargauge", "Straggler: compute time per step",
              "Forward plus backward compute time per step of each rank. The slowest rank has "
              "the longest bar and every other rank waits for it. Bad: one rank clearly longer "
              "than the rest (a throttling or shared GPU, a busier data loader, more work).",
              "s",
              [Query(_per_step(COMPUTE), "rank {{rank}}", instant=True)], w=8),
        Panel("bargauge", "Straggler: all-reduce wait per step",
              "Exposed communication per step of each rank: time from the end of its backward "
              "compute until its all-reduces finished. Fast ranks wait longest for a straggler, "
              "so the straggler is the rank with the shortest bar here and the longest compute "
              "bar. Bad: large waits on all ranks but one.",
              "s",
              [Query(_per_step(("ddpmon_exposed_comm_seconds_sum",), count="ddpmon_exposed_comm_seconds_count"),
                     "rank {{rank}}", instant=True)], w=8),
        Panel("timeseries", "Compute time relative to the job median",
              "Each rank's compute time per step divided by the median over all ranks of the "
              "job (100% = the median). Bad: a rank persistently above about 120%: it is a "
              "straggler and sets the pace of the whole job (the DDPStraggler alert).",
              "percentunit",
              [Query(f"{_per_step(COMPUTE)} / {straggler_median}", "rank {{rank}}")], w=8,
              defaults={"thresholds": _thresholds((None, "green"), (1.2, "red"))}),
        # -- where the step goes
        Panel("timeseries", "Step phases",
              "Mean time per step in each phase over the selected ranks: forward, backward "
              "compute, exposed communication, and the rest (optimizer, data loading, host "
              "work). Bad: exposed communication or 'other' growing into a large share of the "
              "step.",
              "s",
              [Query(_per_step(("ddpmon_forward_seconds_sum",), by=""), "forward"),
               Query(_per_step(("ddpmon_backward_seconds_sum",), by=""), "backward"),
               Query(_per_step(("ddpmon_exposed_comm_seconds_sum",), by=""), "exposed communication"),
               Query(f"(sum({_rate('ddpmon_step_seconds_sum')}) - sum({_rate('ddpmon_forward_seconds_sum')})"
                     f" - sum({_rate('ddpmon_backward_seconds_sum')}) - sum({_rate('ddpmon_exposed_comm_seconds_sum')}))"
                     f" / sum({_rate('ddpmon_step_seconds_count')})", "other (optimizer, data, host)")],
              defaults={"custom": {"stacking": {"mode": "normal"}, "fillOpacity": 40}}),
        Panel("timeseries", "Exposed communication ratio per rank",
              "Share of each rank's step time spent waiting for all-reduces after its backward "
              "compute. Bad: above 30% for a long time (DDPHighExposedCommunication); one rank "
              "far lower than the others is the straggler the others wait for.",
              "percentunit",
              [Query(f"sum by (rank) ({_rate('ddpmon_exposed_comm_seconds_sum')}) / "
                     f"sum by (rank) ({_rate('ddpmon_step_seconds_sum')})", "rank {{rank}}")],
              defaults={"thresholds": ratio_thresholds, "min": 0, "max": 1}),
        # -- communication
        Panel("timeseries", "All-reduce time per bucket",
              "Mean duration of each gradient bucket's all-reduce (from the bucket becoming "
              "ready to the collective completing), over the selected ranks. Bucket 0 holds the "
              "last layers and is reduced first. Bad: one bucket far slower than its size "
              "explains, or all buckets slowing down (network trouble, a straggler).",
              "s",
              [Query(f"sum by (bucket) ({_rate('ddpmon_allreduce_seconds_sum')}) / "
                     f"sum by (bucket) ({_rate('ddpmon_allreduce_seconds_count')})", "bucket {{bucket}}")]),
        Panel("timeseries", "Bus bandwidth per bucket",
              "Bus bandwidth of each bucket's last all-reduce (nccl-tests definition: bytes / "
              "time x 2(n-1)/n), averaged over the selected ranks. Bad: far below what the "
              "interconnect delivers in nccl-tests (small buckets are latency bound and always "
              "lower), or a sudden drop.",
              "Bps",
              [Query(f"avg by (bucket) (ddpmon_allreduce_bus_bandwidth_bytes_per_second{SEL})", "bucket {{bucket}}")]),
        Panel("bargauge", "Bucket sizes",
              "Size of each gradient bucket's buffer (DDP's bucket_cap_mb caps it). Bad: many "
              "tiny buckets (latency bound all-reduces) or a single huge one (no overlap of "
              "communication with backward compute).",
              "bytes",
              [Query(f"max by (bucket) (ddpmon_bucket_size_bytes{SEL})", "bucket {{bucket}}", instant=True)], w=8),
        Panel("timeseries", "Bucket ready time",
              "When each bucket's gradients were all ready, in seconds after its step began "
              "(last step, mean over the selected ranks). Buckets become ready in order during "
              "backward. Bad: all buckets ready only at the very end (nothing to overlap).",
              "s",
              [Query(f"avg by (bucket) (ddpmon_bucket_ready_seconds{SEL})", "bucket {{bucket}}")], w=8),
        Panel("timeseries", "All-reduce traffic per rank",
              "Gradient bytes each rank all-reduces per second (algorithm bytes, not bus "
              "bytes). Equal on every rank. Bad: a drop with steady step count (buckets "
              "skipped) or a fall to 0 (no step finishes).",
              "Bps",
              [Query(f"sum by (rank) ({_rate('ddpmon_allreduce_bytes_total')})", "rank {{rank}}")], w=8),
        # -- health
        Panel("timeseries", "Unused parameters per rank",
              "Parameters that got no gradient in the last step, per rank (names are in the "
              "rank's state file and log). Bad: a value above 0 that appears mid-training or "
              "differs between ranks (a branch skipped on some ranks).",
              "short",
              [Query(f"max by (rank) (ddpmon_unused_parameters{SEL})", "rank {{rank}}")], w=8),
        Panel("timeseries", "Time since last progress",
              "Seconds since each rank last made progress (a step, a bucket, a collective), as "
              "the rank reports it and as the node daemon reads it from the state file. "
              "Healthy: under a step time. Bad: growing steadily on any rank (a hang; "
              "DDPJobNoProgress fires after 10 minutes).",
              "s",
              [Query(f"time() - max by (rank) (ddpmon_last_progress_timestamp_seconds{SEL})", "rank {{rank}}"),
               Query(f"time() - max by (rank) (ddpmon_rank_last_progress_timestamp_seconds{SEL})",
                     "rank {{rank}} (daemon)")], w=8),
        Panel("state-timeline", "Hang state per rank",
              "Whether the rank's watchdog (or the node daemon, from the state file) suspects "
              "a hang. Good: ok everywhere. Bad: 'hang suspected' on a rank: run `ddpmon "
              "doctor` on its node.",
              "short",
              [Query(f"max by (rank) (ddpmon_hang_suspected{SEL})", "rank {{rank}}"),
               Query(f"max by (rank) (ddpmon_rank_hang_suspected{SEL})", "rank {{rank}} (daemon)")], w=8,
              defaults={**state_defaults, "mappings": _mapping((0, "ok", "green"), (1, "hang suspected", "red")),
                        "thresholds": _thresholds((None, "green"), (1, "red"))}),
        Panel("state-timeline", "Liveness per rank",
              "Whether each rank is alive: as the node daemon sees the process and its state "
              "file heartbeat, and whether Prometheus can scrape the rank's endpoint. Good: up "
              "everywhere. Bad: down on a rank while the others are up: they will block in "
              "their next collective (DDPRankDown).",
              "short",
              [Query(f"max by (rank) (ddpmon_rank_up{SEL})", "rank {{rank}} (daemon)"),
               Query(f"max by (rank) (max by (instance, rank) (last_over_time(ddpmon_rank_info{SEL}[1h]))"
                     f" * on (instance) group_left () max by (instance) (up))", "rank {{rank}} (endpoint)")],
              defaults={**state_defaults, "mappings": _mapping((0, "down", "red"), (1, "up", "green")),
                        "thresholds": _thresholds((None, "red"), (1, "green"))}),
        Panel("timeseries", "Collectives in flight per rank",
              "Collectives each rank issued that have not completed yet. Healthy: brief spikes "
              "during backward that return to 0 every step. Bad: stuck above 0 while progress "
              "stops: the rank waits in a collective for a peer that never joins.",
              "short",
              [Query(f"max by (rank) (ddpmon_collectives_in_flight{SEL})", "rank {{rank}}")]),
    ]
    return _dashboard(
        "ddpmon-ddp-overview", "DDP job overview",
        "One PyTorch DDP job as ddpmon sees it: speed, stragglers, gradient communication, "
        "unused parameters, hangs and liveness per rank.", panels,
    )


# -- DDP GPUs ----------------------------------------------------------------------------------

GPU_LEGEND = "rank {{rank}} gpu {{gpu}}"
THROTTLE_REASONS = "(?i).*(thermal|power_?brake|hw_?slowdown).*"
"""Clock-event reasons that mean the GPU is held down by heat or power (not idle, not the
application clock setting, not the usual software power cap at full load)."""


def gpus() -> dict[str, Any]:
    """The DDP GPUs board: each rank's GPU from NVML (and the node daemon for XIDs)."""
    by_gpu = "max by (rank, gpu)"
    state = {"min": 0, "max": 1}
    panels = [
        Panel("timeseries", "GPU utilization",
              "Share of time a kernel ran on each rank's GPU over NVML's sample period. Good: "
              "high and equal on every rank. Bad: one rank lower than the others (it waits: "
              "data loading, a straggler elsewhere) or all low (communication or input bound).",
              "percentunit",
              [Query(f"{by_gpu} (ddpmon_gpu_utilization_ratio{SEL})", GPU_LEGEND)], w=8,
              defaults={"min": 0, "max": 1}),
        Panel("timeseries", "GPU memory used",
              "GPU memory in use on each rank's device (NVML, every process on it), with the "
              "device total. Bad: close to the total (the next allocation may fail with out of "
              "memory) or growing every step (a leak).",
              "bytes",
              [Query(f"{by_gpu} (ddpmon_gpu_memory_used_bytes{SEL})", GPU_LEGEND),
               Query(f"{by_gpu} (ddpmon_gpu_memory_total_bytes{SEL})", GPU_LEGEND + " total")], w=8),
        Panel("timeseries", "torch allocator memory",
              "Memory held by tensors (allocated), kept by torch's caching allocator "
              "(reserved) and the peak allocated, per rank. Bad: reserved far above allocated "
              "(fragmentation) or allocated growing step after step (tensors kept alive).",
              "bytes",
              [Query(f"{by_gpu} (ddpmon_torch_memory_allocated_bytes{SEL})", GPU_LEGEND + " allocated"),
               Query(f"{by_gpu} (ddpmon_torch_memory_reserved_bytes{SEL})", GPU_LEGEND + " reserved"),
               Query(f"{by_gpu} (ddpmon_torch_memory_peak_allocated_bytes{SEL})", GPU_LEGEND + " peak")], w=8),
        Panel("timeseries", "GPU power",
              "Power draw of each rank's GPU. Good: similar on every rank under the same load. "
              "Bad: one GPU drawing much less than its peers (it is held down or starved), or "
              "all GPUs pinned at the power limit with clocks dropping.",
              "watt",
              [Query(f"{by_gpu} (ddpmon_gpu_power_watts{SEL})", GPU_LEGEND)], w=8),
        Panel("timeseries", "GPU temperature",
              "Core temperature of each rank's GPU (orange from 80 C, red from 87 C). Bad: well "
              "above its peers or near the GPU's slowdown temperature (nvidia-smi -q -d "
              "TEMPERATURE shows it): the GPU will throttle and become a straggler.",
              "celsius",
              [Query(f"{by_gpu} (ddpmon_gpu_temperature_celsius{SEL})", GPU_LEGEND)], w=8,
              defaults={"thresholds": _thresholds((None, "green"), (80, "orange"), (87, "red"))}),
        Panel("timeseries", "SM clock",
              "Streaming-multiprocessor clock of each rank's GPU. Good: at or near the boost "
              "clock under load and equal on every rank. Bad: one GPU clocked lower than the "
              "rest (see the clock events panel for why).",
              "hertz",
              [Query(f"{by_gpu} (ddpmon_gpu_sm_clock_hertz{SEL})", GPU_LEGEND)], w=8),
        Panel("timeseries", "Clock events by reason",
              "How many of the selected GPUs have each clock event (throttle reason) active. "
              "The software power cap at full load is common; bad: thermal slowdown, hardware "
              "slowdown or power brake on any GPU.",
              "short",
              [Query(f"sum by (reason) (ddpmon_gpu_clock_event_active{SEL})", "{{reason}}")], w=8),
        Panel("state-timeline", "Thermal or power throttling per GPU",
              "Whether each rank's GPU is held down by heat or by a power brake (thermal "
              "slowdown, hardware slowdown, power brake). Good: full clocks everywhere. Bad: "
              "throttled on a GPU: that rank becomes a straggler (DDPGPUThermalThrottling, "
              "DDPGPUPowerThrottling).",
              "short",
              [Query(f'{by_gpu} (ddpmon_gpu_clock_event_active{{job="$job", rank=~"$rank", '
                     f'reason=~"{THROTTLE_REASONS}"}})', GPU_LEGEND)], w=8,
              defaults={**state, "mappings": _mapping((0, "full clocks", "green"), (1, "throttled", "red")),
                        "thresholds": _thresholds((None, "green"), (1, "red"))}),
        Panel("timeseries", "PCIe replays",
              "PCIe replay events per second on each rank's GPU link. Good: 0. Bad: a steady "
              "rate (a marginal link or riser, which also slows host-device copies).",
              "suffix:replays/s",
              [Query(f"sum by (rank, gpu) ({_rate('ddpmon_gpu_pcie_replays_total')})", GPU_LEGEND)], w=8),
        Panel("timeseries", "ECC errors",
              "ECC errors each rank's GPU counted since the driver loaded, by type. Corrected "
              "errors in small numbers are harmless; bad: any uncorrected error (the job's "
              "results on that GPU are suspect; DDPGPUUncorrectedECCErrors) or corrected "
              "errors climbing fast.",
              "short",
              [Query(f"max by (rank, gpu, type) (ddpmon_gpu_ecc_errors_total{SEL})", GPU_LEGEND + " {{type}}")], w=8),
        Panel("timeseries", "XID errors",
              "XID errors the node daemon saw on each rank's GPU, by XID code. Good: none. "
              "Bad: any (13, 31, 43: usually an application fault; 48, 63, 64, 74, 79, 92, 94, 95: "
              "the GPU, its memory or NVLink, and 48, 74, 79, 95 usually end the job; "
              "DDPGPUXidError).",
              "short",
              [Query(f"sum by (rank, gpu, xid) (ddpmon_gpu_xid_errors_total{SEL})", GPU_LEGEND + " xid {{xid}}")], w=8),
        Panel("stat", "GPU energy over the time range",
              "Energy the selected ranks' GPUs used over the dashboard's time range. Useful to "
              "compare runs; bad: much more energy for the same number of steps than a "
              "previous run.",
              "joule",
              [Query(f"sum(increase(ddpmon_gpu_energy_joules_total{SEL}[$__range]))", "energy")], w=8, h=8),
    ]
    return _dashboard(
        "ddpmon-ddp-gpus", "DDP GPUs",
        "The GPU of every rank of one PyTorch DDP job: utilization, memory, power, "
        "temperature, clocks and throttling, ECC and XID errors.", panels,
    )


# -- output ------------------------------------------------------------------------------------

BOARDS: dict[str, Callable[[], dict[str, Any]]] = {
    "ddp-job-overview.json": overview,
    "ddp-gpus.json": gpus,
}


def build() -> dict[str, dict[str, Any]]:
    """Every dashboard, by file name."""
    return {name: make() for name, make in BOARDS.items()}


def render(dashboard: dict[str, Any]) -> str:
    """The dashboard as the JSON text written to disk (stable, so diffs stay small)."""
    return json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"


def export(directory: str | os.PathLike[str]) -> list[Path]:
    """Write every dashboard into ``directory`` (created if missing); return the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, board in build().items():
        path = out / name
        path.write_text(render(board), encoding="utf-8")
        paths.append(path)
    return paths


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of a dashboard, including panels nested in rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def configmap(dashboards: dict[str, dict[str, Any]], name: str = "ddpmon-dashboards") -> str:
    """A Kubernetes ConfigMap holding the dashboards, labelled for Grafana's dashboard sidecar."""
    lines = [
        "# Generated by `python -m ddpmon.dashboards` from ddpmon/dashboards.py: do not edit.",
        "# Grafana's dashboard sidecar (kube-prometheus-stack, the grafana chart) loads every",
        "# ConfigMap labelled grafana_dashboard=\"1\".",
        "apiVersion: v1",
        "kind: ConfigMap",
        "metadata:",
        f"  name: {name}",
        "  labels:",
        "    app.kubernetes.io/name: ddpmon",
        '    grafana_dashboard: "1"',
        "data:",
    ]
    for file_name, board in dashboards.items():
        lines.append(f"  {file_name}: |-")
        lines.extend(("    " + line).rstrip() for line in render(board).rstrip("\n").split("\n"))
    return "\n".join(lines) + "\n"


def prometheus_rule(rules_yaml: str, name: str = "ddpmon") -> str:
    """A prometheus-operator PrometheusRule carrying the groups of ddpmon-rules.yml."""
    body = re.split(r"^groups:[ \t]*$", rules_yaml, maxsplit=1, flags=re.M)
    if len(body) != 2:
        raise ValueError("the rules file has no top-level 'groups:' line")
    lines = [
        "# Generated by `python -m ddpmon.dashboards` from deploy/prometheus/ddpmon-rules.yml:",
        "# do not edit. The Prometheus of the operator must select it (ruleSelector).",
        "apiVersion: monitoring.coreos.com/v1",
        "kind: PrometheusRule",
        "metadata:",
        f"  name: {name}",
        "  labels:",
        "    app.kubernetes.io/name: ddpmon",
        "spec:",
        "  groups:",
    ]
    lines.extend(("  " + line).rstrip() for line in body[1].strip("\n").split("\n"))
    return "\n".join(lines) + "\n"


def generated_files(root: str | os.PathLike[str]) -> dict[Path, str]:
    """Every generated file of a source tree rooted at ``root``, with its content."""
    root = Path(root)
    boards = build()
    files = {root / "dashboards" / name: render(board) for name, board in boards.items()}
    files[root / "deploy" / "kubernetes" / "dashboards-configmap.yaml"] = configmap(boards)
    rules = (root / "deploy" / "prometheus" / "ddpmon-rules.yml").read_text(encoding="utf-8")
    files[root / "deploy" / "kubernetes" / "prometheusrule.yaml"] = prometheus_rule(rules)
    return files


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite the generated files of the source tree (default: the one this module is in)."""
    args = list(sys.argv[1:] if argv is None else argv)
    root = Path(args[0]) if args else Path(__file__).resolve().parents[1]
    for path, text in generated_files(root).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
