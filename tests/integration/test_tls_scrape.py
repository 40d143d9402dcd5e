"""A real Prometheus (Debian's) scrapes a real 2-rank gloo DDP job and the node daemon over
https with basic auth, both configured by one exporter-toolkit web config file
(``DDPMON_WEB_CONFIG_FILE`` for the ranks, ``--web-config-file`` for the daemon), as it
scrapes node_exporter; a scrape with a wrong password or without TLS fails; and
``doctor --from https://...`` reads the daemon's ``/state`` with Prometheus' own
http_config file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration import promserver
from tests.integration.promserver import Prometheus
from tests.support import harness
from tests.support.tls import bcrypt_hash, make_pki

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(promserver.binary() is None, reason=promserver.MISSING),
]

JOB = "itest-tls"


def scrape_job(
    name: str, targets: list[str], ca: Path, password: str, scheme: str = "https"
) -> str:
    return f"""
  - job_name: {name}
    honor_labels: true
    scheme: {scheme}
    basic_auth: {{username: prometheus, password: {password}}}
    tls_config: {{ca_file: {ca}}}
    static_configs: [{{targets: [{", ".join(repr(t) for t in targets)}]}}]
"""


def test_prometheus_scrapes_ranks_and_daemon_over_tls_with_basic_auth(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    web = tmp_path / "web.yml"
    web.write_text(f"""
tls_server_config:
  cert_file: {pki.server_cert.name}
  key_file: {pki.server_key.name}
basic_auth_users:
  prometheus: {bcrypt_hash("scrape-secret")}
""")
    ranks = tmp_path / "ranks"
    prom = Prometheus(tmp_path / "prometheus")
    prom.workdir.mkdir()
    procs: list[subprocess.Popen] = []
    daemon = None
    try:
        procs = harness.start_ranks(
            "train_until",
            2,
            ranks,
            args=(JOB, "120"),
            module="tests.integration.job_worker",
            env={"DDPMON_WEB_CONFIG_FILE": str(web)},
        )
        ports = promserver.wait_state_ports(ranks / "state", 2, procs, ranks)
        daemon_port = promserver.free_port()
        daemon = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddpmon",
                "daemon",
                "--state-dir",
                str(ranks / "state"),
                "--port",
                str(daemon_port),
                "--bind",
                "0.0.0.0",
                "--serve-state",
                "--no-gpu",
                "--web-config-file",
                str(web),
            ],
            cwd=promserver.ROOT,
            env={**os.environ, "PYTHONPATH": str(promserver.ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        first = daemon.stdout.readline() if daemon.stdout else ""
        assert f"serving https://0.0.0.0:{daemon_port}/metrics" in first, (
            first + daemon.stdout.read()
        )
        assert (
            "every state file of this node, to a client with credentials"
            in daemon.stdout.readline()
        )

        rank_targets = [f"localhost:{ports[r]}" for r in sorted(ports)]
        prom.write_config()
        prom.config.write_text(
            prom.config.read_text().split("scrape_configs:")[0]
            + "scrape_configs:"
            + scrape_job("ranks", rank_targets, pki.ca, "scrape-secret")
            + scrape_job("daemon", [f"localhost:{daemon_port}"], pki.ca, "scrape-secret")
            + scrape_job("wrong-password", [f"localhost:{daemon_port}"], pki.ca, "guess")
            + scrape_job("no-tls", [f"localhost:{daemon_port}"], pki.ca, "scrape-secret", "http")
        )
        prom.write_config = lambda: None  # type: ignore[method-assign]  # (start() keeps this one)
        prom.start()

        def up() -> dict[str, float]:
            return {
                f"{dict(k)['job']}/{dict(k)['instance']}": v for k, v in prom.vector("up").items()
            }

        prom.wait_for("every target scraped", lambda: len(up()) == 5, timeout=30)
        prom.wait_for(
            "the ranks and the daemon up over https",
            lambda: sum(v for k, v in up().items() if k.startswith(("ranks/", "daemon/"))) == 3,
            timeout=30,
        )
        assert up()[f"wrong-password/localhost:{daemon_port}"] == 0.0
        assert up()[f"no-tls/localhost:{daemon_port}"] == 0.0
        prom.wait_for(
            "the ranks' own series",
            lambda: len(prom.vector(f'ddpmon_steps_total{{job="{JOB}"}}')) == 2,
            timeout=30,
        )
        prom.wait_for(
            "the daemon's liveness series",
            lambda: len(prom.vector(f'ddpmon_rank_up{{job="{JOB}"}} == 1')) == 2,
            timeout=30,
        )
        errors = {
            t["labels"]["job"]: t["lastError"] for t in prom.api("targets")["data"]["activeTargets"]
        }
        assert "401" in errors["wrong-password"], errors

        # the doctor reads /state through the same TLS, with Prometheus' http_config
        (tmp_path / "password").write_text("scrape-secret\n")
        http_config = tmp_path / "http.yml"
        http_config.write_text(
            f"basic_auth:\n  username: prometheus\n  password_file: password\n"
            f"tls_config:\n  ca_file: {pki.ca}\n"
        )
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddpmon",
                "doctor",
                "--from",
                f"https://localhost:{daemon_port}",
                "--http-config",
                str(http_config),
                "--json",
                "--no-stacks",
            ],
            cwd=promserver.ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        report = json.loads(done.stdout)
        assert report["job"] == JOB and sorted(r["rank"] for r in report["ranks"]) == [0, 1], (
            done.stderr
        )
        # by an address the certificate does not hold, checked against a name it does (server_name)
        named = tmp_path / "named.yml"
        named.write_text(
            http_config.read_text().replace(
                "tls_config:\n", "tls_config:\n  server_name: ddpmon-node\n"
            )
        )
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddpmon",
                "doctor",
                "--from",
                f"https://127.0.0.2:{daemon_port}",
                "--http-config",
                str(named),
                "--json",
                "--no-stacks",
            ],
            cwd=promserver.ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert json.loads(done.stdout)["job"] == JOB, done.stderr
        refused = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddpmon",
                "doctor",
                "--from",
                f"https://localhost:{daemon_port}",
                "--json",
                "--no-stacks",
            ],
            cwd=promserver.ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (
            "CERTIFICATE_VERIFY_FAILED" in refused.stdout + refused.stderr
        )  # the system's CAs do not know it
    finally:
        harness.finish(procs, ranks)
        if daemon is not None:
            promserver.stop_daemon(daemon)
        prom.stop()
