"""``--prometheus URL``: a real Prometheus (Debian's) scrapes two real ``ddpmon daemon
--serve-state`` processes and a third daemon's address where nothing listens (a dead node),
beside a job of targets that are no daemons; ``doctor``, ``report`` and ``compare`` find the
daemons among its targets and say what ``--from`` listing each of them by hand says, the
dead one included. A job of 4 ranks spread over the three nodes: rank 0 stuck, the others
waiting in an all_reduce."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddpmon.state import history
from tests.integration import promserver
from tests.integration.promserver import Prometheus
from tests.support import states
from tests.support.commands import ROOT, env, run_doctor, start_daemon, terminate
from tests.support.tls import bcrypt_hash
from tools import synthetic

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(promserver.binary() is None, reason=promserver.MISSING),
]

JOB, WORLD = "discovered", 4


@dataclass
class Cluster:
    prometheus: Prometheus
    daemons: list[str]
    """Every daemon's address, the dead one's included, sorted (as the doctor lists them)."""
    node_a: str
    dead: str
    root: Path

    def fresh_states(self) -> None:
        """Every rank's state file as just written: a test that compares two doctor runs
        must not have them fall on either side of the age where a silent rank counts as
        gone (10 s; the fixture's Prometheus may take longer than that to scrape)."""
        _write_states(self.root)


def _write_states(root: Path) -> None:
    """Both nodes' state files, as of now: ranks 0 and 1 on node a, 2 and 3 on node b."""
    states.restart_clock()
    _node(root / "a", [0, 1], root / "histories")
    _node(root / "b", [2, 3], root / "histories")


def _node(directory: Path, ranks: list[int], histories: Path) -> None:
    for rank in ranks:
        waiting = [] if rank == 0 else [states.waiting_in("all_reduce", 5, 30.0)]
        states.write(directory, states.state(rank, WORLD, job=JOB, silent=30.0, in_flight=waiting))
        shutil.copy(history.path_for(str(histories), rank), history.path_for(str(directory), rank))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("discovery")
    synthetic.write_run(str(root / "histories"), WORLD, 200, job=JOB, gpu=False)
    _write_states(root)
    procs = []
    prom = Prometheus(root / "prometheus")
    prom.workdir.mkdir()
    try:
        for node in ("a", "b"):
            procs.append(
                start_daemon(
                    "--state-dir", str(root / node), "--serve-state", "--no-gpu", "--node-local"
                )
            )
        node_a, node_b = (f"127.0.0.1:{port}" for _, port in procs)
        dead = f"127.0.0.1:{promserver.free_port()}"  # nothing listens there
        prom.write_config()
        prom.config.write_text(
            prom.config.read_text()
            + f"""
  - job_name: staging-daemons
    static_configs: [{{targets: ['{node_a}']}}]
"""
        )
        prom.write_config = lambda: None  # type: ignore[method-assign]  # (start() keeps this one)
        promserver.write_targets(prom.daemons_sd, [node_a, node_b, dead])
        promserver.write_targets(
            prom.ranks_sd, [f"127.0.0.1:{prom.port}"]
        )  # a target that is no daemon
        prom.start()

        def scraped() -> dict[str, str]:  # every target's health, once each was scraped
            targets = prom.api("targets", state="active")["data"]["activeTargets"]
            health = {
                f"{t['labels']['job']} {t['labels']['instance']}": t["health"] for t in targets
            }
            return health if len(health) == 5 and "unknown" not in health.values() else {}

        health = prom.wait_for("Prometheus to scrape every target", scraped, timeout=60)
        assert (
            health[f"ddpmon-daemons {dead}"] == "down"
            and health[f"ddpmon-daemons {node_a}"] == "up"
        )
        yield Cluster(prom, sorted([node_a, node_b, dead]), node_a, dead, root)
    finally:
        prom.stop()
        for proc, _ in procs:
            terminate(proc)


def _from(addresses: list[str]) -> list[str]:
    return [a for address in addresses for a in ("--from", address)]


def _verdict(done: subprocess.CompletedProcess[str]) -> tuple[Any, ...]:
    """What a diagnosis says, without its ages (seconds pass between two runs)."""
    report = json.loads(done.stdout)
    return (
        done.returncode,
        report["verdict"],
        report["suspect_ranks"],
        [(f["kind"], f["severity"], f["ranks"]) for f in report["findings"]],
        sorted(f["summary"] for f in report["findings"] if f["kind"] == "unreachable_daemon"),
        sorted((r["rank"], r["status"]) for r in report["ranks"]),
    )


def test_doctor_through_prometheus_says_what_every_daemon_listed_by_hand_says(
    cluster: Cluster,
) -> None:
    cluster.fresh_states()
    started = time.monotonic()
    found = run_doctor("--prometheus", cluster.prometheus.url, "--json", "--no-stacks", "-v")
    middle = time.monotonic()
    by_hand = run_doctor(*_from(cluster.daemons), "--json", "--no-stacks")
    print(
        f"doctor --prometheus: {middle - started:.2f} s; --from x3: {time.monotonic() - middle:.2f} s"
    )
    assert _verdict(found) == _verdict(by_hand), found.stderr
    assert _verdict(found)[:3] == (1, "hang", [0])
    assert f"lists 3 daemons: {', '.join(cluster.daemons)}" in found.stderr
    (dead,) = _verdict(found)[4]
    assert dead.startswith(f"http://{cluster.dead}/state") and "refused" in dead, dead


def test_prometheus_job_chooses_the_scrape_job(cluster: Cluster) -> None:
    cluster.fresh_states()
    found = run_doctor(
        "--prometheus",
        cluster.prometheus.url,
        "--prometheus-job",
        "staging-daemons",
        "--json",
        "--no-stacks",
    )
    by_hand = run_doctor("--from", cluster.node_a, "--json", "--no-stacks")
    assert _verdict(found) == _verdict(by_hand), found.stderr
    assert {rank for rank, _ in _verdict(found)[5]} == {0, 1}  # node a's ranks alone


def test_no_daemon_among_the_targets_says_which_jobs_were_looked_for(cluster: Cluster) -> None:
    done = run_doctor(
        "--prometheus", cluster.prometheus.url, "--prometheus-job", "gpu-nodes", "--json"
    )
    assert done.returncode == 2
    assert (
        f"ddpmon doctor: --prometheus {cluster.prometheus.url}: no active target of the scrape job "
        "gpu-nodes; its jobs: ddpmon-daemons, ddpmon-ranks, staging-daemons. Name the daemons' job with "
        "--prometheus-job NAME"
    ) in done.stderr
    assert (
        json.loads(done.stdout)["verdict"] == "no_data"
    )  # scripts reading --json get an answer too


@pytest.mark.parametrize(
    "url, said",
    [
        (
            "{dead}",
            "Prometheus cannot be asked for its targets at http://{dead}/api/v1/targets?state=active "
            "([Errno 111] Connection refused)",
        ),
        (
            "{node_a}",
            "http://{node_a}/api/v1/targets?state=active answered, but not as Prometheus' targets API does",
        ),
        (
            "ftp://{node_a}",
            "--prometheus 'ftp://{node_a}' is not valid: the scheme is 'ftp'; Prometheus answers "
            "http or https",
        ),
    ],
)
def test_a_prometheus_that_cannot_say_is_named(cluster: Cluster, url: str, said: str) -> None:
    where = {"dead": cluster.dead, "node_a": cluster.node_a}
    done = run_doctor("--prometheus", url.format(**where))
    assert done.returncode == 2 and said.format(**where) in done.stderr, done.stderr


def test_a_prometheus_behind_basic_auth_is_asked_with_its_http_config(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Prometheus' own --web.config.file guards its API; --prometheus-http-config (Prometheus'
    http_config format, as --http-config for the daemons) gives the doctor its credentials."""
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  doctor: {bcrypt_hash('prom-secret')}\n")
    prom = Prometheus(tmp_path / "prometheus", web_config=web, auth=("doctor", "prom-secret"))
    prom.workdir.mkdir()
    try:
        prom.write_config()
        promserver.write_targets(prom.daemons_sd, cluster.daemons)
        prom.write_config = lambda: None  # type: ignore[method-assign]
        prom.start()
        prom.wait_for(
            "the daemons among the targets",
            lambda: len(prom.api("targets", state="active")["data"]["activeTargets"]) == 3,
            timeout=30,
        )
        denied = run_doctor("--prometheus", prom.url, "--json", "--no-stacks")
        credentials = tmp_path / "http.yml"
        credentials.write_text("basic_auth: {username: doctor, password_file: password}\n")
        (tmp_path / "password").write_text("prom-secret\n")
        found = run_doctor(
            "--prometheus",
            prom.url,
            "--prometheus-http-config",
            str(credentials),
            "--json",
            "--no-stacks",
        )
    finally:
        prom.stop()
    assert (
        denied.returncode == 2
        and "(HTTP 401: Unauthorized) (give its credentials in an http_config file: "
        "--prometheus-http-config FILE)"
        in denied.stderr
    ), denied.stderr
    assert _verdict(found) == _verdict(
        run_doctor(*_from(cluster.daemons), "--json", "--no-stacks")
    ), found.stderr


def _ddpmon(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon", *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _timeless(summary: dict[str, Any]) -> dict[str, Any]:
    """A report's summary without the moment it was made (its findings' ages in seconds)."""
    summary.pop("generated_unix")
    summary["findings"] = [(f["kind"], f["ranks"]) for f in summary["findings"]]
    return summary


def test_report_and_compare_through_prometheus(cluster: Cluster) -> None:
    found = _ddpmon("report", "--prometheus", cluster.prometheus.url, "--json")
    by_hand = _ddpmon("report", *_from(cluster.daemons), "--json")
    assert found.returncode == by_hand.returncode == 0, found.stderr
    summary, summary_by_hand = (_timeless(json.loads(done.stdout)) for done in (found, by_hand))
    assert (summary["ranks"], summary["steps"]) == (WORLD, 200)
    assert summary == summary_by_hand
    assert (
        found.stderr == by_hand.stderr and cluster.dead in found.stderr
    )  # the dead node, named alike
    compared = _ddpmon(
        "compare", "--prometheus", cluster.prometheus.url, f"{JOB}@", f"{JOB}@", "--json"
    )
    assert compared.returncode == 0, compared.stderr
    step = next(r for r in json.loads(compared.stdout)["rows"] if r["name"] == "median step time")
    assert step["a"] == step["b"] == summary["median_step_seconds"]
