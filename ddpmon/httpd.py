"""The HTTP server: a collector in a private registry, read at scrape time, and read-only
routes, served from one event loop (an idle or hostile client costs a socket, not a thread).

Torch-free: a rank serves its ``/metrics`` through it (``rank/exporter.py``'s collector), and
the node daemon its ``/metrics``, ``/state``, ``/history`` and ``/healthz``. The families the
collectors return are built in ``metrics/exposition.py``.
"""

from __future__ import annotations

import errno
import functools
import gzip
import logging
import math
import queue
import resource
import selectors
import socket
import ssl
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

from .webconfig import WebConfig, WebConfigError, load_web_config

log = logging.getLogger("ddpmon")

Query = dict[str, list[str]]
"""A request's query string, parsed (``parse_qs``: name -> every value given)."""


@dataclass(frozen=True)
class Reader:
    """Who asks, for a route whose answer depends on it (the daemon's ``/state``)."""

    peer: tuple[Any, ...]
    """The client's address, as ``accept`` gave it."""
    local: tuple[Any, ...]
    """This server's end of the connection."""
    authenticated: bool
    """It proved who it is: basic auth, or a client certificate verified against the web
    config's CA. False where the web config asks for neither (and for a quick route)."""
    encrypted: bool = False
    """The connection is TLS: credentials did not cross the network in the clear."""


Route = Callable[[Query, Reader], tuple[str, bytes]]
PostRoute = Callable[[Query, Reader, bytes], tuple[str, bytes]]
"""A route that acts on request (the daemon's ``/set``): it also takes the request's body."""


class Unhealthy(Exception):
    """Raised by a route (a health check) to answer 503 with its message."""


class Forbidden(Exception):
    """Raised by a route to answer 403 with its message: why this request may not act
    here, and the fix."""


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


def serve(
    collector: Any,
    port: int,
    bind: str = "0.0.0.0",
    routes: dict[str, Route] | None = None,
    quick_routes: dict[str, Route] | None = None,
    web: WebConfig | None = None,
    post_routes: dict[str, PostRoute] | None = None,
) -> Endpoint:
    """Serve ``collector`` from a private registry on ``bind:port`` (0 = ephemeral): at
    ``/metrics`` (and, as prometheus_client does, at any path that is not a route).
    ``routes`` adds read-only paths: path -> (query, reader) -> (content type, body),
    produced off the event loop like the metrics; ``quick_routes`` are answered on the loop
    itself, so they must never block: a health check that must answer while a slow route
    holds the worker (it needs no credentials: it says only whether sampling runs).
    ``post_routes`` take a POST with a body of at most ``MAX_BODY_BYTES`` (and nothing
    else): path -> (query, reader, body) -> (content type, body), off the loop. A route
    that raises BadRequest answers 400 with its message, Forbidden 403, LookupError 404,
    Unhealthy 503.
    ``web`` (exporter-toolkit's web config, ``webconfig.load_web_config``) adds TLS and
    basic auth, as node_exporter's ``--web.config.file``: a request without the credentials
    it asks for answers 401.
    Raises OSError when the port cannot be bound."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server = _Server(
        _listen(bind, port),
        registry,
        dict(routes or {}),
        dict(quick_routes or {}),
        web or WebConfig(""),
        dict(post_routes or {}),
    )
    return Endpoint(server, bind)


# -- the HTTP server: one event loop ------------------------------------------------------------
#
# One thread runs a selectors loop over every connection, so an idle or slow client costs a
# socket, never a thread; one worker thread produces the bodies (the collectors run at scrape
# time and may take milliseconds), so the loop keeps accepting, reading and writing meanwhile.
# h11 (sans-I/O) reads and frames HTTP/1.1: this module only moves bytes and keeps the limits.
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
"""A request's line and headers, in bytes: larger is answered 431."""
MAX_BODY_BYTES = 64 * 1024
"""A request's body (read and dropped, but for a POST route's): larger is answered 413."""
READ_BYTES = 64 * 1024
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


@dataclass
class _Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-case names; a field given twice, its values joined by ", "
    close: bool = False  # answer with Connection: close (its body is left unread)
    body: bytearray | None = None  # kept for a POST route only (else read and dropped)


@dataclass
class _Answer:
    """A response before h11 frames it: produced anywhere, framed on the loop only."""

    status: int
    content_type: str
    body: bytes
    headers: list[tuple[str, str]] = field(default_factory=list)
    close: bool = False


def _http() -> h11.Connection:
    # h11 refuses an incomplete head past this size; a complete one is measured in _read_event
    return h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)


@dataclass(eq=False)
class _Connection:
    """One client: its socket, its HTTP state (h11's) and where it stands with the loop. The
    socket is read and written in ``receive`` and ``transmit`` only, so that wrapping it in
    TLS changes those two."""

    sock: socket.socket
    since: float  # when it started waiting in its state (the oldest idle one goes first)
    deadline: float
    peer: tuple[Any, ...] = ()
    state: str = (
        "new"  # handshake (TLS), new, idle (kept alive), request (part of one), working, writing
    )
    http: h11.Connection = field(default_factory=_http)
    head: bytearray = field(default_factory=bytearray)
    """What h11 holds while it waits for a request's head: h11 reads a head whole but says
    neither how long it was nor how its lines ended."""
    request: _Request | None = None  # the one being answered
    outbox: memoryview = field(default_factory=lambda: memoryview(b""))
    events: int = 0  # what the selector watches it for (0: not registered, the worker has it)
    served: int = 0  # requests answered

    def receive(self) -> bytes | None:
        """The client's next bytes: b"" at its end (or a reset), None when none are ready.
        Over TLS, everything already decrypted too: the selector does not see what the TLS
        layer holds."""
        try:
            data = self.sock.recv(READ_BYTES)
            if isinstance(self.sock, ssl.SSLSocket):
                while data and self.sock.pending():
                    data += self.sock.recv(self.sock.pending())
            return data
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None
        except OSError:  # (ssl.SSLError included: a client that breaks TLS is gone)
            return b""

    def transmit(self) -> int | None:
        """Send from the outbox what the socket takes: the bytes sent, None when it failed."""
        try:
            sent = self.sock.send(self.outbox)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return 0
        except OSError:
            return None
        self.outbox = self.outbox[sent:]
        return sent

    def handshake(self) -> int | None:
        """Go on with the TLS handshake: 0 once done, else the event it waits for (None:
        the client failed it, a plain HTTP request on a TLS port among others)."""
        assert isinstance(self.sock, ssl.SSLSocket)
        try:
            self.sock.do_handshake()
            return 0
        except ssl.SSLWantReadError:
            return selectors.EVENT_READ
        except ssl.SSLWantWriteError:
            return selectors.EVENT_WRITE
        except OSError:
            return None

    @property
    def sock_encrypted(self) -> bool:
        return isinstance(self.sock, ssl.SSLSocket)

    @property
    def verified(self) -> bool:
        """The client showed a certificate that the web config's CA verified."""
        return isinstance(self.sock, ssl.SSLSocket) and self.sock.getpeercert() is not None


class _Server:
    """The loop (thread ``ddpmon-endpoint``) and its worker (``ddpmon-endpoint-worker``)."""

    def __init__(
        self,
        listener: socket.socket,
        registry: CollectorRegistry,
        routes: dict[str, Route],
        quick_routes: dict[str, Route],
        web: WebConfig,
        post_routes: dict[str, PostRoute],
    ) -> None:
        self._listener = listener
        self._posts = post_routes
        self._web = web
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
        self._done: deque[tuple[_Connection, _Answer]] = deque()
        self._unsent = 0
        self._next_sweep = math.inf
        self._accepting_at = 0.0  # accept() paused until then (out of file descriptors)
        self._stopping = False
        self._warned: str | None = None  # the last failure logged (loop or worker)
        self._sel.register(listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._loop = threading.Thread(target=self._run, name="ddpmon-endpoint", daemon=True)
        self._worker = threading.Thread(
            target=self._work, name="ddpmon-endpoint-worker", daemon=True
        )
        self._loop.start()
        self._worker.start()

    def close(self) -> None:
        self._stopping = True
        self._wake()
        self._jobs.put(None)
        self._loop.join(2.0)
        self._worker.join(2.0)

    def _warn_once(self, what: str, exc: BaseException) -> None:
        """Log a failure with its traceback when it is new, not per request: a client that
        repeats a failing request must not fill the log."""
        if self._warned != repr(exc):
            self._warned = repr(exc)
            log.warning("ddpmon: %s: %r", what, exc, exc_info=exc)

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

    def _serve(self, conn: _Connection, events: int = 0, answer: _Answer | None = None) -> None:
        """Go on with ``conn``: readable or writable (``events``), or answered by the worker."""
        try:
            if conn.state == "handshake":
                self._handshake(conn)
            elif answer is not None:
                self._respond(conn, answer)
                self._advance(conn)
            elif events & selectors.EVENT_READ:
                self._read(conn)
            elif self._transmit(conn):
                self._advance(conn)
        except Exception as exc:  # a bug must cost one connection, not the endpoint
            self._warn_once("the metrics endpoint dropped a connection", exc)
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
            conn, answer = self._done.popleft()
            if conn in self._conns:
                self._serve(conn, answer=answer)

    def _sweep(self) -> None:
        """Close every connection past its deadline; sleep until the next one."""
        now = time.monotonic()
        for conn in [c for c in self._conns if c.deadline <= now]:
            self._close(conn)
        if self._accepting_at and now >= self._accepting_at:
            self._accepting_at = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ)
        upcoming = [c.deadline for c in self._conns] + (
            [self._accepting_at] if self._accepting_at else []
        )
        self._next_sweep = max(min(upcoming, default=math.inf), now + 0.05)

    def _expect(self, conn: _Connection, state: str, seconds: float) -> None:
        """``conn`` waits in ``state`` from now, for at most ``seconds``."""
        conn.state = state
        conn.since = time.monotonic()
        conn.deadline = conn.since + seconds
        self._next_sweep = min(self._next_sweep, conn.deadline)
        self._conns.move_to_end(conn)

    def _watch(self, conn: _Connection, events: int) -> None:
        """Have the selector watch ``conn`` for ``events`` (0: not at all)."""
        if events == conn.events:
            return
        if not conn.events:
            self._sel.register(conn.sock, events, conn)
        elif not events:
            self._sel.unregister(conn.sock)
        else:
            self._sel.modify(conn.sock, events, conn)
        conn.events = events

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, peer = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if (
                    exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
                    and not self._evict()
                ):
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
            state = "new"
            if self._web.ssl is not None:  # the handshake, like the head, within HEADER_SECONDS
                sock = self._web.ssl.wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
                state = "handshake"
            conn = _Connection(sock, now, now + HEADER_SECONDS, peer, state=state)
            self._conns[conn] = None
            self._next_sweep = min(self._next_sweep, conn.deadline)
            self._watch(conn, selectors.EVENT_READ)

    def _handshake(self, conn: _Connection) -> None:
        """One step of a TLS handshake (a new connection keeps its accept's deadline)."""
        wanted = conn.handshake()
        if wanted is None:
            self._close(conn)
        elif wanted:
            self._watch(conn, wanted)
        else:
            conn.state = "new"
            self._watch(conn, selectors.EVENT_READ)
            self._read(conn)  # a request may have come with the handshake's last bytes

    def _evict(self) -> bool:
        """Close the connection that has waited on its client the longest, one that never
        sent a whole request first (a kept-alive scraper outlives a slowloris)."""
        waiting = (c for c in self._conns if c.state != "working")
        victim = next((c for c in waiting if not c.served), None) or next(
            (c for c in self._conns if c.state != "working"), None
        )
        if victim is None:
            return False
        self._close(victim)
        return True

    def _close(self, conn: _Connection) -> None:
        if conn not in self._conns:
            return
        del self._conns[conn]
        self._unsent -= len(conn.outbox)
        self._watch(conn, 0)
        conn.sock.close()

    def _read(self, conn: _Connection) -> None:
        data = conn.receive()
        if data is None:
            return
        if not data:  # the client left: nothing to answer
            self._close(conn)
            return
        if conn.state == "idle":  # the next request begins: its head has HEADER_SECONDS
            self._expect(conn, "request", HEADER_SECONDS)
        conn.state = "request"  # (a new connection keeps its deadline from the accept)
        if conn.http.their_state is h11.IDLE:
            conn.head += data
        conn.http.receive_data(data)
        self._advance(conn)

    def _advance(self, conn: _Connection) -> None:
        """Answer the whole requests h11 holds, in order, until one goes to the worker, an
        answer waits on the socket, or more bytes are needed. A loop, not a recursion: a
        thousand pipelined requests cost no stack."""
        http = conn.http
        while conn in self._conns and conn.state != "working" and not conn.outbox:
            if http.our_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):  # an answer went out
                if http.our_state is not h11.DONE or http.their_state is not h11.DONE:
                    self._close(conn)
                    return
                http.start_next_cycle()
                conn.request = None
                conn.head = bytearray(http.trailing_data[0])  # the next request, pipelined
                self._watch(conn, selectors.EVENT_READ)
                if conn.head:
                    self._expect(conn, "request", HEADER_SECONDS)
                else:
                    self._expect(conn, "idle", IDLE_SECONDS)
            event = self._read_event(conn)
            if isinstance(event, _Answer):
                self._respond(conn, event)
            elif isinstance(event, h11.EndOfMessage):
                self._dispatch(conn)
            elif isinstance(event, h11.Data) and conn.request and conn.request.body is not None:
                conn.request.body += event.data  # (bounded: Content-Length, checked)
            elif event is h11.NEED_DATA:
                if not http.they_are_waiting_for_100_continue:
                    return
                # The client waits for a 100 (Continue) before it sends a body, which no route
                # reads: answer at once, and close rather than read and drop the body. RFC 9110
                # (10.1.1) allows a final status instead of 100 and 417 is for an expectation
                # a server cannot meet; Go's net/http does the same for a handler that never
                # reads the body.
                assert conn.request is not None
                conn.request.close = True
                self._dispatch(conn)
            # (h11.Data: any other request's body, dropped)

    def _read_event(self, conn: _Connection) -> Any:
        """h11's next event, or the answer to a request that is not served: what h11 refuses
        and what it lets through but ddpmon does not (see ``_refusal``)."""
        http = conn.http
        try:
            event = http.next_event()
        except h11.RemoteProtocolError as exc:
            if exc.error_status_hint == 431:
                return _refused(431, f"request head over {MAX_HEAD_BYTES // 1024} KiB")
            return _refused(
                exc.error_status_hint,
                f"{exc}: expected a request such as 'GET /metrics HTTP/1.1' with a Host "
                "header (and one Content-Length, in digits, before a body)",
            )
        if isinstance(event, h11.Request):
            head = bytes(conn.head[: len(conn.head) - len(http.trailing_data[0])])
            conn.head = bytearray()
            conn.request = _request(event)
            conn.deadline = (
                conn.since + REQUEST_SECONDS
            )  # a body may follow: the whole request has a bound
            post = conn.request.path in self._posts
            problem = _refusal(conn.request, head, post)
            if problem is not None:
                return _refused(*problem, allow="POST" if post else "GET, HEAD")
            if conn.request.method == "POST":
                conn.request.body = bytearray()
        return event

    def _dispatch(self, conn: _Connection) -> None:
        """Answer the request just read: a quick route on the loop, anything else on the worker."""
        request = conn.request
        assert request is not None
        conn.served += 1
        quick = self._quick.get(request.path)
        if quick is not None:
            self._respond(
                conn, self._route_answer(request, quick, Reader(conn.peer, _local(conn), False))
            )
            return
        self._watch(conn, 0)
        self._expect(conn, "working", math.inf)
        self._jobs.put((conn, request))

    def _respond(self, conn: _Connection, answer: _Answer) -> None:
        """Frame ``answer`` with h11 and start writing it; the rest as the socket drains."""
        request = conn.request
        headers = [
            ("Content-Type", answer.content_type),
            ("Date", formatdate(usegmt=True)),
            *answer.headers,
            ("Content-Length", str(len(answer.body))),
        ]
        if answer.close or (request is not None and request.close):
            headers.append(("Connection", "close"))
        http = conn.http
        parts = [
            http.send(
                h11.Response(
                    status_code=answer.status,
                    headers=headers,
                    reason=HTTPStatus(answer.status).phrase,
                )
            )
        ]
        if answer.body and (request is None or request.method != "HEAD"):
            parts += http.send_with_data_passthrough(h11.Data(data=answer.body)) or []
        parts.append(http.send(h11.EndOfMessage()))
        response = b"".join(p for p in parts if p)
        self._expect(conn, "writing", RESPONSE_SECONDS)
        conn.outbox = memoryview(response)
        self._unsent += len(response)
        self._transmit(conn)
        while self._unsent > MAX_UNSENT_BYTES:  # slow readers hold too much: the oldest goes
            oldest = next((c for c in self._conns if c.state == "writing"), conn)
            if oldest is conn:
                break
            self._close(oldest)

    def _transmit(self, conn: _Connection) -> bool:
        """Write from the outbox; True once it is empty."""
        sent = conn.transmit()
        if sent is None:
            self._close(conn)
            return False
        self._unsent -= sent
        if conn.outbox:
            self._watch(conn, selectors.EVENT_WRITE)
            return False
        return True

    # -- the worker --------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            conn, request = job
            route = self._routes.get(request.path)
            post = self._posts.get(request.path) if request.method == "POST" else None
            try:
                authenticated = conn.verified or (
                    bool(self._web.users) and self._web.allows(request.headers.get("authorization"))
                )
                if self._web.guarded and not authenticated:
                    answer = _Answer(
                        401,
                        "text/plain",
                        b"credentials needed (basic auth, or a client certificate)\n",
                        [("WWW-Authenticate", 'Basic realm="ddpmon"')],
                    )
                elif post:
                    answer = self._route_answer(
                        request,
                        functools.partial(_with_body, post, bytes(request.body or b"")),
                        Reader(conn.peer, _local(conn), authenticated, conn.sock_encrypted),
                    )
                elif route:
                    answer = self._route_answer(
                        request,
                        route,
                        Reader(conn.peer, _local(conn), authenticated, conn.sock_encrypted),
                    )
                else:
                    answer = self._metrics(request)
            except Exception as exc:  # (gzip out of memory, ...): never lose the worker
                self._warn_once(f"answering {request.path} failed", exc)
                answer = _Answer(500, "text/plain", f"{exc!r}\n".encode(), close=True)
            self._done.append((conn, answer))
            self._wake()

    def _metrics(self, request: _Request) -> _Answer:
        try:
            encoder, content_type = choose_encoder(request.headers.get("accept", ""))
            registry = self._registry
            names = parse_qs(request.query).get("name[]")
            if names:
                registry = registry.restricted_registry(names)  # type: ignore[assignment]
            body = encoder(registry)
        except Exception as exc:  # a collector failed: say so
            self._warn_once("a metrics scrape failed", exc)
            return _answer(500, "text/plain", f"collecting failed: {exc!r}\n".encode(), request)
        return _answer(200, content_type, body, request)

    def _route_answer(self, request: _Request, route: Route, reader: Reader) -> _Answer:
        try:
            content_type, body = route(parse_qs(request.query, keep_blank_values=True), reader)
        except (BadRequest, Forbidden, LookupError, Unhealthy) as exc:  # a bad query, not served
            status = (
                400
                if isinstance(exc, BadRequest)
                else 403
                if isinstance(exc, Forbidden)
                else 503
                if isinstance(exc, Unhealthy)
                else 404
            )
            message = str(exc.args[0] if exc.args else exc) + "\n"
            return _answer(status, "text/plain", message.encode(), request)
        except Exception as exc:  # a bug in a route: answer, and say it where it can be fixed
            self._warn_once(f"{request.path} failed", exc)
            return _answer(500, "text/plain", f"{exc!r}\n".encode(), request)
        return _answer(200, content_type, body, request)


def _with_body(post: PostRoute, body: bytes, query: Query, reader: Reader) -> tuple[str, bytes]:
    return post(query, reader, body)


def _local(conn: _Connection) -> tuple[Any, ...]:
    try:
        return tuple(conn.sock.getsockname())
    except OSError:
        return ()


def _request(event: h11.Request) -> _Request:
    headers: dict[str, str] = {}
    for name, value in event.headers:
        key, text = name.decode("latin-1"), value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    target = urlsplit(event.target.decode("latin-1"))  # (also the absolute form, from a proxy)
    return _Request(event.method.decode("latin-1"), target.path or "/", target.query, headers)


def _refusal(request: _Request, head: bytes, post_route: bool = False) -> tuple[int, str] | None:
    """Why a request h11 has read is not served, as (status, message); None when it is.
    h11 refuses a malformed head (400: a bad request line or header, a Content-Length that is
    not digits or given twice with two values, no Host in HTTP/1.1) and an incomplete head
    over the limit (431); these are what it lets through."""
    if len(head) > MAX_HEAD_BYTES:
        return 431, f"request head over {MAX_HEAD_BYTES // 1024} KiB"
    if head.count(b"\n") != head.count(b"\r\n"):
        # h11 reads a bare LF as a line's end, as RFC 9112 (2.2) allows; a proxy in front may
        # not, and the two would disagree on where a request ends (request smuggling)
        return 400, "a line of the request head ends in a bare LF: end each line with CRLF"
    if post_route and request.method != "POST":
        return 405, f"{request.path} takes POST only"
    if not post_route and request.method not in ("GET", "HEAD"):
        return 405, f"{request.method} is not served; use GET"
    if "transfer-encoding" in request.headers:
        return 501, "chunked request bodies are not accepted"
    if int(request.headers.get("content-length", "0")) > MAX_BODY_BYTES:
        return 413, f"a request body over {MAX_BODY_BYTES // 1024} KiB"
    expect = request.headers.get("expect", "").lower()
    if expect and post_route:
        return 417, f"'Expect: {expect}' is not met on {request.path}: send the body at once"
    if expect and expect != "100-continue":
        return 417, f"'Expect: {expect}' cannot be met (only 100-continue is)"
    return None


def _refused(status: int, message: str, allow: str = "GET, HEAD") -> _Answer:
    """The answer to a request that is not served; the connection closes after it."""
    headers = [("Allow", allow)] if status == 405 else []
    return _Answer(status, "text/plain", (message + "\n").encode(), headers, close=True)


def _answer(status: int, content_type: str, body: bytes, request: _Request) -> _Answer:
    """An answer to ``request``; gzip when it accepts it (as prometheus_client does)."""
    if not gzip_accepted(request.headers.get("accept-encoding", "")):
        return _Answer(status, content_type, body)
    body = gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0)
    return _Answer(status, content_type, body, [("Content-Encoding", "gzip")])


def start_endpoint(
    collector: Any,
    base_port: int,
    local_rank: int,
    bind: str,
    rank: int,
    web_config_file: str | None = None,
) -> Endpoint | None:
    """A rank's endpoint on ``base_port + local_rank`` (0: ephemeral; negative: none), with
    the TLS and basic auth of ``web_config_file``. A port in use falls back to an ephemeral
    one, with a warning that names the state file's ``port``; an address that cannot be
    bound, or a web config file that cannot be used, leaves the rank without an endpoint
    (never one in the clear that was asked to be guarded)."""
    if base_port < 0:
        return None
    web = None
    if web_config_file:
        try:
            web = load_web_config(web_config_file)
        except WebConfigError as exc:
            log.warning(
                "ddpmon: rank %d: no metrics endpoint (training goes on): DDPMON_WEB_CONFIG_FILE %s",
                rank,
                exc,
            )
            return None
    port = base_port + local_rank if base_port > 0 else 0
    try:
        return serve(collector, port, bind, web=web)
    except (OSError, OverflowError) as exc:
        if port == 0:
            log.warning(
                "ddpmon: rank %d: no metrics endpoint: cannot bind %s (%s)", rank, bind, exc
            )
            return None
        log.warning(
            "ddpmon: rank %d: cannot serve metrics on %s:%d (%s); serving on an ephemeral port "
            "instead (see the state file's 'port'). Set DDPMON_PORT to a free base port.",
            rank,
            bind,
            port,
            getattr(exc, "strerror", None) or exc,
        )
        try:
            return serve(collector, 0, bind, web=web)
        except (OSError, OverflowError) as exc2:
            log.warning("ddpmon: rank %d: no metrics endpoint (%s)", rank, exc2)
            return None
