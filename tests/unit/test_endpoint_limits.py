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

from ddpmon import httpd
from ddpmon.daemon import Daemon
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
    endpoint = httpd.serve(One(), 0, "127.0.0.1")
    before = set(threading.enumerate())  # (a thread of an earlier test may end meanwhile)
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
        assert status == 200 and seconds < 1.0, (
            f"a scrape under 500 idle connections took {seconds:.2f} s"
        )
        started = [t.name for t in threading.enumerate() if t not in before]
        assert started == [], f"an idle connection costs no thread: {started}"
        assert len(psutil.Process().net_connections("tcp")) > 500  # (they were held meanwhile)
    finally:
        for s in idle:
            s.close()
        endpoint.close()


def test_a_request_head_must_arrive_within_the_deadline_however_it_trickles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(httpd, "HEADER_SECONDS", 0.5)
    endpoint = httpd.serve(One(), 0, "127.0.0.1")
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
        assert (closed_by_server(quiet, 5.0) or 99) < 1.0, (
            "a silent connection outlives the deadline"
        )
        assert (closed_by_server(trickling, 5.0) or 99) < 1.0, (
            "a trickled head outlives the deadline"
        )
        assert (
            get(f"http://127.0.0.1:{endpoint.port}/metrics")[0] == 200
        )  # a prompt client is served
    finally:
        stop.set()
        endpoint.close()


def test_at_the_cap_the_connection_that_waited_longest_makes_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(httpd, "HEADER_SECONDS", 30.0)
    monkeypatch.setattr(httpd, "connection_cap", lambda: 8)
    endpoint = httpd.serve(One(), 0, "127.0.0.1")
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
        assert closed_by_server(held[0], 2.0) is not None, (
            "the oldest never-served connection is closed first"
        )
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
    endpoint = httpd.serve(
        One(), 0, "127.0.0.1", {"/state": lambda query, reader: ("application/json", b"[]" * 5000)}
    )
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
        assert (
            r.getheader("Content-Encoding") == "gzip" and gzip.decompress(r.read()) == b"[]" * 5000
        )
        conn.request("HEAD", "/metrics")
        r = conn.getresponse()
        assert (
            r.status == 200 and int(r.getheader("Content-Length")) == len(plain) and r.read() == b""
        )
        conn.request(
            "GET", "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        r = conn.getresponse()
        assert r.getheader("Content-Type").startswith(
            "application/openmetrics-text"
        ) and r.read().endswith(b"# EOF\n")
        assert conn.sock is sock, "five requests on one kept-alive connection"
        conn.close()
        for head in (
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            b"GET /metrics HTTP/1.0\r\n\r\n",
        ):
            s = silent(endpoint.port, head)  # closed after its response, as asked
            assert closed_by_server(s, 2.0) is not None, head
            s.close()
    finally:
        endpoint.close()


def test_bad_requests_are_answered_and_closed() -> None:
    endpoint = httpd.serve(One(), 0, "127.0.0.1")
    try:
        for head, status in [
            (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab", b"405"),
            (b"hello\r\n\r\n", b"400"),
            (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 20000, b"431"),
            (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 999999\r\n\r\n", b"413"),
        ]:
            s = silent(endpoint.port, head)
            s.settimeout(5)
            assert s.recv(4096).split(b" ")[1] == status, head[:30]
            s.close()
    finally:
        endpoint.close()


def test_a_slow_reader_of_a_large_response_stalls_no_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httpd, "MAX_UNSENT_BYTES", 30 * 2**20)
    big = b"x" * 20 * 2**20
    endpoint = httpd.serve(
        One(), 0, "127.0.0.1", {"/state": lambda query, reader: ("application/json", big)}
    )
    try:
        readers = []
        for _ in range(2):  # ask for 20 MiB and read none of it
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", endpoint.port))
            s.sendall(b"GET /state HTTP/1.1\r\nHost: x\r\n\r\n")
            readers.append(s)
            time.sleep(0.5)
        status, seconds = timed_get(endpoint.port)
        assert status == 200 and seconds < 1.0, (
            f"a scrape behind a slow reader took {seconds:.2f} s"
        )
        # 40 MiB waiting for readers is over the 30 MiB allowed: the older reader is dropped
        assert closed_by_server(readers[0], 5.0) is not None
        readers[1].settimeout(0.5)
        assert readers[1].recv(4096).startswith(b"HTTP/1.1 200")
        for s in readers:
            s.close()
    finally:
        endpoint.close()


def test_a_slow_collector_holds_the_worker_not_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httpd, "HEADER_SECONDS", 0.5)
    endpoint = httpd.serve(
        One(seconds=3.0),
        0,
        "127.0.0.1",
        quick_routes={"/healthz": lambda query, reader: ("text/plain", b"ok\n")},
    )
    try:
        slow = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=10)
        slow.request("GET", "/metrics")  # the worker is busy for 3 s
        time.sleep(0.2)
        status, seconds = timed_get(endpoint.port, "/healthz")
        assert status == 200 and seconds < 0.5, "a quick route is answered on the loop"
        assert (closed_by_server(silent(endpoint.port), 2.0) or 99) < 1.0, (
            "deadlines hold meanwhile"
        )
        assert slow.getresponse().status == 200
    finally:
        endpoint.close()


def test_a_route_reads_the_query_and_answers_400_to_a_bad_one() -> None:
    def echo(query: httpd.Query, reader: httpd.Reader) -> tuple[str, bytes]:
        if "bad" in query:
            raise httpd.BadRequest("bad is not taken here: give good=N")
        return "text/plain", repr(sorted(query.items())).encode()

    endpoint = httpd.serve(One(), 0, "127.0.0.1", {"/echo": echo})
    try:
        assert get(f"http://127.0.0.1:{endpoint.port}/echo?a=1&a=2&b=") == (
            200,
            b"[('a', ['1', '2']), ('b', [''])]",
        )
        assert get(f"http://127.0.0.1:{endpoint.port}/echo?bad=1") == (
            400,
            b"bad is not taken here: give good=N\n",
        )
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

    def broken(query: httpd.Query) -> tuple[str, bytes]:
        raise ValueError("a bug")

    endpoint = httpd.serve(Flaky(), 0, "127.0.0.1", {"/state": broken})
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
    endpoint = httpd.serve(daemon, 0, "127.0.0.1", quick_routes={"/healthz": daemon.health_route})
    try:
        status, body = get(f"http://127.0.0.1:{endpoint.port}/healthz")
        assert status == 200 and body.startswith(b"ok")
        stuck = threading.Event()
        daemon.refresh = lambda: stuck.wait(30)  # a pass that hangs (a hung mount, NVML)
        daemon._last_pass -= daemon.stale_after_seconds + 1  # ... for longer than allowed
        status, body = get(f"http://127.0.0.1:{endpoint.port}/healthz")
        assert status == 503 and b"sampling is stuck" in body
        assert (
            get(f"http://127.0.0.1:{endpoint.port}/metrics")[0] == 200
        )  # old samples still served
        stuck.set()
    finally:
        endpoint.close()
        daemon.stop()


# -- framing: what a hostile or odd client sends (h11 reads it; see docs/security.md) ----------


def exchange(port: int, data: bytes, within: float = 5.0) -> tuple[bytes, bool]:
    """Send ``data`` on a new connection; (everything answered, whether the server closed the
    connection within ``within`` seconds)."""
    s = silent(port, data)
    s.settimeout(within)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
        return out, True
    except TimeoutError:
        return out, False
    except ConnectionResetError:
        return out, True
    finally:
        s.close()


def responses(data: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each response in ``data`` (Content-Length framed, as the endpoint's)."""
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(
            (
                int(line.split(b":")[1])
                for line in lines
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        out.append((int(lines[0].split(b" ")[1]), data[:length]))
        data = data[length:]
    return out


def test_a_thousand_pipelined_requests_are_all_answered_in_order() -> None:
    endpoint = httpd.serve(
        One(),
        0,
        "127.0.0.1",
        {"/echo": lambda query, reader: ("text/plain", query["i"][0].encode())},
        quick_routes={"/quick": lambda query, reader: ("text/plain", query["i"][0].encode())},
    )
    try:
        # 600 on the loop in a row (each answered before the next is read), then the worker's in between
        paths = ["/quick" if i < 600 or i % 2 else "/echo" for i in range(1000)]
        data = b"".join(
            f"GET {p}?i={i} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for i, p in enumerate(paths)
        )
        last = b"GET /quick?i=last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        got, closed = exchange(endpoint.port, data + last)
        assert closed and responses(got) == [(200, str(i).encode()) for i in range(1000)] + [
            (200, b"last")
        ]
    finally:
        endpoint.close()


@pytest.mark.parametrize(
    "lengths",
    [
        b"Content-Length: 5\r\nContent-Length: 0\r\n",  # two that differ: which one frames the body?
        b"Content-Length: 5, 0\r\n",
        b"Content-Length: +5\r\n",  # int() reads these two, a proxy in front may not
        b"Content-Length: 1_0\r\n",
        b"Content-Length: 0x5\r\n",
    ],
)
def test_a_content_length_that_could_be_read_two_ways_is_refused_and_closed(lengths: bytes) -> None:
    endpoint = httpd.serve(One(), 0, "127.0.0.1")
    try:
        smuggled = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
        got, closed = exchange(
            endpoint.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + lengths + b"\r\n" + smuggled
        )
        [(status, body)] = responses(got)  # one answer: the rest is never read as a request
        assert (status, closed) == (400, True) and b"Content-Length" in body, body
    finally:
        endpoint.close()


def test_a_request_head_over_16_kib_is_refused_however_it_arrives() -> None:
    endpoint = httpd.serve(One(), 0, "127.0.0.1")

    def head(size: int) -> bytes:  # a whole request head of exactly ``size`` bytes
        start, end = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX: ", b"\r\n\r\n"
        return start + b"y" * (size - len(start) - len(end)) + end

    try:
        assert len(head(httpd.MAX_HEAD_BYTES)) == 16 * 1024
        assert (
            responses(exchange(endpoint.port, head(16 * 1024) + b"GET / HTTP/1.0\r\n\r\n")[0])[0][0]
            == 200
        )
        for size in (
            16 * 1024 + 1,
            65_000,
        ):  # whole, in one read: h11 bounds only an incomplete head
            got, closed = exchange(endpoint.port, head(size))
            assert responses(got) == [(431, b"request head over 16 KiB\n")] and closed, size
        s = silent(endpoint.port, head(65_000)[:30_000])  # still incomplete past 16 KiB
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 431 ")
        s.close()
    finally:
        endpoint.close()


def test_a_head_with_bare_lf_line_ends_is_answered_400_at_once() -> None:
    endpoint = httpd.serve(One(), 0, "127.0.0.1")
    try:
        for data in (
            b"GET /metrics HTTP/1.1\nHost: x\n\n",
            # CRLF and LF mixed: read as two headers here, as one by a proxy that wants CRLF
            b"GET /metrics HTTP/1.1\r\nHost: x\nContent-Length: 5\r\n\r\nGET /smuggled HTTP/1.1\r\n\r\n",
        ):
            started = time.monotonic()
            got, closed = exchange(endpoint.port, data)
            assert responses(got) == [
                (400, b"a line of the request head ends in a bare LF: end each line with CRLF\n")
            ]
            assert closed and time.monotonic() - started < 1.0, (
                "answered, not left to the head deadline"
            )
    finally:
        endpoint.close()


def test_expect_100_continue_is_answered_at_once_and_other_expectations_417() -> None:
    endpoint = httpd.serve(One(), 0, "127.0.0.1")
    try:
        # a body announced, and the client waits for a go-ahead: the answer comes without it
        started = time.monotonic()
        got, closed = exchange(
            endpoint.port,
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Content-Length: 10\r\n\r\n",
        )
        [(status, body)] = responses(got)
        assert (
            status == 200
            and b"ddpmon_rank_info 1.0" in body
            and b"\r\nConnection: close\r\n" in got
        )
        assert closed and time.monotonic() - started < 1.0
        # without a body, nothing to wait for: answered, and the connection kept
        got, closed = exchange(
            endpoint.port,
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n"
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        assert [s for s, _ in responses(got)] == [200, 200] and closed
        got, closed = exchange(
            endpoint.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nExpect: a-miracle\r\n\r\n"
        )
        assert (
            responses(got) == [(417, b"'Expect: a-miracle' cannot be met (only 100-continue is)\n")]
            and closed
        )
    finally:
        endpoint.close()


def test_random_framing_gets_an_answer_never_a_5xx_or_a_logged_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A small fuzz of the framing (seeded, 2 s): pipelined requests with headers picked at
    random, some with a byte flipped, a CRLF made LF or the end cut; each connection is
    answered or closed within the deadlines, with no 5xx but 501 (a Transfer-Encoding) and
    nothing logged."""
    import random

    monkeypatch.setattr(httpd, "HEADER_SECONDS", 0.3)
    monkeypatch.setattr(httpd, "REQUEST_SECONDS", 0.5)
    endpoint = httpd.serve(
        One(), 0, "127.0.0.1", quick_routes={"/q": lambda query, reader: ("text/plain", b"q")}
    )
    rng = random.Random(36)
    lines = [
        b"GET /metrics HTTP/1.1",
        b"HEAD /q HTTP/1.1",
        b"GET /q?a=1 HTTP/1.0",
        b"POST /q HTTP/1.1",
        b"GET http://x/q HTTP/1.1",
        b"GET  /q HTTP/1.1",
        b"GET /q HTTP/2.0",
        b"get /q HTTP/1.1",
    ]
    fields = [
        b"Host: x",
        b"Host: y",
        b"Content-Length: 3",
        b"Content-Length: 4",
        b"Content-Length: 99999",
        b"Transfer-Encoding: chunked",
        b"Expect: 100-continue",
        b"Expect: x",
        b"Connection: close",
        b"Connection: keep-alive",
        b"Accept-Encoding: gzip",
        b"X: a\x00b",
        b" folded",
        b"X:" + b"y" * 9000,
    ]

    def request() -> bytes:
        head = [rng.choice(lines), *rng.sample(fields, rng.randint(0, 4))]
        if rng.random() < 0.8:
            head.insert(1, b"Host: x")
        return b"\r\n".join(head) + b"\r\n\r\n" + rng.choice([b"", b"abc", b"abcd"])

    try:
        with caplog.at_level("WARNING", logger="ddpmon"):
            cases = 0
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                data = bytearray(b"".join(request() for _ in range(rng.randint(1, 3))))
                mutation = rng.randrange(4)
                if mutation == 1:
                    data[rng.randrange(len(data))] = rng.randrange(256)
                elif mutation == 2:
                    data = data.replace(b"\r\n", b"\n", 1)
                elif mutation == 3:
                    del data[rng.randrange(len(data)) :]
                data += b"GET /q HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                got, closed = exchange(endpoint.port, bytes(data), within=3.0)
                statuses = [
                    int(line.split(b" ")[1])
                    for line in got.split(b"\r\n")
                    if line.startswith(b"HTTP/1.1 ")
                ]
                assert closed and all(s < 500 or s == 501 for s in statuses), (
                    bytes(data),
                    got[:300],
                )
                cases += 1
        assert cases > 50 and caplog.records == []
        assert get(f"http://127.0.0.1:{endpoint.port}/metrics")[0] == 200
    finally:
        endpoint.close()


def test_a_rank_whose_web_config_cannot_be_used_serves_nothing_rather_than_in_the_clear(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "web.yml"
    bad.write_text("tls_server_config:\n  cert_file: missing.crt\n  key_file: missing.key\n")
    assert httpd.start_endpoint(One(), 0, 0, "127.0.0.1", 3, str(bad)) is None
    assert (
        f"ddpmon: rank 3: no metrics endpoint (training goes on): DDPMON_WEB_CONFIG_FILE {bad}: "
        "cert_file 'missing.crt' does not exist"
    ) in caplog.text
