"""A real Prometheus server for tests: loopback, a free port, a temporary TSDB, 1 s scrapes,
the shipped rules (or a copy whose ``for:`` is shortened: ``rules_with_for``).

Targets come from file_sd files the test writes once it knows the ports (the ranks bind
ephemeral ports and publish them in their state files: ``wait_state_ports``); the node
daemon runs beside them (``start_daemon``).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from ddpmon.state import files as statefile
from tests.support import harness

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "ddpmon-rules.yml"
MISSING = (
    "the prometheus binary is not installed: the integration tests need Debian's prometheus "
    "package (`make prometheus`, or as root: apt-get install --no-install-recommends prometheus)"
)


def binary(name: str = "prometheus") -> str | None:
    return shutil.which(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_targets(path: Path, targets: list[str], labels: dict[str, str] | None = None) -> None:
    """Write a file_sd file atomically (Prometheus watches the directory)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"targets": targets, "labels": labels or {}}]))
    os.replace(tmp, path)


def rules_with_for(path: Path, for_: dict[str, str]) -> Path:
    """Write the shipped rules to ``path`` with the ``for:`` of the named alerts replaced
    (a test cannot wait minutes); every expression, label and annotation as shipped."""
    rules = yaml.safe_load(RULES.read_text())
    found = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") in for_:
                rule["for"] = for_[rule["alert"]]
                found.add(rule["alert"])
    assert found == set(for_), f"no such alert: {sorted(set(for_) - found)}"
    path.write_text(yaml.safe_dump(rules, sort_keys=False, width=1000))
    return path


def wait_state_ports(
    state_dir: Path, world: int, procs: list[subprocess.Popen], workdir: Path, timeout: float = 90.0
) -> dict[int, int]:
    """Each rank's metrics port, from its state file, once every rank has written one."""
    deadline = time.monotonic() + timeout
    ports: dict[int, int] = {}
    while time.monotonic() < deadline and len(ports) < world:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(
                    "a rank exited early:\n" + harness.describe(harness.collect(procs, workdir))
                )
        for rank in range(world):
            path = statefile.path_for(str(state_dir), rank)
            try:
                port = statefile.read(path).port
            except Exception:
                continue
            if port:
                ports[rank] = int(port)
        time.sleep(0.2)
    if len(ports) < world:
        raise AssertionError(
            f"state files with ports did not appear in {timeout} s:\n"
            + harness.describe(harness.collect(procs, workdir))
        )
    return ports


def start_daemon(state_dir: Path, log: Path) -> tuple[subprocess.Popen, int]:
    """``ddpmon daemon`` on a free loopback port reading ``state_dir``: (process, port)."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddpmon",
                "daemon",
                "--state-dir",
                str(state_dir),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, port


def stop_daemon(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


FETCH = """
import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=10) as r:
        status, body = r.status, r.read()
except urllib.error.HTTPError as exc:
    status, body = exc.code, exc.read()
sys.stdout.buffer.write(b"%d\\n" % status + body)
"""
"""``python -c FETCH URL``: the status line, then the body (how a Prometheus in another
network namespace is asked)."""


class Prometheus:
    """``enter``: a command prefix that runs it, and every request to it, elsewhere (``nsenter``
    into a host of tests/support/hosts.py), its address being that host's loopback."""

    def __init__(
        self,
        workdir: Path,
        rules: Path = RULES,
        enter: list[str] | None = None,
        daemon_auth: tuple[str, str] | None = None,
        web_config: Path | None = None,
        auth: tuple[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        self.daemon_auth = daemon_auth
        """(user, password) of the daemons' basic auth (their --web-config-file), when they ask."""
        self.web_config = web_config
        """Prometheus' own --web.config.file (TLS, basic auth of its API), and the credentials
        the helper then asks with."""
        self.auth = auth
        self.rules = rules
        self.enter = enter or []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "prometheus.yml"
        self.ranks_sd = workdir / "targets" / "ranks.json"
        self.daemons_sd = workdir / "targets" / "daemons.json"
        self.log = workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def write_config(self) -> None:
        (self.workdir / "targets").mkdir(parents=True, exist_ok=True)
        for sd in (self.ranks_sd, self.daemons_sd):
            sd.write_text("[]")
        # The same shape as deploy/prometheus/prometheus.yml, with test timings.
        auth = (
            ("\n    basic_auth: {{username: {}, password: {}}}".format(*self.daemon_auth))
            if self.daemon_auth
            else ""
        )
        self.config.write_text(f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - {self.rules}
scrape_configs:
  - job_name: ddpmon-ranks
    honor_labels: true
    file_sd_configs:
      - files: [{self.ranks_sd}]
        refresh_interval: 1s
  - job_name: ddpmon-daemons
    honor_labels: true{auth}
    file_sd_configs:
      - files: [{self.daemons_sd}]
        refresh_interval: 1s
""")

    def start(self, timeout: float = 30.0) -> None:
        self.write_config()
        log = open(self.log, "w")
        self.proc = subprocess.Popen(
            [
                *self.enter,
                binary() or "prometheus",
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
                *([f"--web.config.file={self.web_config}"] if self.web_config else []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()}"
                )
            try:
                if self.get(self.url + "/-/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def get(self, url: str) -> tuple[int, bytes]:
        """GET ``url``: (HTTP status, body); an OSError when there is no answer."""
        if self.enter:
            done = subprocess.run(
                [*self.enter, sys.executable, "-c", FETCH, url],
                capture_output=True,
                timeout=30,
                check=False,
            )
            if done.returncode != 0:
                raise OSError(
                    f"no answer from {url}: {done.stderr.decode(errors='replace')[-500:]}"
                )
            status, _, body = done.stdout.partition(b"\n")
            return int(status), body
        headers = (
            {"Authorization": "Basic " + base64.b64encode(":".join(self.auth).encode()).decode()}
            if self.auth
            else {}
        )
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, headers=headers), timeout=10
            ) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def api(self, path: str, **params: Any) -> dict[str, Any]:
        """GET /api/v1/<path>; returns the JSON body, also for 4xx answers (status "error")."""
        query = urllib.parse.urlencode(params, doseq=True)
        status, body = self.get(f"{self.url}/api/v1/{path}?{query}")
        try:
            return json.loads(body)
        except ValueError:
            return {"status": "error", "error": f"HTTP {status}: {body.decode(errors='replace')}"}

    def query(self, expr: str) -> dict[str, Any]:
        return self.api("query", query=expr)

    def vector(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """An instant query's result as {sorted label pairs: value}; raises on errors."""
        body = self.query(expr)
        if body.get("status") != "success":
            raise AssertionError(f"{expr!r}: {body.get('errorType')}: {body.get('error')}")
        data = body["data"]
        if data["resultType"] == "scalar":
            return {(): float(data["result"][1])}
        return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in data["result"]}

    def alerts(self) -> list[dict[str, Any]]:
        """Every pending and firing alert (``labels``, ``state``, ``value``, ``activeAt``)."""
        return self.api("alerts")["data"]["alerts"]

    def by(self, expr: str, label: str) -> dict[str, float]:
        return {dict(k).get(label, ""): v for k, v in self.vector(expr).items()}

    def wait_for(self, what: str, check: Any, timeout: float, interval: float = 0.5) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = check()
                if last:
                    return last
            except AssertionError as exc:
                last = exc
            time.sleep(interval)
        raise AssertionError(
            f"timed out after {timeout} s waiting for {what} (last: {last!r})\n"
            f"prometheus log:\n{self.log.read_text()[-3000:]}"
        )
