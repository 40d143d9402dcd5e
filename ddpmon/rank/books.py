"""What readers build from a rank's events (step times, buckets, collectives), and the
records those events carry.

The recorder (ddpmon/rank/recorder.py) appends events from the hooks; a reader holding the fold
lock hands each event to one of these books. They are plain single-threaded objects: only
the fold lock's holder touches them.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import steps
from ..state import schema
from ..steps import StepRow

STEP_BOUNDS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
COMM_BOUNDS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
RECENT_STEPS = 256
HISTORY_STEPS = 1024  # per-step rows kept for the history writer (rank/writers.py)
HISTORY_BUCKETS = 256  # buckets per step kept in those rows
MAX_PARAMETER_NAMES = 200
MAX_IN_FLIGHT = 256
COLLECTIVE_LOG = 32
MAX_CALL_SITES = 64
BUCKET_OP = "all_reduce"  # torch's name, as for the collectives user code issues


@dataclass(frozen=True)
class BucketTiming:
    """One bucket's collective in one step. ``start``/``end`` share a timeline within the
    step (wall clock on CPU, CUDA events on GPU); ``ready`` is the CPU moment the bucket
    became ready, seconds after the step began."""

    index: int
    ready: float
    start: float
    end: float


class StepTimings(NamedTuple):
    """One step's buckets as a clock resolved them. ``exposed`` measured by the clock when
    ``measured`` (None: the host's wait stands), else derived from the buckets; ``step`` is
    the step count they belong to (None: the step that ended last)."""

    buckets: list[BucketTiming]
    exposed: float | None = None
    measured: bool = False
    step: int | None = None


class StepRecord(NamedTuple):
    """One finished step, as the training thread closed it: its parts (see ``close_step``)."""

    step: int
    start_unix: float
    step_seconds: float
    forward_seconds: float
    backward_seconds: float | None
    data_wait_seconds: float = 0.0
    comm_wait_seconds: float | None = None
    optimizer_seconds: float = 0.0
    micro_steps: int = 0
    gpu_parts_later: bool = False
    """The GPU's own parts of this step will follow (``add_gpu_parts``)."""
    samples: int = 0
    tokens: int = 0
    gaps: tuple[float, ...] | None = None
    """Seconds of each gap between hooks (``steps.GAPS``)."""


class Histogram:
    """A cumulative histogram with fixed bounds: O(1) per observation, no allocation."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def copy(self) -> Histogram:
        c = Histogram(self.bounds)
        c.counts, c.sum, c.count = list(self.counts), self.sum, self.count
        return c

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs ending with +Inf, as Prometheus exposes them."""
        out, running = [], 0
        for bound, count in zip(self.bounds + (float("inf"),), self.counts):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


@dataclass
class BucketStats:
    """What is known about one DDP gradient bucket (its layout and its collectives)."""

    index: int
    bytes: int = 0
    dtype: str = ""
    parameters: tuple[str, ...] = ()
    seconds: Histogram = field(default_factory=lambda: Histogram(COMM_BOUNDS))
    bytes_total: int = 0
    last_seconds: float | None = None
    last_ready_seconds: float | None = None
    last_busbw: float | None = None

    def copy(self) -> BucketStats:
        return BucketStats(
            self.index,
            self.bytes,
            self.dtype,
            self.parameters,
            self.seconds.copy(),
            self.bytes_total,
            self.last_seconds,
            self.last_ready_seconds,
            self.last_busbw,
        )

    def record(self) -> schema.Bucket:
        count = self.seconds.count
        return schema.Bucket(
            index=self.index,
            bytes=self.bytes,
            dtype=self.dtype,
            num_parameters=len(self.parameters),
            parameters=list(self.parameters[:MAX_PARAMETER_NAMES]),
            count=count,
            last_seconds=self.last_seconds,
            mean_seconds=self.seconds.sum / count if count else None,
            ready_seconds=self.last_ready_seconds,
            busbw_bytes_per_second=self.last_busbw,
            bytes_total=self.bytes_total,
        )


class StepBook:
    """Step times: histograms, per-phase totals, the recent window (medians), per-step
    history rows (``recent`` holds the same rows as ``history``)."""

    def __init__(self) -> None:
        self.host_wait_exposed = False
        """The host's wait for the gradients is the exposed communication (on CPU), counted
        as measured: no clock sends a figure of its own."""
        self.hist = {
            name: Histogram(STEP_BOUNDS)
            for name in (
                "step",
                "data_wait",
                "forward",
                "backward",
                "exposed_comm",
                "optimizer",
                "other",
            )
        }
        self.phase_totals = dict.fromkeys(steps.PARTS, 0.0)
        self.recent: collections.deque[StepRow] = collections.deque(maxlen=RECENT_STEPS)
        self.history: collections.deque[StepRow] = collections.deque(maxlen=HISTORY_STEPS)
        self.samples_total = 0
        self.tokens_total = 0

    def add(self, record: StepRecord) -> None:
        row = StepRow(
            step=record.step,
            start_unix=record.start_unix,
            end_unix=record.start_unix + record.step_seconds,
            step_seconds=record.step_seconds,
            data_wait_seconds=record.data_wait_seconds,
            forward_seconds=record.forward_seconds,
            backward_seconds=record.backward_seconds,
            exposed_comm_seconds=record.comm_wait_seconds,
            optimizer_seconds=record.optimizer_seconds,
            micro_steps=record.micro_steps,
            gpu_pending=record.gpu_parts_later,
            samples=record.samples,
            tokens=record.tokens,
            gaps=record.gaps,
            exposed_timed=self.host_wait_exposed and record.comm_wait_seconds is not None,
        )
        self.samples_total += record.samples
        self.tokens_total += record.tokens
        steps.balance(row)
        self.recent.append(row)
        self.history.append(row)
        if not row.gpu_pending:  # else counted once its GPU parts come (``gpu_parts``)
            self._count(row)

    def _count(self, row: StepRow) -> None:
        """Add a settled step to the histograms and the per-part totals (counters: a step is
        counted once, when its parts are final)."""
        h = self.hist
        h["step"].observe(row.step_seconds)
        for part in ("data_wait", "forward", "optimizer", "other"):
            h[part].observe(row.part(part) or 0.0)
        if row.backward_seconds is not None:
            h["backward"].observe(row.backward_seconds)
        if row.exposed_timed or row.gpu_exposed:
            h["exposed_comm"].observe(row.exposed_comm_seconds or 0.0)
        for phase in steps.PARTS:
            self.phase_totals[phase] += row.part(phase) or 0.0

    def gpu_parts(self, step: int, parts: dict[str, float] | None) -> None:
        """Step ``step``'s parts as the GPU ran them (``gpu_steps.py``), with its span as the
        step's time; None: the host's parts stand. Either way the step is counted now."""
        for row in reversed(self.history):
            if row.step == step:
                if not row.gpu_pending:
                    return
                row.gpu_pending = False
                if parts is not None:
                    row.step_seconds = parts["step"]
                    row.end_unix = row.start_unix + parts["step"]
                    for part in ("data_wait", "forward", "optimizer"):
                        row.set_part(part, parts[part])
                    if row.backward_seconds is not None:
                        row.backward_seconds = parts["backward"]
                    if parts["exposed_measured"] or not row.exposed_timed:
                        row.exposed_comm_seconds = parts["exposed_comm"]
                    row.gpu_parts = True
                    row.gpu_exposed = bool(parts["exposed_measured"])
                    steps.balance(row)
                self._count(row)
                return

    def buckets(self, step: int | None, timings: list[tuple[int, float, int | None]]) -> None:
        """Step ``step``'s bucket times for its history row: (index, seconds, bytes)."""
        for row in reversed(self.history):
            if row.step == step:
                if row.buckets is None:
                    row.buckets = timings[:HISTORY_BUCKETS]
                break

    def exposed(self, step: int | None, seconds: float) -> None:
        """Exposed communication of step ``step`` as a bucket clock measured or derived it
        (it may come late): it replaces the host's wait in the step's parts, and ``other``
        takes up the difference so that the parts still sum to the step."""
        for row in reversed(self.history):
            if row.step == step:
                if row.gpu_exposed:
                    return  # the GPU's own measure of this step stands
                before = (row.exposed_comm_seconds or 0.0, row.other_seconds or 0.0)
                row.exposed_comm_seconds = seconds
                row.exposed_timed = True
                steps.balance(row)
                if row.gpu_pending:
                    return  # counted when it settles
                self.hist["exposed_comm"].observe(seconds)
                self.phase_totals["exposed_comm"] += seconds - before[0]
                self.phase_totals["other"] += (row.other_seconds or 0.0) - before[1]
                return
        self.hist["exposed_comm"].observe(seconds)  # (a step no longer in the history)


class BucketBook:
    """DDP's buckets: layout, per-bucket all-reduce times and bandwidth."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.buckets: dict[int, BucketStats] = {}

    def layout(self, index: int, nbytes: int, dtype: str, names: tuple[str, ...]) -> None:
        stats = self.buckets.get(index)
        if stats is None or stats.bytes != nbytes:
            # A new bucket, or DDP rebuilt its buckets after iteration 0: a new series.
            stats = self.buckets[index] = BucketStats(index)
        stats.bytes, stats.dtype, stats.parameters = nbytes, dtype, names

    def drop_from(self, count: int) -> None:
        for index in [i for i in self.buckets if i >= count]:
            del self.buckets[index]

    def summary(self, step: StepTimings) -> list[tuple[int, float, int | None]]:
        """(index, seconds, bytes) of each bucket of one step, for its history row."""
        return [
            (
                t.index,
                max(0.0, t.end - t.start),
                self.buckets[t.index].bytes if t.index in self.buckets else None,
            )
            for t in sorted(step.buckets, key=lambda t: t.start)
        ]

    def timings(self, step: StepTimings) -> float | None:
        """Fold one step's bucket collectives in; returns its exposed communication.

        A bucket's time runs from its launch (the bucket became ready) to its completion, so
        it includes any wait behind earlier buckets on the same communicator. Exposed
        communication runs from the last bucket becoming ready (backward compute done) to
        the last collective done, unless the clock measured it itself. Timings of a bucket
        not in the current layout (DDP rebuilt its buckets since) are dropped."""
        ordered = sorted(step.buckets, key=lambda t: t.start)
        exposed = step.exposed
        if ordered and not step.measured:
            exposed = max(0.0, max(t.end for t in ordered) - ordered[-1].start)
        factor = 2.0 * (self.world_size - 1) / self.world_size
        for t in ordered:
            stats = self.buckets.get(t.index)
            if stats is None:
                continue
            seconds = max(0.0, t.end - t.start)
            stats.seconds.observe(seconds)
            stats.bytes_total += stats.bytes
            stats.last_seconds = seconds
            stats.last_ready_seconds = t.ready
            stats.last_busbw = stats.bytes / seconds * factor if seconds > 0 else None
        return exposed

    def sorted(self) -> list[BucketStats]:
        return sorted(self.buckets.values(), key=lambda b: b.index)


class CollectiveBook:
    """Collectives: in flight, the last ones done, counts per op, sequence numbers per
    group, call sites."""

    def __init__(self) -> None:
        self.in_flight: list[dict[str, Any]] = []
        self.last: dict[str, Any] | None = None
        self.log: collections.deque[dict[str, Any]] = collections.deque(maxlen=COLLECTIVE_LOG)
        self.ops: dict[str, list[int]] = {}
        self.issued = self.completed = 0
        self.last_seq: dict[str, int] = {}
        self.sites: dict[str, int] = {}

    def began(self, entry: dict[str, Any], counted: bool, buckets: BucketBook) -> None:
        op = entry["op"]
        if counted:
            self.issued += 1
            self.ops.setdefault(op, [0, 0])[0] += 1
        # numbered here, in the order they were issued (the log's): the fold is their one
        # writer, so each group's numbers never repeat and match the peers' one for one
        key = "p2p:" + entry["group"] if entry.get("p2p") else entry["group"]
        entry["seq"] = self.last_seq[key] = self.last_seq.get(key, 0) + 1
        bucket = entry.get("bucket")
        if entry.get("bytes") is None and bucket is not None and bucket in buckets.buckets:
            entry["bytes"] = buckets.buckets[bucket].bytes  # (only readers hold bucket entries)
        in_flight = self.in_flight
        step = entry.get("step")
        if (
            step is not None
            and in_flight
            and in_flight[0].get("step") is not None
            and in_flight[0]["step"] < step
        ):
            # by the next step DDP has waited for every bucket: drop any left behind
            in_flight[:] = [e for e in in_flight if e.get("step") is None or e["step"] >= step]
        in_flight.append(entry)
        if len(in_flight) > MAX_IN_FLIGHT:
            del in_flight[0]
        site = schema.site_key(
            entry.get("op"), entry.get("call_site"), entry.get("callers"), entry.get("bucket")
        )
        if site in self.sites or len(self.sites) < MAX_CALL_SITES:
            self.sites[site] = self.sites.get(site, 0) + 1

    def ended(self, entry: dict[str, Any], error: str | None, counted: bool, now: float) -> None:
        for i, e in enumerate(self.in_flight):
            if e is entry:
                del self.in_flight[i]
                break
        done = dict(entry, completed_unix=now, seconds=now - entry["issued_unix"])
        if error is not None:
            done["error"] = error
        self.last = done
        self.log.append(done)
        if counted:
            self.completed += 1
            self.ops.setdefault(entry["op"], [0, 0])[1] += 1

    def bucket_done(self, now: float) -> None:
        """The oldest bucket collective in flight is done: DDP's buckets complete in order."""
        self.completed += 1
        self.ops.setdefault(BUCKET_OP, [0, 0])[1] += 1
        for i, e in enumerate(self.in_flight):
            if "bucket" in e:
                entry = self.in_flight.pop(i)
                break
        else:
            return
        done = dict(entry, completed_unix=now, seconds=now - entry["issued_unix"])
        self.last = done
        self.log.append(done)
