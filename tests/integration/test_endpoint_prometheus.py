"""A real Prometheus against ddpmon's endpoint (the rank's and the daemon's server): it keeps
one connection across its scrapes, and keeps scraping within its 1 s timeout while a
slowloris holds the endpoint."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from prometheus_client.core import GaugeMetricFamily

from ddpmon import httpd
from tests.integration import promserver
from tests.integration.promserver import Prometheus

pytestmark = [
    pytest.mark.skipif(promserver.binary() is None, reason=promserver.MISSING),
    pytest.mark.timeout(120),
]

ROOT = Path(__file__).resolve().parents[2]


class One:
    def collect(self):
        g = GaugeMetricFamily("ddpmon_rank_info", "help")
        g.add_metric([], 1.0)
        yield g


def scraper_ports(port: int) -> set[int]:
    """The client ports of the connections this process (the server) holds on ``port``."""
    return {
        c.raddr.port
        for c in psutil.Process().net_connections("tcp")
        if c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED and c.raddr
    }


def test_prometheus_keeps_its_connection_and_its_scrapes_through_a_slowloris(
    tmp_path: Path,
) -> None:
    endpoint = httpd.serve(One(), 0, "127.0.0.1")
    prom = Prometheus(tmp_path)
    attacker = None
    try:
        prom.start()
        promserver.write_targets(prom.ranks_sd, [f"127.0.0.1:{endpoint.port}"])
        prom.wait_for(
            "three scrapes",
            lambda: max(prom.vector("count_over_time(up[1m])").values(), default=0) >= 3,
            30,
        )
        seen = set()
        for _ in range(8):  # 4 s: about four scrapes
            seen |= scraper_ports(endpoint.port)
            time.sleep(0.5)
        assert len(seen) == 1, f"Prometheus used {len(seen)} connections for its scrapes: {seen}"

        attacker = subprocess.Popen(
            [
                "nice",
                "-n",
                "19",
                sys.executable,
                "-m",
                "tests.distributed.attacker",
                str(endpoint.port),
                "--seconds",
                "10",
                "--grace",
                "0",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        attacker.stdout.readline()
        started = time.time()
        attacker.wait(30)
        time.sleep(1.5)  # the last scrape of the attack is in
        window = f"{int(time.time() - started)}s"
        (up,) = prom.vector(f"min_over_time(up[{window}])").values()
        (slowest,) = prom.vector(f"max_over_time(scrape_duration_seconds[{window}])").values()
        (scrapes,) = prom.vector(f"count_over_time(up[{window}])").values()
        assert up == 1.0, "a scrape failed under the attack"
        assert scrapes >= 9 and slowest < 1.0, (scrapes, slowest)
        assert scraper_ports(endpoint.port) == seen, "the same connection, through the attack"
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
            attacker.wait()
        prom.stop()
        endpoint.close()
