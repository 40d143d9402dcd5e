"""The Prometheus side: a private registry, collectors read at scrape time, an HTTP endpoint.

Everything else in ddpmon produces plain ``Sample`` tuples ``(name, labels, value)`` named
from the catalog; this module alone turns them into metric families (the only importer of
prometheus_client), so a scrape costs nothing until Prometheus asks.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric as Family,
)

from .. import __version__
from ..config import AUTO_PER_BUCKET_LIMIT
from ..recorder import Histogram, Recorder
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


def _histogram(name: str, label_names: list[str], label_values: list[str], h: Histogram) -> Family:
    family = HistogramMetricFamily(name, catalog.get(name).help, labels=label_names)
    family.add_metric(label_values, h.cumulative(), h.sum)
    return family


class RankCollector:
    """Turns one rank's Recorder (and extra sample sources: GPU, host) into families."""

    def __init__(
        self,
        recorder: Recorder,
        bucket_metrics: str = "auto",
        sources: Iterable[SampleSource] = (),
    ) -> None:
        self._recorder = recorder
        self._bucket_metrics = bucket_metrics
        self._sources = list(sources)

    def collect(self) -> Iterator[Family]:
        r = self._recorder
        ident = r.identity
        base = {"job": str(ident["job"]), "rank": str(ident["rank"])}
        names, values = list(base), list(base.values())
        info = dict(base)
        info.update(
            world_size=str(ident["world_size"]), local_rank=str(ident["local_rank"]),
            host=str(ident["host"]), backend=str(ident["backend"]),
            torch_version=str(ident["torch_version"]), debug_level=str(ident["debug_level"]),
            version=__version__, bucket_timing=str(ident.get("bucket_timing", "")),
        )
        samples: list[Sample] = [
            ("ddpmon_rank_info", info, 1.0),
            ("ddpmon_steps_total", base, float(r.steps)),
            ("ddpmon_micro_steps_total", base, float(r.micro_steps)),
            ("ddpmon_unused_parameters", base, float(len(r.unused_parameters))),
            ("ddpmon_last_progress_timestamp_seconds", base, r.last_progress_unix),
            ("ddpmon_hang_suspected", base, 1.0 if r.hang else 0.0),
            ("ddpmon_collectives_in_flight", base, float(r.in_flight_count())),
        ]
        if ident.get("bucket_timing") == "c10d":
            samples.append(("ddpmon_bucket_timing_unmatched_steps_total", base, float(r.unmatched_steps)))
        for op, (issued, completed) in sorted(r.collectives_by_op().items()):
            samples.append(("ddpmon_collectives_issued_total", {**base, "op": op}, float(issued)))
            samples.append(("ddpmon_collectives_completed_total", {**base, "op": op}, float(completed)))
        for phase, seconds in r.phase_totals().items():
            samples.append(("ddpmon_step_phase_seconds_total", {**base, "phase": phase}, seconds))
        for advice in list(r.advice):
            samples.append(("ddpmon_advice", {**base, "kind": advice.kind}, 1.0))
        for part in sorted(r.errors):
            samples.append(("ddpmon_internal_errors_total", {**base, "part": part}, 1.0))
        yield from families(samples)

        for key, h in r.histograms().items():
            yield _histogram(f"ddpmon_{key}_seconds", names, values, h)

        if self._bucket_metrics != "off":
            yield from self._bucket_families(base)

        extra: list[Sample] = []
        for source in self._sources:
            try:
                extra.extend(source())
            except Exception:  # a failing source must not break the scrape; it logs itself
                continue
        yield from families(extra)

    def _bucket_families(self, base: dict[str, str]) -> Iterator[Family]:
        stats = self._recorder.bucket_stats()
        if not stats:
            return
        label_names = list(base) + ["bucket"]
        mode = self._bucket_metrics
        if mode == "auto":
            mode = "per_bucket" if len(stats) <= AUTO_PER_BUCKET_LIMIT else "aggregate"
        if mode == "aggregate":
            total = Histogram(stats[0].seconds.bounds)
            for b in stats:
                total.counts = [x + y for x, y in zip(total.counts, b.seconds.counts)]
                total.sum += b.seconds.sum
                total.count += b.seconds.count
            labels = {**base, "bucket": "all"}
            yield _histogram("ddpmon_allreduce_seconds", label_names, list(labels.values()), total)
            yield from families(
                [("ddpmon_allreduce_bytes_total", labels, float(sum(b.bytes_total for b in stats)))]
            )
            return
        per_bucket = _histogram_family("ddpmon_allreduce_seconds", label_names)
        samples: list[Sample] = []
        for b in stats:
            labels = {**base, "bucket": str(b.index)}
            per_bucket.add_metric(list(labels.values()), b.seconds.cumulative(), b.seconds.sum)
            samples.append(("ddpmon_allreduce_bytes_total", labels, float(b.bytes_total)))
            samples.append(("ddpmon_bucket_size_bytes", labels, float(b.bytes)))
            samples.append(("ddpmon_bucket_parameters", labels, float(len(b.parameters))))
            if b.last_busbw is not None:
                samples.append(("ddpmon_allreduce_bus_bandwidth_bytes_per_second", labels, b.last_busbw))
            if b.last_ready_seconds is not None:
                samples.append(("ddpmon_bucket_ready_seconds", labels, b.last_ready_seconds))
        yield per_bucket
        yield from families(samples)


def _histogram_family(name: str, label_names: list[str]) -> HistogramMetricFamily:
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
