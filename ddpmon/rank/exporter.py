"""The rank's metrics: its Recorder (and the GPU and host samplers) as metric families,
read at scrape time. Names come from ``metrics/catalog.py``; ``metrics/exposition.py`` builds
them."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from .. import goodput, memory
from ..config import AUTO_PER_BUCKET_LIMIT, metrics_detail
from ..fuses import Fuse
from ..metrics.catalog import RANK_ACTIVITIES
from ..metrics.exposition import (
    Family,
    Sample,
    SampleSource,
    families,
    histogram,
    histogram_family,
    state_set,
    summary,
)
from ..state import schema
from ..version import __version__
from .books import BucketStats, Histogram
from .recorder import Recorder


class RankCollector:
    """Turns one rank's Recorder (and extra sample sources: GPU, host) into families, all of
    them or their summary (``metrics_detail``, resolved against the job's world size)."""

    def __init__(
        self,
        recorder: Recorder,
        bucket_metrics: str = "auto",
        sources: Iterable[SampleSource] = (),
        detail: str = "auto",
        state_dir: str | None = None,
    ) -> None:
        """``state_dir``: where rank 0 finds the job's earlier attempts, for its goodput."""
        self._recorder = recorder
        self._bucket_metrics = bucket_metrics
        self._sources = list(sources)
        self._detail = detail
        self._state_dir = state_dir
        self._earlier: list[goodput.Attempt] | None = None
        self._goodput_fuse = Fuse("goodput metrics")

    def _goodput(self, base: dict[str, str]) -> list[Sample]:
        """The job's goodput so far: its earlier attempts (read once, at the first scrape)
        and this one, live."""
        r = self._recorder
        if self._earlier is None:
            current = r.identity.attempt
            self._earlier = (
                [a for a in goodput.attempts_of([self._state_dir]) if a.number < current]
                if self._state_dir and current
                else []
            )
        now = time.time()
        hang = r.hang
        last = hang.last_progress_unix if hang is not None else now
        live = goodput.Attempt(
            r.identity.attempt or 0,
            r.identity.rank,
            r.identity.host,
            r.identity.process_started_unix or r.started_unix,
            r.first_step_unix,
            last if r.first_step_unix is not None else None,
            now,
            r.paused_seconds,
            (hang.detected_unix - hang.last_progress_unix, now - hang.detected_unix)
            if hang is not None
            else None,
        )
        g = goodput.goodput([*self._earlier, live])
        if g is None or g["ratio"] is None:
            return []
        out: list[Sample] = [
            ("ddpmon_goodput_ratio", base, g["ratio"]),
            ("ddpmon_goodput_productive_seconds", base, g["productive_seconds"]),
        ]
        out += [
            ("ddpmon_goodput_lost_seconds", {**base, "cause": cause}, seconds)
            for cause, seconds in g["lost_seconds"].items()
        ]
        return out

    def set_detail(self, mode: str) -> str | None:
        """``ddpmon set metrics_detail=...`` on a running rank: the next scrape serves the
        series of ``mode`` (a checked value of ``config.METRICS_DETAIL_MODES``); it always
        applies. One assignment, read once per scrape by the endpoint's thread."""
        self._detail = mode
        return None

    def collect(self) -> Iterator[Family]:
        if metrics_detail(self._detail, self._recorder.identity.world_size) == "summary":
            return summary(self._families(summarised=True))
        return self._families(summarised=False)

    def _families(self, summarised: bool) -> Iterator[Family]:
        r = self._recorder
        r.fold()  # the hooks' marks in: the last progress, the seconds paused
        ident = r.identity
        base = {"job": str(ident.job), "rank": str(ident.rank)}
        names, values = list(base), list(base.values())
        info = dict(base)
        info.update(
            world_size=str(ident.world_size),
            local_rank=str(ident.local_rank),
            host=str(ident.host),
            backend=str(ident.backend),
            torch_version=str(ident.torch_version),
            debug_level=str(ident.debug_level),
            version=__version__,
            bucket_timing=ident.bucket_timing or "",
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
        samples += _throughput(base, r.throughput())
        samples += _memory(base, r.memory, fastest_only=summarised)
        samples += _training(base, r)
        if ident.rank == 0 and self._goodput_fuse.ok:
            try:
                samples += self._goodput(base)
            except Exception as exc:
                self._goodput_fuse.blow(exc)
        if ident.attempt is not None:
            samples.append(("ddpmon_attempt", base, float(ident.attempt)))
        act = r.activity  # the watchdog's last sample (None with the watchdog off)
        if act is not None:
            samples += state_set("ddpmon_activity", base, "activity", RANK_ACTIVITIES, act.state)
        if ident.bucket_timing == "c10d":
            samples.append(
                ("ddpmon_bucket_timing_unmatched_steps_total", base, float(r.unmatched_steps))
            )
        for op, (issued, completed) in sorted(r.collectives_by_op().items()):
            samples.append(("ddpmon_collectives_issued_total", {**base, "op": op}, float(issued)))
            samples.append(
                ("ddpmon_collectives_completed_total", {**base, "op": op}, float(completed))
            )
        for phase, seconds in r.phase_totals().items():
            samples.append(("ddpmon_step_phase_seconds_total", {**base, "phase": phase}, seconds))
        for advice in list(r.advice):
            samples.append(("ddpmon_advice", {**base, "kind": advice.kind}, 1.0))
        for part in sorted(r.errors):
            samples.append(("ddpmon_internal_errors_total", {**base, "part": part}, 1.0))
        for what, failure in sorted(r.write_failures.items()):
            samples.append(
                ("ddpmon_state_write_failures_total", {**base, "file": what}, float(failure.total))
            )
        yield from families(samples)

        for key, h in r.histograms().items():
            yield histogram(f"ddpmon_{key}_seconds", names, values, h)

        if self._bucket_metrics != "off":
            yield from self._bucket_families(base, "aggregate" if summarised else None)

        extra: list[Sample] = []
        for source in self._sources:
            try:
                extra.extend(source())
            except Exception:  # a failing source must not break the scrape; it logs itself
                continue
        yield from families(extra)

    def _bucket_families(self, base: dict[str, str], mode: str | None) -> Iterator[Family]:
        """Per bucket, or folded into ``bucket="all"`` (``mode``, else ``bucket_metrics``)."""
        stats = self._recorder.bucket_stats()
        if not stats:
            return
        label_names = list(base) + ["bucket"]
        mode = mode or self._bucket_metrics
        if mode == "auto":
            mode = "per_bucket" if len(stats) <= AUTO_PER_BUCKET_LIMIT else "aggregate"
        if mode == "aggregate":
            total = Histogram(stats[0].seconds.bounds)
            for b in stats:
                total.counts = [x + y for x, y in zip(total.counts, b.seconds.counts)]
                total.sum += b.seconds.sum
                total.count += b.seconds.count
            labels = {**base, "bucket": "all"}
            yield histogram("ddpmon_allreduce_seconds", label_names, list(labels.values()), total)
            yield from families(_folded(labels, stats))
            return
        per_bucket = histogram_family("ddpmon_allreduce_seconds", label_names)
        samples: list[Sample] = []
        for b in stats:
            labels = {**base, "bucket": str(b.index)}
            per_bucket.add_metric(list(labels.values()), b.seconds.cumulative(), b.seconds.sum)
            samples.append(("ddpmon_allreduce_bytes_total", labels, float(b.bytes_total)))
            samples.append(("ddpmon_bucket_size_bytes", labels, float(b.bytes)))
            samples.append(("ddpmon_bucket_parameters", labels, float(len(b.parameters))))
            if b.last_busbw is not None:
                samples.append(
                    ("ddpmon_allreduce_bus_bandwidth_bytes_per_second", labels, b.last_busbw)
                )
            if b.last_ready_seconds is not None:
                samples.append(("ddpmon_bucket_ready_seconds", labels, b.last_ready_seconds))
        yield per_bucket
        yield from families(samples)


def _folded(labels: dict[str, str], stats: list[BucketStats]) -> list[Sample]:
    """Every bucket as one (``bucket="all"``): bytes, sizes and parameters summed; ready when
    the last bucket was; the bus bandwidth of the last all-reduces run back to back (the
    buckets' bytes over their summed times)."""
    out: list[Sample] = [
        ("ddpmon_allreduce_bytes_total", labels, float(sum(b.bytes_total for b in stats))),
        ("ddpmon_bucket_size_bytes", labels, float(sum(b.bytes for b in stats))),
        ("ddpmon_bucket_parameters", labels, float(sum(len(b.parameters) for b in stats))),
    ]
    ready = [b.last_ready_seconds for b in stats if b.last_ready_seconds is not None]
    if ready:
        out.append(("ddpmon_bucket_ready_seconds", labels, max(ready)))
    # busbw = bytes / seconds x factor, so seconds / factor = bytes / busbw
    timed = [(b.bytes, b.last_busbw) for b in stats if b.last_busbw and b.bytes]
    if timed:
        busbw = sum(n for n, _ in timed) / sum(n / bw for n, bw in timed)
        out.append(("ddpmon_allreduce_bus_bandwidth_bytes_per_second", labels, busbw))
    return out


def _training(base: dict[str, str], r: Recorder) -> list[Sample]:
    """The seconds paused between steps, the global batch and the learning rate."""
    out: list[Sample] = [("ddpmon_paused_seconds_total", base, r.paused_seconds)]
    if r.data_info.global_batch_size is not None:
        out.append(("ddpmon_global_batch_size", base, float(r.data_info.global_batch_size)))
    opt = r.optimizer
    if opt is not None and opt.learning_rate is not None:
        out.append(("ddpmon_learning_rate", base, opt.learning_rate))
    return out


def _throughput(base: dict[str, str], t: schema.Throughput) -> list[Sample]:
    """Samples and tokens counted, and the FLOP figures where they are known."""
    out: list[Sample] = [("ddpmon_samples_total", base, float(t.samples_total))]
    if t.tokens_total:
        out.append(("ddpmon_tokens_total", base, float(t.tokens_total)))
    count = t.flop_count
    if count is not None:
        out.append(("ddpmon_model_flops_per_step", base, float(count.per_step)))
        if count.peak_flops_per_second:
            out.append(("ddpmon_device_peak_flops_per_second", base, count.peak_flops_per_second))
    if t.achieved_flops_per_second is not None:
        out.append(("ddpmon_achieved_flops_per_second", base, t.achieved_flops_per_second))
    if t.mfu is not None:
        out.append(("ddpmon_mfu_ratio", base, t.mfu))
    return out


def _memory(base: dict[str, str], m: schema.Memory, fastest_only: bool) -> list[Sample]:
    """Each memory trend's slope (the fastest-growing worker's for the workers), and the
    time left while one creeps. ``fastest_only`` (summary detail) folds the slopes into the
    fastest-growing one, ``process="all", kind="all"`` as buckets fold into ``bucket="all"``:
    one series per rank whatever runs on it, and the same series from scrape to scrape."""
    fastest: dict[tuple[str, str], float] = {}
    left: list[float] = []
    for t in m.trends:
        if t.bytes_per_second is None:
            continue
        key = (t.process, t.kind)
        fastest[key] = max(fastest.get(key, t.bytes_per_second), t.bytes_per_second)
        seconds = memory.seconds_left(t)
        if seconds is not None and memory.creeping(t):
            left.append(seconds)
    out: list[Sample] = [
        ("ddpmon_memory_growth_bytes_per_second", {**base, "process": p, "kind": k}, v)
        for (p, k), v in sorted(fastest.items())
    ]
    if fastest_only and fastest:
        top = max(fastest.values())
        out = [
            (
                "ddpmon_memory_growth_bytes_per_second",
                {**base, "process": "all", "kind": "all"},
                top,
            )
        ]
    if left:
        out.append(("ddpmon_memory_creep_seconds_left", base, min(left)))
    return out
