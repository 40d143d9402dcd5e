"""A real Prometheus scrapes a real 2-rank gloo DDP job with ddpmon attached (and the node
daemon when it exists); every dashboard query and every alert expression runs against it,
with the ranks exporting every series and with them exporting their summary
(``metrics_detail``).

Rank 1 is a straggler and has unused parameters (tests/integration/job_worker.py), so the
panels and rules are checked for the right values and ranks, not only for "some data".
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from ddpmon import dashboards
from ddpmon.metrics import catalog
from ddpmon.state import files as statefile
from tests.integration import promserver
from tests.integration.promserver import Prometheus
from tests.support import harness, rules

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.skipif(promserver.binary() is None, reason=promserver.MISSING),
]

ROOT = promserver.ROOT
JOB = "itest-ddp"
RATE_INTERVAL = "10s"  # what Grafana's $__rate_interval stands for in these tests


class Job:
    """Everything the tests query: Prometheus, the ranks and the node daemon."""

    def __init__(
        self, prom: Prometheus, workdir: Path, procs: list[subprocess.Popen], detail: str
    ) -> None:
        self.prom = prom
        self.workdir = workdir
        self.procs = procs
        self.detail = detail


def substitute(expr: str) -> str:
    """Replace Grafana's variables the way Grafana would for this job, all ranks."""
    out = (
        expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("$__range", "1m")
        .replace("$__interval", "2s")
        .replace('"$job"', f'"{JOB}"')
        .replace('"$rank"', '".*"')
    )
    assert "$" not in out, f"a Grafana variable is left in {out!r}"
    return out


def about_gpus(expr: str) -> bool:
    """Whether a query reads a GPU's series (a metric with a ``gpu`` label in the catalog)."""
    names = {re.sub(r"_(bucket|sum|count)$", "", n) for n in dashboards.metric_names(expr)}
    return any("gpu" in catalog.BY_NAME[n].labels for n in names if n in catalog.BY_NAME)


ONLY_WHEN_WRONG = {"ddpmon_memory_creep_seconds_left"}
"""Series a rank serves only once something is wrong (memory that creeps): none here."""


def needs_data(expr: str) -> bool:
    """Whether a query must return series in this job: every one but a GPU's (none here) and
    those served only once something is wrong."""
    return not about_gpus(expr) and not dashboards.metric_names(expr) & ONLY_WHEN_WRONG


@pytest.fixture(scope="module", params=["full", "summary"])
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    detail = request.param
    workdir = tmp_path_factory.mktemp(f"prom-job-{detail}")
    prom = Prometheus(workdir / "prometheus")
    prom.workdir.mkdir()
    procs: list[subprocess.Popen] = []
    daemon_proc: subprocess.Popen | None = None
    try:
        prom.start()
        procs = harness.start_ranks(
            "train_until",
            2,
            workdir / "ranks",
            env={"DDPMON_METRICS_DETAIL": detail},
            args=(JOB, "120"),
            module="tests.integration.job_worker",
        )
        ports = promserver.wait_state_ports(
            workdir / "ranks" / "state", 2, procs, workdir / "ranks"
        )
        promserver.write_targets(prom.ranks_sd, [f"127.0.0.1:{ports[r]}" for r in sorted(ports)])
        targets = 3  # two ranks and the daemon
        daemon_proc, daemon_port = promserver.start_daemon(
            workdir / "ranks" / "state", workdir / "daemon.log"
        )
        promserver.write_targets(prom.daemons_sd, [f"127.0.0.1:{daemon_port}"])

        def all_up() -> bool:
            up = prom.vector("up")
            return len(up) == targets and all(v == 1 for v in up.values())

        prom.wait_for(f"{targets} targets up", all_up, timeout=30)
        # enough history for every rate window, and the per-bucket series
        prom.wait_for(
            "10 s of samples from both ranks",
            lambda: (
                len(prom.vector(f'count_over_time(ddpmon_steps_total{{job="{JOB}"}}[30s]) >= 10'))
                == 2
            ),
            timeout=40,
        )
        prom.wait_for(
            "bus bandwidth series",
            lambda: prom.vector(f'ddpmon_allreduce_bus_bandwidth_bytes_per_second{{job="{JOB}"}}'),
            timeout=20,
        )
        if daemon_proc is not None:
            prom.wait_for(
                "the daemon's liveness series",
                lambda: len(prom.vector(f'ddpmon_rank_up{{job="{JOB}"}} == 1')) == 2,
                timeout=20,
            )
        prom.wait_for(
            "every rule evaluated",
            lambda: all(
                r.get("health") != "unknown"
                for g in prom.api("rules")["data"]["groups"]
                for r in g["rules"]
            ),
            timeout=20,
        )
        yield Job(prom, workdir, procs, detail)
    finally:
        harness.finish(procs, workdir / "ranks")
        if daemon_proc is not None:
            promserver.stop_daemon(daemon_proc)
        prom.stop()


def _queries() -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for _name, board in dashboards.build().items():
        for panel in dashboards.panels(board):
            for target in panel.get("targets", []):
                out.append((board["title"], panel["title"], target))
    return out


def test_every_panel_query_is_valid_and_returns_data(job: Job) -> None:
    problems = []
    checked = required = 0
    for board, title, target in _queries():
        expr = substitute(target["expr"])
        if board == "DDP GPUs":
            assert about_gpus(expr), f"{title}: a panel on the GPU board that reads no GPU series"
        body = job.prom.query(expr)
        checked += 1
        if body.get("status") != "success":
            problems.append(f"{board} / {title} [{target['refId']}]: {body.get('error')}\n  {expr}")
            continue
        if not needs_data(target["expr"]):
            continue
        required += 1
        result = body["data"]["result"]
        if not result:
            problems.append(f"{board} / {title} [{target['refId']}]: no data\n  {expr}")
            continue
        if "{{rank}}" in target["legendFormat"]:
            ranks = sorted({r["metric"].get("rank", "") for r in result})  # a line or more each
            if ranks != ["0", "1"]:
                problems.append(
                    f"{board} / {title} [{target['refId']}]: ranks {ranks}, expected 0 and 1"
                )
    assert not problems, "\n".join(problems)
    assert checked >= 40 and required >= 25, (checked, required)


def test_template_variables_find_the_job_and_its_ranks(job: Job) -> None:
    board = dashboards.build()["ddp-job-overview.json"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for name, expected in (("job", JOB), ("rank", ["0", "1"])):
        match = re.match(r"label_values\((.*), (\w+)\)$", variables[name]["query"])
        assert match, variables[name]["query"]
        selector = match.group(1).replace("$job", JOB)
        values = job.prom.api(f"label/{match.group(2)}/values", **{"match[]": selector})["data"]
        if isinstance(expected, list):
            assert sorted(values) == expected
        else:
            assert expected in values


def _panel(title: str) -> dict[str, Any]:
    for board in dashboards.build().values():
        for panel in dashboards.panels(board):
            if panel["title"] == title:
                return panel
    raise KeyError(title)


def _values(job: Job, title: str, ref: str = "A") -> dict[str, float]:
    target = next(t for t in _panel(title)["targets"] if t["refId"] == ref)
    return job.prom.by(substitute(target["expr"]), "rank")


def test_panels_show_the_straggler_and_its_waiting_peer(job: Job) -> None:
    busy = _values(job, "Straggler: busy time per step")
    wait = _values(job, "Straggler: all-reduce wait per step")
    score = _values(job, "Straggler score")
    # rank 1 sleeps 20 ms in every forward: it is busy longer, rank 0 waits for it
    assert busy["1"] > busy["0"] + 0.01, busy
    assert wait["0"] > wait["1"] and wait["0"] > 0.005, wait
    assert score["1"] > 0.1 and score["0"] < 0, score
    parts = job.prom.by(substitute(_panel("Step parts")["targets"][0]["expr"]), "phase")
    assert {"data_wait", "forward", "backward", "exposed_comm", "optimizer", "other"} <= set(
        parts
    ), parts
    # The job's forward per step averages the two ranks': about half of rank 1's 20 ms sleep
    # (10.4 to 11.0 ms in all here), which rate()'s extrapolation at each rank's window edges
    # moves by a few percent (9.98 ms once); without the sleep it is under 1 ms.
    assert parts["forward"] > 0.008, parts


def test_panels_show_unused_parameters_steps_and_buckets(job: Job) -> None:
    assert _values(job, "Unused parameters per rank") == {
        "0": 0.0,
        "1": 2.0,
    }  # spare.weight, spare.bias
    assert _values(job, "Unused parameters")[""] == 2.0
    steps = _values(job, "Steps per second per rank")
    assert steps["0"] > 5 and abs(steps["0"] - steps["1"]) / steps["0"] < 0.2, steps
    step_time = _values(job, "Step time per rank")
    assert 0.02 < step_time["0"] < 1.0, step_time
    assert _values(job, "Ranks reporting")[""] == 2.0
    assert _values(job, "Ranks suspected hung")[""] == 0.0
    assert _values(job, "Activity per rank") == {"0": 0.0, "1": 0.0}  # stepping
    ratio = _values(job, "Exposed communication ratio per rank")
    assert all(0 <= v <= 1 for v in ratio.values()), ratio
    target = _panel("All-reduce time per bucket")["targets"][0]
    buckets = job.prom.by(substitute(target["expr"]), "bucket")
    assert all(v > 0 for v in buckets.values()), buckets
    if job.detail == "summary":
        assert set(buckets) == {"all"}, buckets
    else:
        assert len(buckets) >= 2 and "all" not in buckets, buckets
    liveness = _values(job, "Liveness per rank", "B")
    assert liveness == {"0": 1.0, "1": 1.0}
    assert _values(job, "Liveness per rank", "A") == {"0": 1.0, "1": 1.0}


def test_memory_panels_show_each_ranks_memory_and_nothing_creeping(job: Job) -> None:
    rss = _values(job, "Resident memory per rank")
    assert set(rss) == {"0", "1"} and all(50e6 < v < 4e9 for v in rss.values()), rss
    target = _panel("Memory growth per rank")["targets"][0]
    growth = job.prom.query(substitute(target["expr"]))["data"]["result"]
    lines = {(g["metric"]["rank"], g["metric"]["process"], g["metric"]["kind"]) for g in growth}
    if job.detail == "summary":  # one series per rank: the fastest-growing of its memories
        assert lines == {("0", "all", "all"), ("1", "all", "all")}, lines
    else:
        assert {("0", "rank", "rss"), ("1", "rank", "rss")} <= lines, lines
    # a healthy job: its trends are flat (well under a leak of 1 MiB a step at ~30 steps/s)
    assert all(abs(float(g["value"][1])) < 4 << 20 for g in growth), growth
    assert _values(job, "Time left before a memory limit") == {}  # nothing creeps


def _rules() -> list[dict[str, Any]]:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "ddpmon-rules.yml").read_text())
    return [r for g in rules["groups"] for r in g["rules"]]


def _name(rule: dict[str, Any]) -> str:
    return rule.get("alert") or rule["record"]


def test_every_rule_expression_is_valid_and_evaluates_healthy(job: Job) -> None:
    problems = []
    for rule in _rules():
        body = job.prom.query(rule["expr"])
        if body.get("status") != "success":
            problems.append(f"{_name(rule)}: {body.get('error')}")
    groups = job.prom.api("rules")["data"]["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    assert sorted(loaded) == sorted(_name(r) for r in _rules())
    for name, rule in loaded.items():
        if rule["health"] != "ok":
            problems.append(f"{name}: health {rule['health']}: {rule.get('lastError')}")
    assert not problems, "\n".join(problems)


def test_rules_see_the_straggler_and_nothing_wrong(job: Job) -> None:
    straggler = next(r for r in _rules() if r.get("alert") == "DDPStraggler")
    found = [
        {k: v for k, v in dict(m).items() if k != "__name__"}
        for m in job.prom.vector(straggler["expr"])
    ]
    assert found == [{"job": JOB, "rank": "1"}]
    alerts = job.prom.api("alerts")["data"]["alerts"]
    active = {(a["labels"]["alertname"], a["labels"].get("rank")) for a in alerts}
    assert ("DDPStraggler", "1") in active, alerts  # pending: it needs 10 minutes to fire
    for quiet in (
        "DDPHangCulprit",
        "DDPJobNoProgress",
        "DDPHangSuspected",
        "DDPRankDown",
        "DDPRankEndpointDown",
        "DDPUnusedParametersAppeared",
        "DDPMonitorPartOff",
    ):
        assert not [a for a in active if a[0] == quiet], alerts


def test_the_ranks_serve_what_the_rules_and_the_overview_read(job: Job) -> None:
    """Every series name the alert rules and the job overview read (through the recorded
    series) that a rank serves is in Prometheus for this job, in either mode; a summary
    scrape holds at most 40 series. Left out: the series a rank serves only once something
    is wrong (a silent mistake, a part switched off), and the GPU's (none here)."""
    wanted = {
        n
        for n in rules.overview_and_alerts_read()
        if dashboards.source_of(n) <= {"rank", "host"}
        and n not in ("ddpmon_advice", "ddpmon_internal_errors_total", *ONLY_WHEN_WRONG)
    }
    assert len(wanted) >= 15, wanted
    present = set(
        job.prom.by(f'count by (__name__) ({{job="{JOB}", __name__=~"ddpmon_.+"}})', "__name__")
    )
    assert wanted <= present, sorted(wanted - present)
    scraped = job.prom.by('scrape_samples_scraped{job="ddpmon-ranks"}', "instance")
    assert len(scraped) == 2, scraped
    if job.detail == "summary":
        assert all(v <= 40 for v in scraped.values()), scraped
    else:
        assert all(v > 100 for v in scraped.values()), scraped


def test_the_daemon_serves_the_nodes_figures(job: Job) -> None:
    """The node daemon's figures of its ranks, scraped by Prometheus: both ranks up and
    none stuck, the straggler (rank 1, which sleeps in its forward) named as the node's
    slowest rank with the busy time its state file gives, and the ranks' memory summed."""
    state_dir = str(job.workdir / "ranks" / "state")
    sel = f'{{job="{JOB}"}}'

    def figure(name: str) -> float:
        found = job.prom.vector(f"{name}{sel}")
        assert len(found) == 1, (name, found)
        return next(iter(found.values()))

    assert figure("ddpmon_node_ranks_up") == 2
    by_activity = job.prom.by(f"ddpmon_node_ranks{sel}", "activity")
    assert set(by_activity) == set(catalog.DAEMON_ACTIVITIES), by_activity
    assert sum(by_activity.values()) == 2 and by_activity["stuck"] == 0, by_activity
    assert figure("ddpmon_node_slowest_rank") == 1
    busy = {
        r: statefile.read(statefile.path_for(state_dir, r)).timings.busy_seconds for r in (0, 1)
    }
    assert busy[1] is not None and busy[0] is not None
    assert busy[1].median > busy[0].median + 0.01, busy  # the straggler's sleep: 20 ms
    assert figure("ddpmon_node_busy_seconds_max") == pytest.approx(busy[1].median, rel=0.5)
    assert figure("ddpmon_node_busy_seconds_max") > figure("ddpmon_node_busy_seconds_median")
    assert figure("ddpmon_node_step_seconds_max") >= figure("ddpmon_node_step_seconds_median")
    assert figure("ddpmon_node_step_seconds_median") >= figure("ddpmon_node_busy_seconds_median")
    resident = sum(psutil.Process(p.pid).memory_info().rss for p in job.procs)
    assert figure("ddpmon_node_resident_memory_bytes") == pytest.approx(resident, rel=0.3)


def test_promtool_accepts_the_test_config(job: Job) -> None:
    promtool = promserver.binary("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (it comes with Debian's prometheus package)")
    done = subprocess.run(
        [promtool, "check", "config", str(job.prom.config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_watched_job_stops_cleanly(job: Job) -> None:
    """Last in this module: after all the scraping, the ranks stop together and exit 0."""
    for rank in (0, 1):
        state = statefile.read(statefile.path_for(str(job.workdir / "ranks" / "state"), rank))
        assert state.job == JOB and state.rank == rank and state.port
    (job.workdir / "ranks" / "stop").touch()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(p.poll() is None for p in job.procs):
        time.sleep(0.1)
    results = harness.collect(job.procs, job.workdir / "ranks")
    assert [r.returncode for r in results] == [0, 0], harness.describe(results)
    steps = [r.result["steps"] for r in results]
    assert steps[0] == steps[1] > 100, steps
    assert [sorted(r.result["unused"]) for r in results] == [[], ["spare.bias", "spare.weight"]]
