"""The Prometheus side: a private registry, collectors read at scrape time, an HTTP endpoint
served from one event loop (an idle or hostile client costs a socket, not a thread).

Everything else in ddpmon produces plain ``Sample`` tuples ``(name, labels, value)`` named
from the catalog; this module alone turns them into metric families (the only importer of
prometheus_client), so a scrape costs nothing until Prometheus asks. Torch-free: the rank's
collector (``rank/exporter.py``) and the node daemon both serve through it.
"""

from __future__ import annotations

import errno
import gzip
import logging
import math
import queue
import resource
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.core import Metric as Family
from prometheus_client.exposition import choose_encoder, gzip_accepted

from . import catalog

log = logging.getLogger("ddpmon")

Sample = tuple[str, dict[str, str], float]
SampleSource = Callable[[], Iterable[Sample]]


def families(samples: Iterable[Sample]) -> list[Family]:
    """Group plain samples into metric families, typed and documented by the catalog."""
    by_name: dict[str, Family] = {}
    for name, labels, value in samples:
        family = by_name.get(name)
        if family is None:
            spec = catalog.get(name)
            cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            family = by_name[name] = cls(name, spec.help, labels=list(labels))
        family.add_metric([str(v) for v in labels.values()], value)
    return list(by_name.values())


def state_set(name: str, labels: dict[str, str], label: str, states: Iterable[str], current: str) -> list[Sample]:
    """A state set (Prometheus' convention for an enumeration): one sample per state, under
    ``label``, 1 for ``current`` and 0 for the others, so a change moves no series."""
    return [(name, {**labels, label: state}, 1.0 if state == current else 0.0) for state in states]


def histogram(name: str, label_names: list[str], label_values: list[str], h: Any) -> Family:
    """One histogram family of one series; ``h`` has ``cumulative()`` and ``sum``
    (``rank.books.Histogram``)."""
    family = histogram_family(name, label_names)
    family.add_metric(label_values, h.cumulative(), h.sum)
    return family


def histogram_family(name: str, label_names: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, catalog.get(name).help, labels=label_names)


Query = dict[str, list[str]]
"""A request's query string, parsed (``parse_qs``: name -> every value given)."""
Route = Callable[[Query], tuple[str, bytes]]


class Unhealthy(Exception):
    """Raised by a route (a health check) to answer 503 with its message."""


class BadRequest(Exception):
    """Raised by a route to answer 400 with its message: what was wrong with the query and
    what it accepts."""


class Endpoint:
    """A running HTTP endpoint; ``port`` is the bound port (also for port 0)."""

    def __init__(self, server: _Server, bind: str) -> None:
        self._server = server
        self.port: int = server.port
        self.bind = bind

    def close(self) -> None:
        self._server.close()


def serve(collector: Any, port: int, bind: str = "0.0.0.0", routes: dict[str, Route] | None = None,
          quick_routes: dict[str, Route] | None = None) -> Endpoint:
    """Serve ``collector`` from a private registry on ``bind:port`` (0 = ephemeral): at
    ``/metrics`` (and, as prometheus_client does, at any path that is not a route).
    ``routes`` adds read-only paths: path -> (query) -> (content type, body), produced off
    the event loop like the metrics; ``quick_routes`` are answered on the loop itself, so they
    must never block: a health check that must answer while a slow route holds the worker.
    A route that raises BadRequest answers 400 with its message, LookupError 404, Unhealthy
    503.
    Raises OSError when the port cannot be bound."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server = _Server(_listen(bind, port), registry, dict(routes or {}), dict(quick_routes or {}))
    return Endpoint(server, bind)


# -- the HTTP server: one event loop ------------------------------------------------------------
#
# One thread runs a selectors loop over every connection, so an idle or slow client costs a
# socket, never a thread; one worker thread produces the bodies (the collectors run at scrape
# time and may take milliseconds), so the loop keeps accepting, reading and writing meanwhile.
# Limits, like Go's net/http with header timeouts (node_exporter, dcgm-exporter):

HEADER_SECONDS = 2.0
"""A request's line and headers must arrive within this long of its first byte (of the
accept, for a connection's first request)."""
REQUEST_SECONDS = 5.0
"""... and the whole request (a body, rare on a GET) within this long."""
IDLE_SECONDS = 90.0
"""A kept-alive connection waits this long for its next request (Prometheus scrapes every
15 to 60 s and reuses its connection)."""
RESPONSE_SECONDS = 30.0
"""A client has this long to read a whole response."""
MAX_HEAD_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
MAX_UNSENT_BYTES = 64 * 2**20
"""Responses waiting for slow readers, in all; past it the oldest such reader is dropped."""
LISTEN_BACKLOG = 1024
GZIP_LEVEL = 6
"""zlib's default: 3x faster than level 9 (prometheus_client's) for 5% more bytes."""


def connection_cap() -> int:
    """Open connections at most: a quarter of this process's file-descriptor limit (the job
    needs the rest: data loaders, NCCL, checkpoints), between 64 and 4,096."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(64, min(4096, soft // 4))


def _listen(bind: str, port: int) -> socket.socket:
    infos = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = next(iter(infos))
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    since: float  # when it started waiting in its state (the oldest idle one goes first)
    deadline: float
    state: str = "new"  # new, idle (kept alive), request (part of one), working, writing
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytes | memoryview = b""
    keep_alive: bool = False
    served: int = 0  # requests answered


@dataclass
class _Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    keep_alive: bool


class _Server:
    """The loop (thread ``ddpmon-endpoint``) and its worker (``ddpmon-endpoint-worker``)."""

    def __init__(self, listener: socket.socket, registry: CollectorRegistry,
                 routes: dict[str, Route], quick_routes: dict[str, Route]) -> None:
        self._listener = listener
        self.port: int = listener.getsockname()[1]
        self._registry = registry
        self._routes = routes
        self._quick = quick_routes
        self._cap = connection_cap()
        self._conns: OrderedDict[_Connection, None] = OrderedDict()  # oldest waiting first
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._jobs: queue.SimpleQueue[tuple[_Connection, _Request] | None] = queue.SimpleQueue()
        self._done: deque[tuple[_Connection, bytes]] = deque()
        self._unsent = 0
        self._next_sweep = math.inf
        self._accepting_at = 0.0  # accept() paused until then (out of file descriptors)
        self._stopping = False
        self._failed: str | None = None  # the last scrape failure logged (worker)
        self._dropped: str | None = None  # the last connection failure logged (loop)
        self._sel.register(listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._loop = threading.Thread(target=self._run, name="ddpmon-endpoint", daemon=True)
        self._worker = threading.Thread(target=self._work, name="ddpmon-endpoint-worker", daemon=True)
        self._loop.start()
        self._worker.start()

    def close(self) -> None:
        self._stopping = True
        self._wake()
        self._jobs.put(None)
        self._loop.join(2.0)
        self._worker.join(2.0)

    # -- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                now = time.monotonic()
                timeout = None if self._next_sweep == math.inf else max(0.0, self._next_sweep - now)
                for key, events in self._sel.select(timeout):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._drain_wake()
                    else:
                        self._serve(key.data, events)
                if time.monotonic() >= self._next_sweep:
                    self._sweep()
        finally:
            for conn in list(self._conns):
                self._close(conn)
            self._sel.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _serve(self, conn: _Connection, events: int) -> None:
        try:
            if events & selectors.EVENT_READ:
                self._read(conn)
            else:
                self._send(conn)
        except Exception as exc:  # a bug must cost one connection, not the endpoint
            if self._dropped != repr(exc):
                self._dropped = repr(exc)
                log.warning("ddpmon: the metrics endpoint dropped a connection: %r", exc, exc_info=exc)
            self._close(conn)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake is pending anyway) or closed
            pass

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
        while self._done:
            conn, response = self._done.popleft()
            if conn in self._conns:
                self._start_response(conn, response)

    def _sweep(self) -> None:
        """Close every connection past its deadline; sleep until the next one."""
        now = time.monotonic()
        for conn in [c for c in self._conns if c.deadline <= now]:
            self._close(conn)
        if self._accepting_at and now >= self._accepting_at:
            self._accepting_at = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ)
        upcoming = [c.deadline for c in self._conns] + ([self._accepting_at] if self._accepting_at else [])
        self._next_sweep = max(min(upcoming, default=math.inf), now + 0.05)

    def _expect(self, conn: _Connection, state: str, seconds: float) -> None:
        """``conn`` waits in ``state`` from now, for at most ``seconds``."""
        conn.state = state
        conn.since = time.monotonic()
        conn.deadline = conn.since + seconds
        self._next_sweep = min(self._next_sweep, conn.deadline)
        self._conns.move_to_end(conn)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) and not self._evict():
                    # out of file descriptors and nothing to drop: stop accepting for a while
                    # (the listener stays readable, which would spin the loop)
                    self._sel.unregister(self._listener)
                    self._accepting_at = time.monotonic() + 0.5
                    self._next_sweep = min(self._next_sweep, self._accepting_at)
                return
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # whole responses only
            except OSError:
                pass
            if len(self._conns) >= self._cap and not self._evict():
                sock.close()  # every connection is waiting on the worker
                continue
            now = time.monotonic()
            conn = _Connection(sock, now, now + HEADER_SECONDS)
            self._conns[conn] = None
            self._next_sweep = min(self._next_sweep, conn.deadline)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _evict(self) -> bool:
        """Close the connection that has waited on its client the longest, one that never
        sent a whole request first (a kept-alive scraper outlives a slowloris)."""
        waiting = (c for c in self._conns if c.state != "working")
        victim = next((c for c in waiting if not c.served), None) or next(
            (c for c in self._conns if c.state != "working"), None)
        if victim is None:
            return False
        self._close(victim)
        return True

    def _close(self, conn: _Connection) -> None:
        if conn not in self._conns:
            return
        del self._conns[conn]
        self._unsent -= len(conn.outbox)
        if conn.state != "working":  # (a working one is not registered)
            self._sel.unregister(conn.sock)
        conn.sock.close()

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        if conn.state == "idle":  # the next request begins: its head has HEADER_SECONDS
            self._expect(conn, "request", HEADER_SECONDS)
        conn.state = "request"  # (a new connection keeps its deadline from the accept)
        conn.inbox += data
        self._parse(conn)

    def _parse(self, conn: _Connection) -> None:
        """Act on a complete request in ``conn.inbox``; wait for more otherwise."""
        end = conn.inbox.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.inbox) > MAX_HEAD_BYTES:
                self._error(conn, "431 Request Header Fields Too Large", "request head over 16 KiB")
            return
        request, length, problem = _parse_head(bytes(conn.inbox[:end]))
        if problem:
            self._error(conn, *problem)
            return
        if len(conn.inbox) < end + 4 + length:  # a body still coming: the whole request has a bound
            conn.deadline = conn.since + REQUEST_SECONDS
            return
        del conn.inbox[: end + 4 + length]  # (a pipelined request stays for after the response)
        conn.keep_alive = request.keep_alive
        conn.served += 1
        quick = self._quick.get(request.path)
        if quick is not None:
            self._start_response(conn, _route_response(request, quick))
            return
        self._sel.unregister(conn.sock)
        self._expect(conn, "working", math.inf)
        self._jobs.put((conn, request))

    def _error(self, conn: _Connection, status: str, message: str) -> None:
        conn.keep_alive = False
        self._start_response(conn, _response(status, "text/plain", (message + "\n").encode(), False))

    def _start_response(self, conn: _Connection, response: bytes) -> None:
        if conn.state == "working":
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)
        self._expect(conn, "writing", RESPONSE_SECONDS)
        conn.outbox = memoryview(response)
        self._unsent += len(response)
        self._send(conn)
        while self._unsent > MAX_UNSENT_BYTES:  # slow readers hold too much: the oldest goes
            oldest = next((c for c in self._conns if c.state == "writing"), conn)
            if oldest is conn:
                break
            self._close(oldest)

    def _send(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(conn)
            return
        conn.outbox = conn.outbox[sent:]
        self._unsent -= sent
        if conn.outbox:
            self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
            return
        if not conn.keep_alive:
            self._close(conn)
            return
        self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
        self._expect(conn, "idle", IDLE_SECONDS)
        if conn.inbox:  # a pipelined request
            self._expect(conn, "request", HEADER_SECONDS)
            self._parse(conn)

    # -- the worker --------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            conn, request = job
            route = self._routes.get(request.path)
            try:
                response = _route_response(request, route) if route else self._metrics(request)
            except Exception as exc:  # (gzip out of memory, ...): never lose the worker
                log.warning("ddpmon: answering %s failed: %r", request.path, exc, exc_info=exc)
                response = _response("500 Internal Server Error", "text/plain", f"{exc!r}\n".encode(), False)
            self._done.append((conn, response))
            self._wake()

    def _metrics(self, request: _Request) -> bytes:
        try:
            encoder, content_type = choose_encoder(request.headers.get("accept", ""))
            registry = self._registry
            names = parse_qs(request.query).get("name[]")
            if names:
                registry = registry.restricted_registry(names)
            body = encoder(registry)
        except Exception as exc:  # a collector failed: say so, once per new failure
            if self._failed != repr(exc):
                self._failed = repr(exc)
                log.warning("ddpmon: a metrics scrape failed: %r", exc, exc_info=exc)
            return _response("500 Internal Server Error", "text/plain", f"collecting failed: {exc!r}\n".encode(),
                             request.keep_alive, request)
        return _response("200 OK", content_type, body, request.keep_alive, request)


def _parse_head(head: bytes) -> tuple[_Request, int, tuple[str, str] | None]:
    """The request, its body's length, and (status, message) when it cannot be served."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    bad = _Request("", "", "", {}, False)
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return bad, 0, ("400 Bad Request", "expected a request line such as 'GET /metrics HTTP/1.1'")
    method, target, version = parts
    if "transfer-encoding" in headers:
        return bad, 0, ("501 Not Implemented", "chunked request bodies are not accepted")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        return bad, 0, ("400 Bad Request", "Content-Length is not a number")
    if not 0 <= length <= MAX_BODY_BYTES:
        return bad, 0, ("413 Content Too Large", "a request body over 64 KiB")
    if not target.startswith("/"):
        target = urlsplit(target).path or "/"  # absolute form, from a proxy
    path, _, query = target.partition("?")
    connection = headers.get("connection", "").lower()
    keep_alive = "keep-alive" in connection if version == "HTTP/1.0" else "close" not in connection
    request = _Request(method, path, query, headers, keep_alive)
    if method not in ("GET", "HEAD"):
        return request, length, ("405 Method Not Allowed", f"{method} is not served; use GET")
    return request, length, None


def _route_response(request: _Request, route: Route) -> bytes:
    try:
        content_type, body = route(parse_qs(request.query, keep_blank_values=True))
    except (BadRequest, LookupError, Unhealthy) as exc:  # a bad query, not served now, failing
        status = ("400 Bad Request" if isinstance(exc, BadRequest) else
                  "503 Service Unavailable" if isinstance(exc, Unhealthy) else "404 Not Found")
        message = str(exc.args[0] if exc.args else exc) + "\n"
        return _response(status, "text/plain", message.encode(), request.keep_alive, request)
    except Exception as exc:  # a bug in a route: answer, and say it where it can be fixed
        log.warning("ddpmon: %s failed: %r", request.path, exc, exc_info=exc)
        return _response("500 Internal Server Error", "text/plain", f"{exc!r}\n".encode(), request.keep_alive, request)
    return _response("200 OK", content_type, body, request.keep_alive, request)


def _response(status: str, content_type: str, body: bytes, keep_alive: bool, request: _Request | None = None) -> bytes:
    """A whole response; gzip when the request accepts it (as prometheus_client does)."""
    head = [f"HTTP/1.1 {status}", f"Content-Type: {content_type}", f"Date: {formatdate(usegmt=True)}"]
    if request is not None and gzip_accepted(request.headers.get("accept-encoding", "")):
        body = gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0)
        head.append("Content-Encoding: gzip")
    head.append(f"Content-Length: {len(body)}")
    if not keep_alive:
        head.append("Connection: close")
    if status.startswith("405"):
        head.append("Allow: GET, HEAD")
    out = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
    return out if request is not None and request.method == "HEAD" else out + body


def start_endpoint(collector: Any, base_port: int, local_rank: int, bind: str, rank: int) -> Endpoint | None:
    """A rank's endpoint on ``base_port + local_rank`` (0: ephemeral; negative: none). A port
    in use falls back to an ephemeral one, with a warning that names the state file's
    ``port``; an address that cannot be bound leaves the rank without an endpoint."""
    if base_port < 0:
        return None
    port = base_port + local_rank if base_port > 0 else 0
    try:
        return serve(collector, port, bind)
    except (OSError, OverflowError) as exc:
        if port == 0:
            log.warning("ddpmon: rank %d: no metrics endpoint: cannot bind %s (%s)", rank, bind, exc)
            return None
        log.warning(
            "ddpmon: rank %d: cannot serve metrics on %s:%d (%s); serving on an ephemeral port "
            "instead (see the state file's 'port'). Set DDPMON_PORT to a free base port.",
            rank, bind, port, getattr(exc, "strerror", None) or exc,
        )
        try:
            return serve(collector, 0, bind)
        except (OSError, OverflowError) as exc2:
            log.warning("ddpmon: rank %d: no metrics endpoint (%s)", rank, exc2)
            return None
