"""The Prometheus side: a private registry, collectors read at scrape time, an HTTP endpoint.

Everything else in ddpmon produces plain ``Sample`` tuples ``(name, labels, value)`` named
from the catalog; this module alone turns them into metric families (the only importer of
prometheus_client), so a scrape costs nothing until Prometheus asks. Torch-free: the rank's
collector (``rank/exporter.py``) and the node daemon both serve through it.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.core import Metric as Family

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


def histogram(name: str, label_names: list[str], label_values: list[str], h: Any) -> Family:
    """One histogram family of one series; ``h`` has ``cumulative()`` and ``sum``
    (``rank.books.Histogram``)."""
    family = histogram_family(name, label_names)
    family.add_metric(label_values, h.cumulative(), h.sum)
    return family


def histogram_family(name: str, label_names: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, catalog.get(name).help, labels=label_names)


@dataclass
class Endpoint:
    """A running /metrics endpoint; ``port`` is the bound port (also for port 0)."""

    port: int
    bind: str
    _server: Any
    _thread: threading.Thread

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(2.0)


Route = Callable[[], tuple[str, bytes]]


class Unhealthy(Exception):
    """Raised by a route (a health check) to answer 503 with its message."""


def serve(collector: Any, port: int, bind: str = "0.0.0.0", routes: dict[str, Route] | None = None) -> Endpoint:
    """Serve ``collector`` from a private registry on ``bind:port`` (0 = ephemeral).
    ``routes`` adds read-only paths beside the metrics: path -> () -> (content type, body);
    a route that raises LookupError answers 404 with its message, Unhealthy 503.
    Raises OSError when the port cannot be bound."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    app = make_wsgi_app(registry)
    if routes:
        app = _with_routes(app, dict(routes))
    server, thread = start_bounded_server(app, port, bind)
    return Endpoint(server.server_address[1], bind, server, thread)


MAX_CONNECTION_THREADS = 8
"""Connections served at once; more wait in the listen queue (a scrape takes milliseconds)."""
IO_TIMEOUT_SECONDS = 5.0
"""A connection that sends nothing (or reads nothing) for this long is closed."""
LISTEN_BACKLOG = 128
SLOT_WAIT_SECONDS = 1.0
"""How long a new connection may wait for a free thread before it is closed unanswered."""


class _QuietHandler(WSGIRequestHandler):
    """One request per connection, with read and write timeouts; logs nothing."""

    timeout = IO_TIMEOUT_SECONDS

    def log_message(self, format: str, *args: Any) -> None:
        pass


class BoundedWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    """A thread per connection, but at most ``MAX_CONNECTION_THREADS`` of them: a client
    that opens hundreds of connections and sends nothing (a slowloris) holds a few threads
    for ``IO_TIMEOUT_SECONDS`` each, never hundreds of threads in the training process."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    allow_reuse_address = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTION_THREADS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(timeout=SLOT_WAIT_SECONDS):
            self.shutdown_request(request)  # every thread busy: close it, keep accepting
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out or went away is not news


def start_bounded_server(app: Callable[..., Any], port: int, bind: str) -> tuple[BoundedWSGIServer, threading.Thread]:
    """Serve the WSGI ``app`` on ``bind:port`` from a daemon thread (IPv4 or IPv6)."""
    infos = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = next(iter(infos))

    class Server(BoundedWSGIServer):
        address_family = family

    server = make_server(str(sockaddr[0]), port, app, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="ddpmon-endpoint", daemon=True)
    thread.start()
    return server, thread


def _with_routes(app: Callable[..., Any], routes: dict[str, Route]) -> Callable[..., Any]:
    def routed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        route = routes.get(environ.get("PATH_INFO", ""))
        if route is None:
            return app(environ, start_response)
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        try:
            content_type, body = route()
        except (LookupError, Unhealthy) as exc:  # known but not served now / failing
            message = (str(exc.args[0] if exc.args else exc) + "\n").encode()
            status = "503 Service Unavailable" if isinstance(exc, Unhealthy) else "404 Not Found"
            start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(message)))])
            return [message]
        start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]

    return routed


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
