"""The in-memory record of one rank: what the hooks saw, kept bounded and thread-safe.

Hooks write plain numbers here and return; the exporter, the state writer and the watchdog
read from their own threads through ``snapshot()`` and the histogram accessors. Nothing here
imports torch, so readers stay cheap and the doctor can reuse the layout of ``snapshot()``.
"""

from __future__ import annotations

import bisect
import collections
import statistics
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

STEP_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
COMM_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
RECENT_STEPS = 256
HISTORY_STEPS = 1024  # per-step records kept for the history writer (history_since)
HISTORY_BUCKETS = 256  # buckets per step kept for it
MAX_PARAMETER_NAMES = 200
MAX_IN_FLIGHT = 256
COLLECTIVE_LOG = 16
MAX_CALL_SITES = 64
BUCKET_OP = "all_reduce"  # torch's name, as for the collectives user code issues
BUCKET_SITE = "all_reduce DDP backward (DDP bucket)"  # site_key_of() of every bucket entry


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

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "bytes": self.bytes,
            "dtype": self.dtype,
            "num_parameters": len(self.parameters),
            "parameters": list(self.parameters[:MAX_PARAMETER_NAMES]),
            "count": self.seconds.count,
            "last_seconds": self.last_seconds,
            "mean_seconds": self.seconds.sum / self.seconds.count if self.seconds.count else None,
            "ready_seconds": self.last_ready_seconds,
            "busbw_bytes_per_second": self.last_busbw,
            "bytes_total": self.bytes_total,
        }


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
    ``measured`` (None: unknown), else derived from the buckets; ``step`` is the step count
    they belong to (None: the step that ended last)."""

    buckets: list[BucketTiming]
    exposed: float | None = None
    measured: bool = False
    step: int | None = None


@dataclass
class _Step:
    """Scratch for the step in progress; written by hooks, folded in by close_step()."""

    start: float
    forward_seconds: float = 0.0
    forward_start: float | None = None
    backward_start: float | None = None
    last_grad_ready: float | None = None
    buckets_launched: int = 0
    synced: bool = False


class Recorder:
    """Thread-safe state of one rank. Times from ``time.perf_counter()`` unless named *_unix."""

    def __init__(self, identity: dict[str, Any], world_size: int) -> None:
        self.identity = dict(identity)
        self.world_size = max(1, int(world_size))
        self._lock = threading.Lock()
        self.steps = 0
        # init, forward, after_forward, backward, allreduce, after_backward or detached
        self.phase = "init"
        self.started_unix = time.time()
        self.last_progress_unix = self.started_unix
        self.step_hist = Histogram(STEP_BOUNDS)
        self.forward_hist = Histogram(STEP_BOUNDS)
        self.backward_hist = Histogram(STEP_BOUNDS)
        self.exposed_hist = Histogram(STEP_BOUNDS)
        self.recent: collections.deque[tuple[float, float, float, float | None]] = collections.deque(
            maxlen=RECENT_STEPS
        )
        self.buckets: dict[int, BucketStats] = {}
        self.unused_parameters: list[str] = []
        self.steps_without_unused = 0
        self.notes: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.issued = 0
        self.completed = 0
        self._ops: dict[str, list[int]] = {}
        self.in_flight: list[dict[str, Any]] = []
        self.last_collective: dict[str, Any] | None = None
        self.hang: dict[str, Any] | None = None
        self.exit: dict[str, Any] | None = None
        self.collective_seq: dict[str, int] = {}
        self.ddp_group: tuple[str, int] = ("0", self.world_size)  # DDP's process group (name, size)
        self.collective_sites: dict[str, int] = {}
        self.collective_log: collections.deque[dict[str, Any]] = collections.deque(maxlen=COLLECTIVE_LOG)
        self.unmatched_steps = 0  # steps the c10d bucket clock could not match to buckets
        self._cur = _Step(start=time.perf_counter())
        # -- per-step history for ddpmon/state/history.py (history_since) --
        self._history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY_STEPS)

    # -- written by the hooks (the training thread, autograd and comm threads) -------------

    def heartbeat(self) -> None:
        self.last_progress_unix = time.time()

    @property
    def step_start(self) -> float:
        return self._cur.start

    def forward_started(self, now: float) -> None:
        if self.steps == 0 and self._cur.forward_seconds == 0.0 and self._cur.forward_start is None:
            self._cur.start = now  # the first step starts at the first forward, not at attach
        self._cur.forward_start = now
        self.phase = "forward"
        self.last_progress_unix = time.time()

    def forward_finished(self, now: float) -> None:
        cur = self._cur
        if cur.forward_start is not None:
            cur.forward_seconds += now - cur.forward_start
            cur.forward_start = None
        self.phase = "after_forward"

    def backward_started(self, now: float) -> None:
        if self._cur.backward_start is None:
            self._cur.backward_start = now
        self.phase = "backward"
        self.last_progress_unix = time.time()

    def grad_ready(self, now: float) -> None:
        cur = self._cur
        if cur.backward_start is None:
            cur.backward_start = now
            self.phase = "backward"
        cur.last_grad_ready = now

    def bucket_launched(self, is_last: bool, index: int | None = None, nbytes: int | None = None) -> None:
        """DDP launched a bucket's collective: counted, and in flight until it completes
        (whatever the comm hook calls inside is attributed to the bucket). ``nbytes``
        when the bucket has no timings to hold its size."""
        self._cur.buckets_launched += 1
        if is_last:
            self.phase = "allreduce"
        if index is None:
            index = self._cur.buckets_launched - 1
        now = time.time()
        group, group_size = self.ddp_group
        with self._lock:
            self.issued += 1
            self._ops.setdefault(BUCKET_OP, [0, 0])[0] += 1
            seq = self.collective_seq.get(group, 0) + 1
            self.collective_seq[group] = seq
            stats = self.buckets.get(index)
            entry = {
                "seq": seq, "op": BUCKET_OP, "group": group, "group_size": group_size,
                "bytes": stats.bytes if stats else nbytes, "call_site": "DDP backward",
                "function": "backward", "issued_unix": now, "bucket": index, "step": self.steps,
            }
            in_flight = self.in_flight
            if in_flight and in_flight[0].get("step", self.steps) < self.steps:
                # by the next step DDP has waited for every bucket: drop any left behind
                in_flight[:] = [e for e in in_flight if e.get("step", self.steps) >= self.steps]
            in_flight.append(entry)
            if len(in_flight) > MAX_IN_FLIGHT:
                del in_flight[0]
            sites = self.collective_sites
            if BUCKET_SITE in sites or len(sites) < MAX_CALL_SITES:
                sites[BUCKET_SITE] = sites.get(BUCKET_SITE, 0) + 1
        self.last_progress_unix = now

    def gradients_synced(self) -> None:
        """DDP has waited for every bucket of this step (on a GPU: the stream waits)."""
        self._cur.synced = True
        self.phase = "after_backward"

    def bucket_completed(self, is_last: bool) -> None:
        if is_last:
            self.phase = "after_backward"
        self.collective_completed(BUCKET_OP)
        self._bucket_collective_done()

    @property
    def launched_bucket(self) -> int:
        """Index of the bucket launched last in this step (DDP launches them in order)."""
        return max(0, self._cur.buckets_launched - 1)

    @property
    def backward_seen(self) -> bool:
        """True once a backward started in the step in progress."""
        return self._cur.backward_start is not None

    @property
    def step_has_synced(self) -> bool:
        """True once the step in progress has launched its gradient all-reduce."""
        return self._cur.buckets_launched > 0 or self._cur.synced

    # -- step boundary (the training thread) -------------------------------------------------

    def close_step(self, now: float) -> None:
        """End the step in progress at ``now`` and start the next one."""
        cur = self._cur
        step_seconds = now - cur.start
        backward = None
        if cur.backward_start is not None and cur.last_grad_ready is not None:
            backward = max(0.0, cur.last_grad_ready - cur.backward_start)
        with self._lock:
            self.steps += 1
            self.step_hist.observe(step_seconds)
            self.forward_hist.observe(cur.forward_seconds)
            if backward is not None:
                self.backward_hist.observe(backward)
            self.recent.append((step_seconds, cur.forward_seconds, backward or 0.0, None))
            self._cur = _Step(start=now)
            # -- history: one record per step; exposed and buckets come with the timings --
            end_unix = time.time() - (time.perf_counter() - now)
            self._history.append({
                "step": self.steps, "start_unix": end_unix - step_seconds, "end_unix": end_unix,
                "step_seconds": step_seconds, "forward_seconds": cur.forward_seconds,
                "backward_seconds": backward, "exposed_comm_seconds": None,
            })
        self.last_progress_unix = time.time()

    def set_bucket_layout(self, index: int, nbytes: int, dtype: str, names: Iterable[str]) -> None:
        with self._lock:
            stats = self.buckets.get(index)
            if stats is None or stats.bytes != nbytes:
                # A new bucket, or DDP rebuilt its buckets after iteration 0: a new series.
                stats = self.buckets[index] = BucketStats(index)
            stats.bytes, stats.dtype, stats.parameters = nbytes, dtype, tuple(names)

    def drop_buckets_from(self, count: int) -> None:
        """Forget buckets with index >= count (after DDP rebuilt its buckets)."""
        with self._lock:
            for index in [i for i in self.buckets if i >= count]:
                del self.buckets[index]

    def add_bucket_timings(self, timings: Sequence[BucketTiming]) -> None:
        """Fold one step's bucket collectives in (the step that ended last)."""
        self.add_step_timings(StepTimings(list(timings)))

    def add_step_timings(self, step: StepTimings) -> None:
        """Fold one step's bucket collectives in: per-bucket time, bandwidth, exposed comm.

        A bucket's time runs from its launch (the bucket became ready) to its completion, so
        it includes any wait behind earlier buckets on the same communicator. Exposed
        communication runs from the last bucket becoming ready (backward compute done) to
        the last collective done, unless the clock measured it itself. Timings of a bucket
        not in the current layout (DDP rebuilt its buckets since) are dropped.
        """
        timings, exposed = step.buckets, step.exposed
        if not timings and exposed is None:
            return
        ordered = sorted(timings, key=lambda t: t.start)
        if ordered and not step.measured:
            exposed = max(0.0, max(t.end for t in ordered) - ordered[-1].start)
        factor = 2.0 * (self.world_size - 1) / self.world_size
        with self._lock:
            for t in ordered:
                seconds = max(0.0, t.end - t.start)
                stats = self.buckets.get(t.index)
                if stats is None:
                    continue
                stats.seconds.observe(seconds)
                stats.bytes_total += stats.bytes
                stats.last_seconds = seconds
                stats.last_ready_seconds = t.ready
                stats.last_busbw = stats.bytes / seconds * factor if seconds > 0 else None
            back = 1 if step.step is None else self.steps - step.step + 1  # recent[-back] is that step
            # -- history: this step's exposed communication and buckets --
            if 1 <= back <= len(self._history):
                record = self._history[-back]
                if ordered and "buckets" not in record:  # compact here; dicts in history_since
                    record["buckets"] = [
                        (t.index, max(0.0, t.end - t.start),
                         self.buckets[t.index].bytes if t.index in self.buckets else None)
                        for t in ordered[:HISTORY_BUCKETS]
                    ]
                if exposed is not None and record["exposed_comm_seconds"] is None:
                    record["exposed_comm_seconds"] = exposed
            if exposed is None:
                return
            self.exposed_hist.observe(exposed)
            if 1 <= back <= len(self.recent) and self.recent[-back][3] is None:
                s, f, b, _ = self.recent[-back]
                self.recent[-back] = (s, f, b, exposed)

    def set_unused_parameters(self, names: list[str]) -> bool:
        """Record this step's unused parameters; True when the set changed."""
        with self._lock:
            changed = names != self.unused_parameters
            self.unused_parameters = names
            self.steps_without_unused = 0 if names else self.steps_without_unused + 1
            return changed

    # -- notes, errors and collectives ------------------------------------------------------

    def note(self, key: str, text: str | None) -> None:
        with self._lock:
            if text is None:
                self.notes.pop(key, None)
            else:
                self.notes[key] = text

    def record_error(self, part: str, message: str) -> None:
        with self._lock:
            self.errors[part] = message

    def collective_completed(self, op: str) -> None:
        with self._lock:
            self.completed += 1
            self._ops.setdefault(op, [0, 0])[1] += 1
        self.last_progress_unix = time.time()

    def collective_began(
        self, op: str, group: str, group_size: int, nbytes: int | None, site: str,
        function: str, *, bucket: int | None = None, p2p: bool = False, counted: bool = True,
        callers: Sequence[str] = (),
    ) -> dict[str, Any]:
        """A collective this rank issued: give it the next sequence number of its process
        group and keep it in flight until ``collective_ended``. ``counted=False`` for a
        bucket's collective, already counted by ``bucket_launched``; ``callers`` are the
        user frames that led to ``site``."""
        now = time.time()
        key = "p2p:" + group if p2p else group
        with self._lock:
            seq = self.collective_seq.get(key, 0) + 1
            self.collective_seq[key] = seq
            entry: dict[str, Any] = {
                "seq": seq, "op": op, "group": group, "group_size": group_size, "bytes": nbytes,
                "call_site": site, "function": function, "issued_unix": now,
            }
            if callers:
                entry["callers"] = list(callers)
            if bucket is not None:
                entry["bucket"] = bucket
            if p2p:
                entry["p2p"] = True
            if counted:
                self.issued += 1
                self._ops.setdefault(op, [0, 0])[0] += 1
            self.in_flight.append(entry)
            if len(self.in_flight) > MAX_IN_FLIGHT:
                del self.in_flight[0]
            site_key = site_key_of(entry)
            if site_key in self.collective_sites or len(self.collective_sites) < MAX_CALL_SITES:
                self.collective_sites[site_key] = self.collective_sites.get(site_key, 0) + 1
        self.last_progress_unix = now
        return entry

    def collective_ended(self, entry: dict[str, Any], error: str | None = None, counted: bool = True) -> None:
        """The collective of ``entry`` (from ``collective_began``) completed or failed."""
        now = time.time()
        with self._lock:
            for i, e in enumerate(self.in_flight):
                if e is entry:
                    del self.in_flight[i]
                    break
            done = dict(entry, completed_unix=now, seconds=now - entry["issued_unix"])
            if error is not None:
                done["error"] = error
            self.last_collective = done
            self.collective_log.append(done)
            if counted:
                self.completed += 1
                self._ops.setdefault(entry["op"], [0, 0])[1] += 1
        self.last_progress_unix = now

    def _bucket_collective_done(self) -> None:
        """The oldest bucket collective in flight is done: DDP's buckets complete in order,
        and the comm hook's completion callback says so without a callback of its own."""
        with self._lock:
            for i, e in enumerate(self.in_flight):
                if "bucket" in e:
                    entry = self.in_flight.pop(i)
                    break
            else:
                return
            now = time.time()
            entry["completed_unix"] = now  # out of in_flight now: nobody else changes it
            entry["seconds"] = now - entry["issued_unix"]
            self.last_collective = entry
            self.collective_log.append(entry)

    def set_hang(self, report: dict[str, Any] | None) -> None:
        """The watchdog's hang report, or None once progress resumed."""
        with self._lock:
            self.hang = report

    def set_exit(self, record: dict[str, Any]) -> None:
        """How this process ended (written at interpreter exit)."""
        with self._lock:
            self.exit = record

    def slowest_recent_step(self) -> float | None:
        """The longest step in the recent window, None before the first step ends."""
        with self._lock:
            return max((r[0] for r in self.recent), default=None)

    # -- readers ------------------------------------------------------------------------------

    def history_since(self, step: int) -> list[dict[str, Any]]:
        """Per-step records after ``step``, oldest first (copies; for the history writer)."""
        with self._lock:
            found = [dict(r) for r in self._history if r["step"] > step]
        for r in found:
            if "buckets" in r:
                r["buckets"] = [{"index": i, "seconds": s, "bytes": b} for i, s, b in r["buckets"]]
        return found

    def collectives_by_op(self) -> dict[str, tuple[int, int]]:
        """(issued, completed) per collective operation."""
        with self._lock:
            return {op: (c[0], c[1]) for op, c in self._ops.items()}

    def histograms(self) -> dict[str, Histogram]:
        """Copies of the step histograms, safe to read outside the lock."""
        with self._lock:
            return {
                name: _copy(h)
                for name, h in (
                    ("step", self.step_hist),
                    ("forward", self.forward_hist),
                    ("backward", self.backward_hist),
                    ("exposed_comm", self.exposed_hist),
                )
            }

    def bucket_stats(self) -> list[BucketStats]:
        with self._lock:
            return [
                BucketStats(
                    b.index, b.bytes, b.dtype, b.parameters, _copy(b.seconds),
                    b.bytes_total, b.last_seconds, b.last_ready_seconds, b.last_busbw,
                )
                for b in sorted(self.buckets.values(), key=lambda b: b.index)
            ]

    def snapshot(self) -> dict[str, Any]:
        """The latest per-rank view, as plain JSON-ready data (the state file's body)."""
        with self._lock:
            recent = list(self.recent)
            snap = dict(self.identity)
            snap.update(
                {
                    "step": self.steps,
                    "phase": self.phase,
                    "started_unix": self.started_unix,
                    "last_progress_unix": self.last_progress_unix,
                    "collectives": {"issued": self.issued, "completed": self.completed},
                    "in_flight": [dict(c) for c in self.in_flight],
                    "last_collective": dict(self.last_collective) if self.last_collective else None,
                    "unused_parameters": list(self.unused_parameters),
                    "buckets": [b.as_dict() for b in sorted(self.buckets.values(), key=lambda b: b.index)],
                    "notes": dict(self.notes),
                    "errors": dict(self.errors),
                    "hang": self.hang,
                    "exit": self.exit,
                    "collective_seq": dict(self.collective_seq),
                    "collective_sites": dict(self.collective_sites),
                    "collective_log": list(self.collective_log),
                }
            )
        snap["timings"] = _summaries(recent)
        snap["now_unix"] = time.time()
        return snap


def site_key_of(entry: dict[str, Any]) -> str:
    """The key of ``collective_sites``: op, call site and its first caller; all DDP buckets
    issued from one place share a key."""
    key = f"{entry.get('op')} {entry.get('call_site')}"
    if entry.get("callers"):
        key += f" < {entry['callers'][0]}"
    return key + (" (DDP bucket)" if entry.get("bucket") is not None else "")


def _copy(h: Histogram) -> Histogram:
    c = Histogram(h.bounds)
    c.counts, c.sum, c.count = list(h.counts), h.sum, h.count
    return c


def _summaries(recent: list[tuple[float, float, float, float | None]]) -> dict[str, Any]:
    """Median and last of each per-step time over the recent window."""
    out: dict[str, Any] = {"window_steps": len(recent)}
    columns = {
        "step_seconds": [r[0] for r in recent],
        "forward_seconds": [r[1] for r in recent],
        "backward_seconds": [r[2] for r in recent],
        "compute_seconds": [r[1] + r[2] for r in recent],
        "exposed_comm_seconds": [r[3] for r in recent if r[3] is not None],
    }
    for name, values in columns.items():
        out[name] = (
            {"median": statistics.median(values), "last": values[-1], "max": max(values)}
            if values
            else None
        )
    return out
