"""The HTTP endpoints (a rank's /metrics, the daemon's): a bounded number of threads,
timeouts on idle connections, and the daemon's /healthz failing when sampling is stuck."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from ddpmon.daemon import Daemon
from ddpmon.metrics import exposition as exporter


class Empty:
    def collect(self):
        return iter(())


def get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_half_open_connections_hold_a_bounded_number_of_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exporter._QuietHandler, "timeout", 1.0)
    endpoint = exporter.serve(Empty(), 0, "127.0.0.1")
    before = threading.active_count()
    idle = []
    try:
        for _ in range(250):  # connect and send nothing: a slowloris (never waiting on a full queue)
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", endpoint.port))
            idle.append(s)
        time.sleep(0.5)
        peak = threading.active_count() - before
        assert peak <= exporter.MAX_CONNECTION_THREADS, f"{peak} threads for 250 idle connections"
    finally:
        for s in idle:
            s.close()
    try:  # once they are gone, the endpoint serves at once
        assert get(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=10)[0] == 200
    finally:
        endpoint.close()


def test_an_idle_connection_is_closed_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exporter._QuietHandler, "timeout", 0.5)
    endpoint = exporter.serve(Empty(), 0, "127.0.0.1")
    try:
        s = socket.create_connection(("127.0.0.1", endpoint.port), timeout=10)
        started = time.monotonic()
        assert s.recv(1) == b"", "the server closes a connection that sends nothing"
        assert time.monotonic() - started < 8
    finally:
        endpoint.close()


def test_daemon_healthz_fails_when_the_sampling_pass_is_stale(tmp_path) -> None:
    daemon = Daemon(str(tmp_path), interval=0.1, gpus=False)
    daemon.start()
    endpoint = exporter.serve(daemon, 0, "127.0.0.1", {"/healthz": daemon.health_route})
    try:
        status, body = get(f"http://127.0.0.1:{endpoint.port}/healthz")
        assert status == 200 and body.startswith(b"ok")
        stuck = threading.Event()
        daemon.refresh = lambda: stuck.wait(30)  # a pass that hangs (a hung mount, NVML)
        daemon._last_pass -= daemon.stale_after_seconds + 1  # ... for longer than allowed
        status, body = get(f"http://127.0.0.1:{endpoint.port}/healthz")
        assert status == 503 and b"sampling is stuck" in body
        assert get(f"http://127.0.0.1:{endpoint.port}/metrics")[0] == 200  # old samples still served
        stuck.set()
    finally:
        endpoint.close()
        daemon.stop()
