"""The generated Grafana dashboards: up to date on disk, well formed for Grafana's JSON model,
and reading only metrics of the catalog. (Grafana itself does not run here; the queries run
against a real Prometheus in tests/integration.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from ddpmon import dashboards
from ddpmon.metrics import catalog
from tests.support import rules

ROOT = Path(__file__).resolve().parents[2]
BOARDS = dashboards.build()
GRAFANA_UNITS = {
    "s",
    "ms",
    "percentunit",
    "short",
    "bytes",
    "Bps",
    "watt",
    "joule",
    "celsius",
    "hertz",
    "none",
}
PANEL_TYPES = {"timeseries", "stat", "bargauge", "state-timeline"}


def _panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return list(dashboards.panels(board))


def _all_panels() -> list[tuple[str, dict[str, Any]]]:
    return [(name, p) for name, board in BOARDS.items() for p in _panels(board)]


# -- on disk -----------------------------------------------------------------------------------


def test_checked_in_files_match_the_generator() -> None:
    generated = dashboards.generated_files(ROOT)
    assert sorted(str(p.relative_to(ROOT)) for p in generated) == [
        "dashboards/ddp-gpus.json",
        "dashboards/ddp-job-overview.json",
        "deploy/kubernetes/dashboards-configmap.yaml",
        "deploy/kubernetes/prometheusrule.yaml",
    ]
    stale = [str(p.relative_to(ROOT)) for p in dashboards.stale_files(ROOT)]
    assert not stale, f"regenerate with `make dashboards`: {stale} differ from the generator"


def test_dashboards_dir_holds_exactly_the_generated_boards() -> None:
    assert sorted(p.name for p in (ROOT / "dashboards").glob("*.json")) == sorted(BOARDS)


# -- Grafana's JSON model ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_dashboard_top_level(name: str) -> None:
    board = json.loads((ROOT / "dashboards" / name).read_text())
    assert board["schemaVersion"] == dashboards.SCHEMA_VERSION == 39
    assert board["id"] is None and re.fullmatch(r"[a-z0-9-]{1,40}", board["uid"])
    assert board["title"] in ("DDP job overview", "DDP GPUs")
    assert "__inputs" not in board and "__requires" not in board
    assert "${DS_" not in json.dumps(board), "import placeholders break file provisioning"
    assert isinstance(board["refresh"], str) and board["time"] == {"from": "now-1h", "to": "now"}
    assert "ddpmon" in board["tags"]


def test_uids_and_titles_are_unique() -> None:
    assert (
        len({b["uid"] for b in BOARDS.values()})
        == len({b["title"] for b in BOARDS.values()})
        == len(BOARDS)
    )


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_template_variables(name: str) -> None:
    variables = {v["name"]: v for v in BOARDS[name]["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "rank"]
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    job, rank = variables["job"], variables["rank"]
    for var in (job, rank):
        assert var["type"] == "query" and var["datasource"] == {
            "type": "prometheus",
            "uid": "${datasource}",
        }
        assert var["query"].startswith("label_values(") and var["definition"] == var["query"]
    assert job["query"] == "label_values(ddpmon_rank_info, job)" and not job["multi"]
    assert rank["query"] == 'label_values(ddpmon_rank_info{job="$job"}, rank)'
    assert rank["multi"] and rank["includeAll"] and rank["allValue"] == ".*"


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_panel_ids_unique_and_grid_positions_valid(name: str) -> None:
    panels = _panels(BOARDS[name])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert set(g) == {"h", "w", "x", "y"} and all(isinstance(v, int) for v in g.values()), p[
            "title"
        ]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0
        assert g["x"] + g["w"] <= 24, f"{p['title']} is wider than Grafana's 24 columns"
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine


@pytest.mark.parametrize(
    ("board", "panel"), _all_panels(), ids=lambda v: v if isinstance(v, str) else v["title"]
)
def test_every_panel_has_unit_description_and_datasource(board: str, panel: dict[str, Any]) -> None:
    assert panel["type"] in PANEL_TYPES
    unit = panel["fieldConfig"]["defaults"]["unit"]
    assert unit in GRAFANA_UNITS or unit.startswith("suffix:"), f"unknown unit {unit!r}"
    description = panel["description"]
    assert len(description) >= 80, "say what the panel shows and what a bad value looks like"
    assert re.search(r"\b[Bb]ad\b", description), (
        "the description must say what a bad value looks like"
    )
    assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    targets = panel["targets"]
    assert targets and [t["refId"] for t in targets] == [
        chr(ord("A") + i) for i in range(len(targets))
    ]
    for t in targets:
        assert t["datasource"] == panel["datasource"] and t["expr"].strip()
        assert t["legendFormat"]


def _steps(board: str, title: str) -> list[tuple[float | None, str]]:
    (panel,) = [p for p in _panels(BOARDS[board]) if p["title"] == title]
    return [
        (s["value"], s["color"]) for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    ]


def test_each_panel_keeps_its_own_thresholds() -> None:
    """Panels once shared one thresholds object, so every panel (a stat of steps/s, ranks
    reporting) showed the last panel's red-from-1 colours."""
    overview, gpus = "ddp-job-overview.json", "ddp-gpus.json"
    assert _steps(overview, "Steps per second") == [(None, "green")]
    assert _steps(overview, "Ranks reporting") == [(None, "green")]
    assert _steps(overview, "Exposed communication") == [
        (None, "green"),
        (0.2, "orange"),
        (0.3, "red"),
    ]
    assert _steps(overview, "Ranks suspected hung") == [(None, "green"), (1, "red")]
    assert _steps(overview, "Liveness per rank") == [(None, "red"), (1, "green")]
    assert _steps(gpus, "GPU temperature") == [(None, "green"), (80, "orange"), (87, "red")]
    objects = [id(p["fieldConfig"]["defaults"]["thresholds"]) for _, p in _all_panels()]
    assert len(set(objects)) == len(objects)
    assert dashboards.build() == BOARDS  # building again gives the same boards


def test_titles_unique_within_each_board() -> None:
    for board in BOARDS.values():
        titles = [p["title"] for p in _panels(board)]
        assert len(titles) == len(set(titles))


def test_overview_covers_what_a_ddp_job_needs() -> None:
    exprs = " ".join(
        " ".join(sorted(rules.reads(t["expr"])))
        for p in _panels(BOARDS["ddp-job-overview.json"])
        for t in p["targets"]
    )
    for name in (
        "ddpmon_step_seconds",
        "ddpmon_steps_total",
        "ddpmon_step_phase_seconds_total",
        "ddpmon_exposed_comm_seconds",
        "ddpmon_allreduce_seconds",
        "ddpmon_allreduce_bus_bandwidth_bytes_per_second",
        "ddpmon_unused_parameters",
        "ddpmon_hang_suspected",
        "ddpmon_rank_up",
    ):
        assert name in exprs, name


def test_gpu_board_covers_every_gpu_metric_of_the_catalog() -> None:
    exprs = " ".join(t["expr"] for p in _panels(BOARDS["ddp-gpus.json"]) for t in p["targets"])
    missing = [
        m.name
        for m in catalog.METRICS
        if "gpu" in m.labels
        and m.name not in exprs
        and m.name not in ("ddpmon_gpu_last_xid_timestamp_seconds", "ddpmon_gpu_process_info")
    ]
    assert not missing


# -- metric names ------------------------------------------------------------------------------


def test_every_query_uses_only_catalog_names() -> None:
    known = catalog.series_names() | catalog.RECORD_NAMES | dashboards.PROMETHEUS_OWN
    used: set[str] = set()
    for board in BOARDS.values():
        for p in _panels(board):
            for t in p["targets"]:
                names = dashboards.metric_names(t["expr"])
                assert names, f"{p['title']}: no metric found in {t['expr']!r}"
                assert names <= known, f"{p['title']}: {sorted(names - known)} not in the catalog"
                used |= names
        for v in board["templating"]["list"]:
            if v["type"] == "query":
                assert dashboards.metric_names(v["query"]) == {"ddpmon_rank_info"}
    assert len(used) >= 30


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'sum by (rank) (rate(ddpmon_steps_total{job="$job", rank=~"$rank"}[$__rate_interval]))',
            {"ddpmon_steps_total"},
        ),
        (
            "histogram_quantile(0.9, sum by (rank, le) (rate(ddpmon_step_seconds_bucket[5m])))",
            {"ddpmon_step_seconds_bucket"},
        ),
        (
            "a > on (job) group_left () 1.2 * quantile by (job) (0.5, b offset 30m) and c == 1e3",
            {"a", "b", "c"},
        ),
        (
            'max by (job) (x{reason=~"(?i).*thermal.*", a="by (q)"}) or vector(0) unless time() - y',
            {"x", "y"},
        ),
        ('label_values(ddpmon_rank_info{job="$job"}, rank)', {"ddpmon_rank_info"}),
        ("max by (instance) (up) * on (instance) group_left last_over_time(z[1h:1m])", {"up", "z"}),
    ],
)
def test_metric_names_parses_promql(expr: str, names: set[str]) -> None:
    assert dashboards.metric_names(expr) == names


def test_check_expr_rejects_unknown_names_and_rates_of_gauges() -> None:
    with pytest.raises(
        ValueError, match="ddpmon_step_time_seconds.*not in ddpmon's metric catalog"
    ):
        dashboards.check_expr("rate(ddpmon_step_time_seconds_sum[5m])")
    with pytest.raises(ValueError, match="ddpmon_unused_parameters.*not a counter"):
        dashboards.check_expr("rate(ddpmon_unused_parameters[5m])")
    assert dashboards.check_expr("increase(ddpmon_gpu_ecc_errors_total[10m])") == {
        "ddpmon_gpu_ecc_errors_total"
    }


def test_source_of_tells_where_series_come_from() -> None:
    assert dashboards.source_of("ddpmon_rank_up * on (instance) up") == {"daemon", "prometheus"}
    assert dashboards.source_of("rate(ddpmon_allreduce_seconds_sum[1m])") == {"rank"}
    assert dashboards.source_of("ddpmon_gpu_power_watts") == {"gpu"}


def test_export_writes_the_boards(tmp_path: Path) -> None:
    paths = dashboards.export(tmp_path / "new" / "dir")
    assert sorted(p.name for p in paths) == sorted(BOARDS)
    for p in paths:
        assert json.loads(p.read_text()) == BOARDS[p.name]
