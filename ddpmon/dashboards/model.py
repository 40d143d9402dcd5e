"""Grafana's dashboard JSON model, made from short panel descriptions.

A board is written as a list of ``Panel`` (what it shows: type, title, description, unit,
queries, size); this module turns that into Grafana's JSON: panel ids and grid positions, the
per-type field and option defaults, the ``datasource``/``job``/``rank`` variables and the
dashboard envelope. Every query is checked against the metric catalog here, so no board can
be built that reads an unknown metric.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .promql import check_expr

SCHEMA_VERSION = 39
"""Grafana's dashboard schema version of the generated JSON (Grafana 10.4 wrote 39; newer
Grafanas migrate it on load, and the later migrations, 40-42, change nothing here)."""

GRAFANA_VERSIONS = "Grafana 10.4 to 12.x"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
"""Every panel and target queries the dashboard's ``datasource`` variable, so the boards work
when provisioned from files (no ``__inputs``/``${DS_PROMETHEUS}`` placeholders)."""

GRID_WIDTH = 24
PANEL_KINDS = ("timeseries", "stat", "bargauge", "state-timeline")


@dataclass(frozen=True)
class Query:
    """One PromQL target of a panel; ``legend`` is Grafana's legend format."""

    expr: str
    legend: str = ""
    instant: bool = False


@dataclass
class Panel:
    """A panel before layout: what it shows; ``layout`` gives it an id and a grid position.

    ``defaults`` and ``options`` are merged over the panel type's own (nested dicts key by
    key), for thresholds, value mappings, min/max and the like.
    """

    kind: str  # one of PANEL_KINDS
    title: str
    description: str
    unit: str
    queries: Sequence[Query]
    w: int = 12
    h: int = 8
    defaults: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


def thresholds(*steps: tuple[float | None, str]) -> dict[str, Any]:
    """Absolute thresholds from (value, colour) steps; the first value is None (the base)."""
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


def mapping(*states: tuple[int, str, str]) -> list[dict[str, Any]]:
    """Value mappings from (value, text, colour): how a state-timeline names 0/1 states."""
    return [
        {
            "type": "value",
            "options": {
                str(v): {"text": text, "color": color, "index": i}
                for i, (v, text, color) in enumerate(states)
            },
        }
    ]


def _kind_defaults(kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The field defaults (beyond unit and thresholds) and the options of a panel type."""
    reduce_last = {"calcs": ["lastNotNull"], "fields": "", "values": False}
    by_value = {"color": {"mode": "thresholds"}}
    if kind == "timeseries":
        return {
            "custom": {
                "drawStyle": "line",
                "lineWidth": 1,
                "fillOpacity": 10,
                "showPoints": "never",
                "spanNulls": False,
                "axisSoftMin": 0,
                "stacking": {"mode": "none", "group": "A"},
            }
        }, {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    if kind == "stat":
        return by_value, {
            "reduceOptions": reduce_last,
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "auto",
        }
    if kind == "bargauge":
        return {**by_value, "min": 0}, {
            "reduceOptions": reduce_last,
            "orientation": "horizontal",
            "displayMode": "gradient",
            "showUnfilled": True,
            "valueMode": "color",
            "minVizHeight": 16,
            "minVizWidth": 0,
        }
    if kind == "state-timeline":
        return {**by_value, "custom": {"lineWidth": 0, "fillOpacity": 70}}, {
            "mergeValues": True,
            "showValue": "auto",
            "alignValue": "left",
            "rowHeight": 0.9,
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "single", "sort": "none"},
        }
    raise ValueError(
        f"panel type {kind!r} is not one the generator knows: use one of {', '.join(PANEL_KINDS)}"
    )


def panel_json(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    """Grafana's JSON for one panel at grid position (x, y); checks every query first."""
    for q in panel.queries:
        check_expr(q.expr)
    kind_defaults, options = _kind_defaults(panel.kind)
    defaults: dict[str, Any] = {
        "unit": panel.unit,
        "color": {"mode": "palette-classic"},
        "thresholds": thresholds((None, "green")),
    }
    defaults.update(kind_defaults)
    _merge(defaults, panel.defaults)
    _merge(options, panel.options)
    targets = [
        {
            "refId": chr(ord("A") + i),
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": q.expr,
            "legendFormat": q.legend or "__auto",
            "range": not q.instant,
            "instant": q.instant,
        }
        for i, q in enumerate(panel.queries)
    ]
    return {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.h, "w": panel.w, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": targets,
    }


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    """Merge ``extra`` into ``base``, nested dicts key by key; ``base`` shares nothing with
    ``extra`` afterwards (panels reuse the same thresholds and ranges)."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def layout(panels: Sequence[Panel]) -> list[dict[str, Any]]:
    """Place panels left to right in rows of GRID_WIDTH columns; ids count from 1."""
    out, x, y, row_h = [], 0, 0, 0
    for pid, panel in enumerate(panels, start=1):
        if x + panel.w > GRID_WIDTH:
            x, y, row_h = 0, y + row_h, 0
        out.append(panel_json(panel, pid, x, y))
        x += panel.w
        row_h = max(row_h, panel.h)
    return out


def variables() -> list[dict[str, Any]]:
    """The three variables of every board: datasource, job (one) and rank (several or All)."""
    job_query = "label_values(ddpmon_rank_info, job)"
    rank_query = 'label_values(ddpmon_rank_info{job="$job"}, rank)'
    for q in (job_query, rank_query):
        check_expr(q)
    common = {"hide": 0, "options": [], "current": {}, "regex": "", "skipUrlSync": False}
    return [
        {
            **common,
            "type": "datasource",
            "name": "datasource",
            "label": "Data source",
            "query": "prometheus",
            "refresh": 1,
            "multi": False,
            "includeAll": False,
        },
        {
            **common,
            "type": "query",
            "name": "job",
            "label": "DDP job",
            "datasource": DATASOURCE,
            "query": job_query,
            "definition": job_query,
            "refresh": 2,
            "sort": 1,
            "multi": False,
            "includeAll": False,
        },
        {
            **common,
            "type": "query",
            "name": "rank",
            "label": "Rank",
            "datasource": DATASOURCE,
            "query": rank_query,
            "definition": rank_query,
            "refresh": 2,
            "sort": 3,
            "multi": True,
            "includeAll": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        },
    ]


def dashboard(uid: str, title: str, description: str, panels: Sequence[Panel]) -> dict[str, Any]:
    """A whole board: the panels laid out, the variables, and a link to the other ddpmon boards."""
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [
            {
                "type": "dashboards",
                "title": "ddpmon",
                "tags": ["ddpmon"],
                "asDropdown": False,
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "liveNow": False,
        "panels": layout(panels),
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["ddpmon", "pytorch", "ddp"],
        "templating": {"list": variables()},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }


def render(board: dict[str, Any]) -> str:
    """The dashboard as the JSON text written to disk (stable, so diffs stay small)."""
    return json.dumps(board, indent=2, ensure_ascii=False) + "\n"


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of a dashboard, including panels nested in rows."""
    for panel in board.get("panels", []):
        yield panel
        yield from panel.get("panels", [])
