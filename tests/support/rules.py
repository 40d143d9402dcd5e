"""The shipped Prometheus rules (deploy/prometheus/ddpmon-rules.yml), and which ranks' series
an expression reads once the recorded series it reads are followed to theirs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ddpmon import dashboards

ROOT = Path(__file__).resolve().parents[2]
RULES: dict[str, Any] = yaml.safe_load(
    (ROOT / "deploy" / "prometheus" / "ddpmon-rules.yml").read_text()
)
ALERTS: list[dict[str, Any]] = [r for g in RULES["groups"] for r in g["rules"] if "alert" in r]
RECORDS: dict[str, str] = {
    r["record"]: r["expr"] for g in RULES["groups"] for r in g["rules"] if "record" in r
}


def reads(expr: str) -> set[str]:
    """The names ``expr`` reads, a recorded series replaced by what its rule reads."""
    out: set[str] = set()
    for name in dashboards.metric_names(expr):
        out |= reads(RECORDS[name]) if name in RECORDS else {name}
    return out


def overview_and_alerts_read() -> set[str]:
    """Every series name the job overview board and the alert rules read, through the
    records."""
    board = dashboards.build()["ddp-job-overview.json"]
    exprs = [t["expr"] for p in dashboards.panels(board) for t in p.get("targets", [])]
    return set().union(*(reads(e) for e in exprs + [a["expr"] for a in ALERTS]))
