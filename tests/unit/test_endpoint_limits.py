"""The HTTP endpoints (a rank's /metrics, the daemon's) against slow and hostile clients:
an idle connection costs a socket and no thread, a request head has a deadline however it
trickles in, the oldest waiting connection makes room at the cap, a slow reader or a slow
collector stalls no one, and running out of file descriptors does not spin the loop. Also
what Prometheus relies on: keep-alive, gzip, HEAD; and the daemon's /healthz failing when
sampling is stuck."""

from __future__ import annotations

import gzip
import http.client
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest
from prometheus_client.core import GaugeMetricFamily

from ddpmon.daemon import Daemon
from ddpmon.metrics import exposition
from tests.support.commands import get

ROOT = Path(__file__).resolve().parents[2]


class One:
    """A collector with one gauge (ddpmon_rank_info's name: the catalog knows it)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds

    def collect(self):
        time.sleep(self.seconds)
        g = GaugeMetricFamily("ddpmon_rank_info", "help")
        g.add_metric([], 1.0)
        yield g


def timed_get(port: int, path: str = "/metrics") -> tuple[int, float]:
    started = time.monotonic()
    status, _ = get(f"http://127.0.0.1:{port}{path}", timeout=10)
    return status, time.monotonic() - started


def silent(port: int, head: bytes = b"") -> socket.socket:
    """A connection that sends ``head`` (nothing, or a request that never ends) and waits."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if head:
        s.sendall(head)
    return s


def closed_by_server(s: socket.socket, within: float) -> float | None:
    """Seconds until the server closed ``s`` (EOF or reset), or None if it did not in time."""
    started = time.monotonic()
    s.settimeout(within)
    try:
        while s.recv(4096):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return None
    return time.monotonic() - started


def test_half_open_connections_cost_no_thread_and_a_scrape_still_gets_in() -> None:
    endpoint = exposition.serve(One(), 0, "127.0.0.1")
    before = threading.active_count()
    idle = []
    try:
        for i in range(500):  # a slowloris: a request that never ends, or nothing at all
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", endpoint.port))
            idle.append(s)
            if i % 2:
                time.sleep(0.001)
                try:
                    s.send(b"GET /metr")
                except OSError:
                    pass
        time.sleep(0.3)
        status, seconds = timed_get(endpoint.port)
        assert status == 200 and seconds < 1.0, f"a scrape under 500 idle connections took {seconds:.2f} s"
        assert threading.active_count() == before, "an idle connection costs no thread"
        assert len(psutil.Process().net_connections("tcp")) > 500  # (they were held meanwhile)
    finally:
        for s in idle:
            s.close()
        endpoint.close()


def test_a_request_head_must_arrive_within_the_deadline_however_it_trickles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exposition, "HEADER_SECONDS", 0.5)
    endpoint = exposition.serve(One(), 0, "127.0.0.1")
    stop = threading.Event()
    try:
        quiet = silent(endpoint.port)
        trickling = silent(endpoint.port, b"G")

        def trickle() -> None:  # one byte every 0.1 s, never the end of the head
            for byte in b"ET /metrics HTTP/1.1\r\nX: " + b"y" * 100:
                if stop.wait(0.1):
                    return
                try:
                    trickling.send(bytes([byte]))
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        assert (closed_by_server(quiet, 5.0) or 99) < 1.0, "a silent connection outlives the deadline"
        assert (closed_by_server(trickling, 5.0) or 99) < 1.0, "a trickled head outlives the deadline"
        assert get(f"http://127.0.0.1:{endpoint.port}/metrics")[0] == 200  # a prompt client is served
    finally:
        stop.set()
        endpoint.close()


def test_at_the_cap_the_connection_that_waited_longest_makes_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exposition, "HEADER_SECONDS", 30.0)
    monkeypatch.setattr(exposition, "connection_cap", lambda: 8)
    endpoint = exposition.serve(One(), 0, "127.0.0.1")
    try:
        scraper = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=10)
        scraper.request("GET", "/metrics")  # served, then idle: the oldest connection
        assert scraper.getresponse().read()
        held = []
        for _ in range(7):
            held.append(silent(endpoint.port, b"GET /metr"))
            time.sleep(0.02)  # accepted in this order
        status, seconds = timed_get(endpoint.port)
        assert status == 200 and seconds < 1.0
        assert closed_by_server(held[0], 2.0) is not None, "the oldest never-served connection is closed first"
        for s in held[1:]:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):  # still open: nothing to read, no EOF
                s.recv(1)
        sock = scraper.sock
        scraper.request("GET", "/metrics")  # the kept-alive scraper outlived them
        assert scraper.getresponse().status == 200 and scraper.sock is sock
        for s in held:
            s.close()
        scraper.close()
    finally:
        endpoint.close()


def test_prometheus_keeps_its_connection_and_gets_gzip_and_head() -> None:
    endpoint = exposition.serve(One(), 0, "127.0.0.1", {"/state": lambda query: ("application/json", b"[]" * 5000)})
    try:
        conn = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=10)
        conn.request("GET", "/metrics")
        plain = conn.getresponse().read()
        sock = conn.sock
        conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
        r = conn.getresponse()
        assert r.getheader("Content-Encoding") == "gzip" and gzip.decompress(r.read()) == plain
        conn.request("GET", "/state", headers={"Accept-Encoding": "gzip"})
        r = conn.getresponse()
        assert r.getheader("Content-Encoding") == "gzip" and gzip.decompress(r.read()) == b"[]" * 5000
        conn.request("HEAD", "/metrics")
        r = conn.getresponse()
        assert r.status == 200 and int(r.getheader("Content-Length")) == len(plain) and r.read() == b""
        conn.request("GET", "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        r = conn.getresponse()
        assert r.getheader("Content-Type").startswith("application/openmetrics-text") and r.read().endswith(b"# EOF\n")
        assert conn.sock is sock, "five requests on one kept-alive connection"
        conn.close()
        for head in (b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n", b"GET /metrics HTTP/1.0\r\n\r\n"):
            s = silent(endpoint.port, head)  # closed after its response, as asked
            assert closed_by_server(s, 2.0) is not None, head
            s.close()
    finally:
        endpoint.close()


def test_bad_requests_are_answered_and_closed() -> None:
    endpoint = exposition.serve(One(), 0, "127.0.0.1")
    try:
        for head, status in [(b"POST /metrics HTTP/1.1\r\nContent-Length: 2\r\n\r\nab", b"405"),
                             (b"hello\r\n\r\n", b"400"),
                             (b"GET /metrics HTTP/1.1\r\nX: " + b"y" * 20000, b"431"),
                             (b"GET /metrics HTTP/1.1\r\nContent-Length: 999999\r\n\r\n", b"413")]:
            s = silent(endpoint.port, head)
            s.settimeout(5)
            assert s.recv(4096).split(b" ")[1] == status, head[:30]
            s.close()
    finally:
        endpoint.close()


def test_a_slow_reader_of_a_large_response_stalls_no_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exposition, "MAX_UNSENT_BYTES", 30 * 2**20)
    big = b"x" * 20 * 2**20
    endpoint = exposition.serve(One(), 0, "127.0.0.1", {"/state": lambda query: ("application/json", big)})
    try:
        readers = []
        for _ in range(2):  # ask for 20 MiB and read none of it
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", endpoint.port))
            s.sendall(b"GET /state HTTP/1.1\r\n\r\n")
            readers.append(s)
            time.sleep(0.5)
        status, seconds = timed_get(endpoint.port)
        assert status == 200 and seconds < 1.0, f"a scrape behind a slow reader took {seconds:.2f} s"
        # 40 MiB waiting for readers is over the 30 MiB allowed: the older reader is dropped
        assert closed_by_server(readers[0], 5.0) is not None
        readers[1].settimeout(0.5)
        assert readers[1].recv(4096).startswith(b"HTTP/1.1 200")
        for s in readers:
            s.close()
    finally:
        endpoint.close()


def test_a_slow_collector_holds_the_worker_not_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exposition, "HEADER_SECONDS", 0.5)
    endpoint = exposition.serve(One(seconds=3.0), 0, "127.0.0.1",
                                quick_routes={"/healthz": lambda query: ("text/plain", b"ok\n")})
    try:
        slow = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=10)
        slow.request("GET", "/metrics")  # the worker is busy for 3 s
        time.sleep(0.2)
        status, seconds = timed_get(endpoint.port, "/healthz")
        assert status == 200 and seconds < 0.5, "a quick route is answered on the loop"
        assert (closed_by_server(silent(endpoint.port), 2.0) or 99) < 1.0, "deadlines hold meanwhile"
        assert slow.getresponse().status == 200
    finally:
        endpoint.close()


def test_a_route_reads_the_query_and_answers_400_to_a_bad_one() -> None:
    def echo(query: exposition.Query) -> tuple[str, bytes]:
        if "bad" in query:
            raise exposition.BadRequest("bad is not taken here: give good=N")
        return "text/plain", repr(sorted(query.items())).encode()

    endpoint = exposition.serve(One(), 0, "127.0.0.1", {"/echo": echo})
    try:
        assert get(f"http://127.0.0.1:{endpoint.port}/echo?a=1&a=2&b=") == (200, b"[('a', ['1', '2']), ('b', [''])]")
        assert get(f"http://127.0.0.1:{endpoint.port}/echo?bad=1") == (400, b"bad is not taken here: give good=N\n")
        assert get(f"http://127.0.0.1:{endpoint.port}/metrics")[0] == 200
    finally:
        endpoint.close()


def test_a_failing_collector_or_route_answers_500_and_the_endpoint_goes_on() -> None:
    class Flaky(One):
        calls = 0

        def collect(self):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("the GPU went away")
            yield from super().collect()

    def broken(query: exposition.Query) -> tuple[str, bytes]:
        raise ValueError("a bug")

    endpoint = exposition.serve(Flaky(), 0, "127.0.0.1", {"/state": broken})
    try:
        status, body = get(f"http://127.0.0.1:{endpoint.port}/metrics")
        assert status == 500 and b"the GPU went away" in body
        assert get(f"http://127.0.0.1:{endpoint.port}/state")[0] == 500
        assert get(f"http://127.0.0.1:{endpoint.port}/metrics")[0] == 200
    finally:
        endpoint.close()


def test_daemon_healthz_fails_when_the_sampling_pass_is_stale(tmp_path) -> None:
    daemon = Daemon(str(tmp_path), interval=0.1, gpus=False)
    daemon.start()
    endpoint = exposition.serve(daemon, 0, "127.0.0.1", quick_routes={"/healthz": daemon.health_route})
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
