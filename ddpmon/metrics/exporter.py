"""The Prometheus side: a private registry, collectors read at scrape time, an HTTP endpoint.

Everything else in ddpmon produces plain ``Sample`` tuples ``(name, labels, value)`` named
from the catalog; this module alone turns them into metric families (the only importer of
prometheus_client), so a scrape costs nothing until Prometheus asks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
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


def serve(collector: Any, port: int, bind: str = "0.0.0.0", routes: dict[str, Route] | None = None) -> Endpoint:
    """Serve ``collector`` from a private registry on ``bind:port`` (0 = ephemeral).
    ``routes`` adds read-only paths beside the metrics: path -> () -> (content type, body);
    a route that raises LookupError answers 404 with its message.
    Raises OSError when the port cannot be bound."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, thread = start_http_server(port, addr=bind, registry=registry)
    if routes:
        server.set_app(_with_routes(server.get_app(), dict(routes)))
    return Endpoint(server.server_address[1], bind, server, thread)


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
        except LookupError as exc:  # a path this server knows but does not serve now
            message = (str(exc.args[0] if exc.args else exc) + "\n").encode()
            start_response("404 Not Found", [("Content-Type", "text/plain"), ("Content-Length", str(len(message)))])
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
