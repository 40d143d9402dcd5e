"""Scrape cost against the number of buckets, and series counts per bucket_metrics mode;
then the same scrapes over HTTP, through the rank's endpoint, as a client and as Prometheus
asks (its Accept header, gzip, the connection kept alive).

    python benchmarks/scrape.py            # 1, 100, 1000 buckets; prints ms per scrape and series
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import time

from prometheus_client import CollectorRegistry, generate_latest

from ddpmon.httpd import serve
from ddpmon.rank.exporter import RankCollector
from ddpmon.rank.recorder import BucketTiming, Recorder
from ddpmon.state.schema import Identity

IDENTITY = dict(
    rank=0,
    local_rank=0,
    world_size=1024,
    host="node0",
    pid=1,
    job="bench",
    backend="nccl",
    torch_version="2.13.0",
    debug_level="OFF",
)


def recorder(buckets: int, steps: int = 20) -> Recorder:
    rec = Recorder(Identity(**IDENTITY), world_size=1024)
    for i in range(buckets):
        rec.set_bucket_layout(i, 25 * 2**20, "bfloat16", [f"layers.{i}.weight", f"layers.{i}.bias"])
    for s in range(steps):
        rec.forward_started(s * 1.0)
        rec.forward_finished(s * 1.0 + 0.1)
        rec.backward_done(s * 1.0 + 0.5)
        rec.close_step(s * 1.0 + 0.9)
        rec.add_bucket_timings(
            [BucketTiming(i, 0.2 + i * 1e-4, i * 1e-3, i * 1e-3 + 0.004) for i in range(buckets)]
        )
    return rec


def measure(buckets: int, mode: str, repeats: int) -> tuple[float, int, int]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankCollector(recorder(buckets), mode, detail="full"))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        body = generate_latest(registry)
        times.append(time.perf_counter() - start)
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return statistics.median(times), series, len(body)


PROMETHEUS = {  # what Prometheus sends with every scrape
    "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "Accept-Encoding": "gzip",
}


def measure_http(buckets: int, repeats: int) -> tuple[float, float, int]:
    """Median ms of GET /metrics: a new connection per scrape (plain text), and as
    Prometheus scrapes (one connection reused when the server keeps it, gzip); its bytes."""
    endpoint = serve(RankCollector(recorder(buckets), "auto", detail="full"), 0, "127.0.0.1")
    try:
        fresh, kept, size = [], [], 0
        reused = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=10)
        for _ in range(repeats):
            start = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=10)
            conn.request("GET", "/metrics")
            conn.getresponse().read()
            conn.close()
            fresh.append(time.perf_counter() - start)
            start = time.perf_counter()
            reused.request("GET", "/metrics", headers=PROMETHEUS)
            size = len(reused.getresponse().read())  # (reconnects by itself after a close)
            kept.append(time.perf_counter() - start)
        reused.close()
        return statistics.median(fresh), statistics.median(kept), size
    finally:
        endpoint.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--buckets", type=int, nargs="*", default=[1, 100, 1000])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    print(
        f"{'buckets':>8} {'mode':<11} {'scrape ms':>10} {'series/rank':>12} {'bytes':>9} {'series, 1024 ranks':>19}"
    )
    for n in args.buckets:
        for mode in ("auto", "per_bucket", "aggregate", "off"):
            seconds, series, size = measure(n, mode, args.repeats)
            print(
                f"{n:>8} {mode:<11} {seconds * 1000:>10.2f} {series:>12} {size:>9} {series * 1024:>19,}"
            )
    print(
        f"\n{'buckets':>8} {'HTTP ms, new connection':>24} {'HTTP ms, as Prometheus':>23} {'gzip bytes':>11}"
    )
    for n in args.buckets:
        fresh, kept, size = measure_http(n, args.repeats)
        print(f"{n:>8} {fresh * 1000:>24.2f} {kept * 1000:>23.2f} {size:>11}")


if __name__ == "__main__":
    main()
