"""The alert rules and deployment files: catalog names only, every alert documented and unit
tested, the Kubernetes copies in step with their sources. (promtool itself runs in
tests/integration/test_promtool.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpmon import dashboards
from ddpmon.metrics import catalog
from ddpmon.steps import PART_TABLE
from tests.support import rules

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = yaml.safe_load((DEPLOY / "prometheus" / "ddpmon-rules.yml").read_text())
ALERTS = [r for g in RULES["groups"] for r in g["rules"] if "alert" in r]
RECORDS = {r["record"]: r for g in RULES["groups"] for r in g["rules"] if "record" in r}
SEVERITIES = {"critical", "warning", "info"}


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def test_rules_cover_what_a_ddp_job_needs() -> None:
    names = {r["alert"] for r in ALERTS}
    assert {
        "DDPHangCulprit",
        "DDPJobNoProgress",
        "DDPHangSuspected",
        "DDPRankDown",
        "DDPRankEndpointDown",
        "DDPStraggler",
        "DDPHighExposedCommunication",
        "DDPUnusedParametersAppeared",
        "DDPGPUThermalThrottling",
        "DDPGPUPowerThrottling",
        "DDPGPUXidError",
        "DDPGPUUncorrectedECCErrors",
    } <= names
    assert len(names) == len(ALERTS), "alert names must be unique"


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r["alert"])
def test_every_alert_is_complete(rule: dict[str, Any]) -> None:
    assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
    assert re.fullmatch(r"DDP[A-Za-z]+", rule["alert"])
    assert rule["labels"]["severity"] in SEVERITIES
    assert set(rule["annotations"]) == {"summary", "description"}
    assert "{{ $labels.job }}" in rule["annotations"]["summary"]
    assert len(rule["annotations"]["description"]) >= 100, "say what happened and what to do"
    if "for" in rule:
        assert re.fullmatch(r"\d+[smh]", rule["for"])


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r["alert"])
def test_every_expression_uses_only_catalog_names(rule: dict[str, Any]) -> None:
    names = dashboards.check_expr(rule["expr"])  # raises on unknown names and rates of gauges
    assert names and names <= catalog.series_names() | catalog.RECORD_NAMES | {"up", "ALERTS"}


def test_the_records_are_the_catalogs_and_read_only_ranks_series() -> None:
    """The recording rules come first in their group, and every alert that reads a record
    is in the record's group (a rule sees what the rules before it in its group wrote in
    the same evaluation; groups run side by side); they record what the catalog lists, each
    reading catalog series or an earlier record of its group, never a gauge's rate."""
    assert list(RECORDS) == [r.name for r in catalog.RECORDS]
    for group in RULES["groups"]:
        kinds = ["record" if "record" in r else "alert" for r in group["rules"]]
        assert kinds == sorted(kinds, reverse=True), group["name"]
        seen: set[str] = set()
        for rule in group["rules"]:
            reads = dashboards.check_expr(rule["expr"])
            assert reads & catalog.RECORD_NAMES <= seen, (group["name"], rule)
            if "record" in rule:
                assert set(rule) == {"record", "expr"}
                level = rule["record"].split(":")[0]
                assert level in {"job", "job_rank", "job_phase", "job_bucket"}, rule["record"]
                seen.add(rule["record"])


def test_the_alerts_on_job_figures_read_the_records() -> None:
    """What a board also shows is computed once: the alerts read the recorded series."""
    reads = {r["alert"]: dashboards.metric_names(r["expr"]) for r in ALERTS}
    assert reads["DDPStraggler"] == {"job_rank:ddpmon_straggler_score:rate5m"}
    assert reads["DDPHighExposedCommunication"] == {"job:ddpmon_exposed_comm_ratio:rate10m"}
    assert "job:ddpmon_ranks_waiting:count" in reads["DDPHangCulprit"]
    assert "job:ddpmon_ranks_reporting:count" in reads["DDPRankEndpointDown"]


def test_the_culprit_alert_quiets_the_per_rank_hang_alerts() -> None:
    """One alert for the rank a hang waits for: the alerts that fire for every waiting rank
    (or for the culprit again) stand back while DDPHangCulprit stands. A rule sees only the
    ALERTS of the rules before it in its group, so the culprit comes first."""
    (group,) = [
        g for g in RULES["groups"] if any(r.get("alert") == "DDPHangCulprit" for r in g["rules"])
    ]
    order = [r["alert"] for r in group["rules"] if "alert" in r]
    quiet = {
        "DDPHangSuspected": "(job)",
        "DDPJobNoProgress": "(job)",
        "DDPRankDown": "(job, rank)",
        "DDPRankEndpointDown": "(job, rank)",
    }
    assert order[0] == "DDPHangCulprit"
    for name, on in quiet.items():
        expr = next(r["expr"] for r in ALERTS if r["alert"] == name)
        assert expr.rstrip().endswith(f'unless on {on} ALERTS{{alertname="DDPHangCulprit"}}'), name
    others = [r for r in ALERTS if r["alert"] not in quiet]
    assert not [r["alert"] for r in others if "ALERTS" in r["expr"]]
    culprit = next(r for r in ALERTS if r["alert"] == "DDPHangCulprit")
    assert culprit["labels"]["severity"] == "critical" and culprit["for"] == "1m"
    assert {
        "ddpmon_activity",
        "ddpmon_rank_activity",
        "job_rank:ddpmon_activity:not_stepping",
        "job_rank:ddpmon_hang_suspected:max",
        "job_rank:ddpmon_rank_info:endpoint_down",
        "job:ddpmon_ranks_waiting:count",
    } == dashboards.metric_names(culprit["expr"])


def test_the_straggler_rule_scores_busy_time_against_the_median_for_10_minutes() -> None:
    """The straggler score of the doctor and the dashboard: busy time per step (every part but
    the wait for the other ranks) against the job's median rank."""
    from ddpmon.dashboards.boards import STRAGGLER_SCORE

    rule = next(r for r in ALERTS if r["alert"] == "DDPStraggler")
    assert rule["for"] == "10m"
    assert rule["expr"].strip() == "job_rank:ddpmon_straggler_score:rate5m >= 0.2"
    assert dashboards.metric_names(STRAGGLER_SCORE) == {"job_rank:ddpmon_straggler_score:rate5m"}
    score = RECORDS["job_rank:ddpmon_straggler_score:rate5m"]["expr"]
    assert "quantile by (job) (0.5," in score and score.rstrip().endswith("- 1")
    busy = RECORDS["job_rank:ddpmon_busy_seconds_per_step:rate5m"]["expr"]
    assert busy.count('phase="exposed_comm"') == 1  # the step less its one waiting part
    assert {p.name for p in PART_TABLE if p.waiting} == {"exposed_comm"}
    assert dashboards.metric_names(busy) == {
        "ddpmon_step_phase_seconds_total",
        "ddpmon_step_seconds_sum",
        "ddpmon_step_seconds_count",
    }


def test_the_throttling_rules_match_nvml_reason_names() -> None:
    """The reason label values are NVML's clock event reasons in snake case."""
    thermal = next(r for r in ALERTS if r["alert"] == "DDPGPUThermalThrottling")["expr"]
    power = next(r for r in ALERTS if r["alert"] == "DDPGPUPowerThrottling")["expr"]
    regex = {
        name: re.search(r'reason=~"([^"]+)"', expr).group(1)
        for name, expr in (("thermal", thermal), ("power", power))  # type: ignore[union-attr]
    }

    def matches(kind: str, reason: str) -> bool:
        pattern = regex[kind].replace("(?i)", "")
        return re.fullmatch(pattern, reason, re.I) is not None

    for reason in ("hw_thermal_slowdown", "sw_thermal_slowdown"):
        assert matches("thermal", reason) and not matches("power", reason)
    for reason in ("hw_power_brake_slowdown", "hw_slowdown"):
        assert matches("power", reason)
    for reason in ("gpu_idle", "sw_power_cap", "applications_clocks_setting", "sync_boost"):
        assert not matches("thermal", reason) and not matches("power", reason)


def test_every_alert_has_a_promtool_test_that_fires_it() -> None:
    fired: set[str] = set()
    quiet: set[str] = set()
    for path in sorted((DEPLOY / "prometheus" / "tests").glob("*.yml")):
        spec = _load(path)
        assert spec["rule_files"] == ["../ddpmon-rules.yml"]
        for test in spec["tests"]:
            for case in test.get("alert_rule_test", []):
                (fired if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {r["alert"] for r in ALERTS}
    assert names <= fired, f"no promtool test fires {sorted(names - fired)}"
    assert len(quiet) >= 8, "test that the alerts stay quiet when nothing is wrong, too"


# -- Prometheus, Grafana, docker-compose ---------------------------------------------------------


def test_prometheus_config_keeps_the_exported_job_and_rank_labels() -> None:
    config = _load(DEPLOY / "prometheus" / "prometheus.yml")
    assert config["rule_files"] == ["ddpmon-rules.yml"]
    jobs = {c["job_name"]: c for c in config["scrape_configs"]}
    assert set(jobs) == {"ddpmon-ranks", "ddpmon-daemons"}
    for job in jobs.values():
        assert job["honor_labels"] is True
        assert job["file_sd_configs"][0]["files"]
    for pattern in (
        jobs["ddpmon-ranks"]["file_sd_configs"][0]["files"][0],
        jobs["ddpmon-daemons"]["file_sd_configs"][0]["files"][0],
    ):
        examples = list((DEPLOY / "prometheus").glob(pattern))
        assert examples, f"no example file for {pattern}"
        for example in examples:
            groups = json.loads(example.read_text())
            assert groups and all(
                re.fullmatch(r"[\w.-]+:\d+", t) for g in groups for t in g["targets"]
            )


def test_grafana_provisioning_and_compose_agree() -> None:
    compose = _load(DEPLOY / "docker-compose.yml")
    grafana, prometheus = compose["services"]["grafana"], compose["services"]["prometheus"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("."))
    provider = _load(DEPLOY / "grafana" / "provisioning" / "dashboards" / "ddpmon.yml")[
        "providers"
    ][0]
    assert provider["type"] == "file" and mounts["../dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert (DEPLOY / "grafana" / "provisioning").is_dir() and (ROOT / "dashboards").is_dir()
    datasource = _load(DEPLOY / "grafana" / "provisioning" / "datasources" / "ddpmon.yml")[
        "datasources"
    ][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://localhost:9090"
    assert "127.0.0.1:9090" in " ".join(prometheus["command"])
    assert any(v.startswith("./prometheus:/etc/prometheus") for v in prometheus["volumes"])
    assert grafana["network_mode"] == prometheus["network_mode"] == "host"


# -- Kubernetes ----------------------------------------------------------------------------------


def test_prometheusrule_carries_exactly_the_rules_file() -> None:
    rule = _load(DEPLOY / "kubernetes" / "prometheusrule.yaml")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == RULES["groups"]


def test_dashboards_configmap_carries_exactly_the_boards() -> None:
    cm = _load(DEPLOY / "kubernetes" / "dashboards-configmap.yaml")
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert {k: json.loads(v) for k, v in cm["data"].items()} == dashboards.build()
    assert len((DEPLOY / "kubernetes" / "dashboards-configmap.yaml").read_bytes()) < 1_000_000


def test_podmonitor_scrapes_every_rank_port_with_honor_labels() -> None:
    pm = _load(DEPLOY / "kubernetes" / "podmonitor.yaml")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["kind"] == "PodMonitor"
    assert pm["spec"]["selector"]["matchLabels"] == {"ddpmon.io/scrape": "true"}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True and endpoint["path"] == "/metrics"
    (keep,) = endpoint["relabelings"]
    assert keep["action"] == "keep" and keep["sourceLabels"] == [
        "__meta_kubernetes_pod_container_port_name"
    ]
    for name, kept in (("ddpmon-0", True), ("ddpmon-7", True), ("ddpmon", False), ("http", False)):
        assert bool(re.fullmatch(keep["regex"], name)) is kept


def test_every_kubernetes_manifest_parses() -> None:
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], path


def test_the_summary_keeps_every_rank_series_the_alerts_and_the_overview_read() -> None:
    """metrics_detail="summary" must leave the alerts and the job overview working: each
    series they read (through the records) that a rank serves is one the summary keeps, a
    histogram's buckets with bounds to read a quantile from."""
    read = rules.overview_and_alerts_read()
    checked = 0
    for name in sorted(read):
        spec = catalog.BY_NAME.get(name) or catalog.BY_NAME.get(
            re.sub(r"_(bucket|sum|count)$", "", name)
        )
        if spec is None or spec.source not in ("rank", "host"):
            continue
        checked += 1
        assert spec.summary, name
        if name.endswith("_bucket"):
            assert len(spec.summary_bounds) >= 3, name
    assert checked >= 15, read
