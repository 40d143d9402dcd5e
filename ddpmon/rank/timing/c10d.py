"""Bucket timing from c10d itself: NCCL's per-collective timing, DDP's C++ all-reduce untouched.

With collective timing on, ProcessGroupNCCL hands a completion hook one ``WorkInfo`` per
collective (op type, sequence number, enqueue time, GPU duration) from a thread of its own,
shortly after the collective ends. Nothing of ddpmon runs on DDP's path to the all-reduce:
the completion hook appends three numbers and returns.

At step boundaries, the all-reduces enqueued during a step's backward are matched to DDP's
buckets by order (DDP launches buckets 0, 1, ... in index order), and only when their count
is the bucket count (plus DDP's used-parameter all-reduce, issued after the last bucket,
with find_unused_parameters); a step with any other count (another all-reduce on DDP's
group during backward, such as SyncBatchNorm's) is skipped and counted, never guessed.
Exposed communication comes from two pooled CUDA events per step: one at the end of
backward compute, one after DDP has made the stream wait for every bucket. The clock checks
itself: when none of the first 20 settled steps matches (c10d reported nothing, or nothing
that fits the buckets), ``off_reason`` says why and the monitor turns this source off.
"""

from __future__ import annotations

import atexit
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...fuses import Fuse, bounded
from .. import torch_api
from ..recorder import BucketTiming, StepTimings

log = logging.getLogger("ddpmon")

MAX_COLLECTIVES = 8192  # completions not yet matched to a step
MAX_WINDOWS = 64  # closed steps waiting for their completions
SETTLE_SECONDS = 10.0  # a step with no later collective is matched after this long
SETTLE_MARGIN = 0.25  # c10d's watchdog finds completions every 100 ms, not always in order
WARN_AFTER_UNMATCHED = 20  # consecutive steps without a match before saying so
SELF_CHECK_STEPS = 20  # steps settled without one match: the source is not working here
DESTROY_AT_EXIT_SECONDS = 5.0  # a crashed peer must not turn exit into a hang

# One completion hook per process group, for the life of the group (c10d has no way to
# remove one): ddpmon registers a dispatcher once and monitors add and remove listeners.
_DISPATCHERS: dict[int, tuple[Any, list[Callable[[Any], None]]]] = {}


def unavailable_reason(group: Any, device: str = "cpu") -> str | None:
    """Why c10d cannot time this process group's collectives on ``device``, or None when it
    can. (A group made without naming a backend serves CPU tensors with gloo and CUDA
    tensors with NCCL.) A torch without the completion hook says so once (``torch_api.off``)."""
    backend = backend_name(group, device)
    if backend != "nccl":
        return f"the {backend} backend has no completion hook (only NCCL has one)"
    try:
        torch_api.check_completion_hook(group)
    except torch_api.Missing as missing:
        return torch_api.off(missing)
    return None


def backend_name(group: Any, device: str = "cpu") -> str:
    """The backend that runs ``group``'s collectives of tensors on ``device``."""
    try:
        return torch_api.group_backend(group, device)
    except Exception:  # no ProcessGroup._get_backend, or no backend for that device type
        return str(dist.get_backend(group))


def listen(group: Any, listener: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``listener(work_info)`` for each collective of ``group`` that completes;
    returns the function that stops it. Turns c10d's collective timing on."""
    entry = _DISPATCHERS.get(id(group))
    if entry is None or entry[0] is not group:
        listeners: list[Callable[[Any], None]] = []

        def dispatch(info: Any) -> None:  # on c10d's hook thread; must never raise
            for fn in tuple(listeners):
                try:
                    fn(info)
                except Exception:
                    pass

        torch_api.register_completion_hook(group, dispatch)
        if not _DISPATCHERS:
            atexit.register(release_groups_at_exit)
        entry = _DISPATCHERS[id(group)] = (group, listeners)
    entry[1].append(listener)

    def stop() -> None:
        if listener in entry[1]:
            entry[1].remove(listener)

    return stop


def release_groups_at_exit() -> None:
    """c10d's hook thread takes the GIL, so torch asks that every group with a completion
    hook be destroyed before the interpreter exits (``_register_on_completion_hook``'s
    docstring); a program that leaves its groups alive gets this done at exit."""
    groups = [group for group, _ in _DISPATCHERS.values()]
    _DISPATCHERS.clear()
    if not groups or not dist.is_initialized():
        return

    def destroy() -> None:
        if any(group is dist.group.WORLD for group in groups):
            dist.destroy_process_group()  # every group, WORLD included
        else:
            for group in groups:
                dist.destroy_process_group(group)

    # A group destroyed already, torch shutting down, or a peer gone: logged, never waited
    # for beyond the bound.
    bounded(destroy, DESTROY_AT_EXIT_SECONDS, "destroying the process groups ddpmon hooked at exit")


@dataclass
class _Window:
    """One step's backward, on the wall clock, and what is needed to match it."""

    step_start_unix: float
    start_unix: float
    end_unix: float | None = None
    buckets: int = 0
    step: int | None = None
    generation: int = 0  # of the bucket layout known when the step ended
    first: bool = False  # the first step this clock saw end
    events: list[Any] = field(default_factory=list)  # [backward compute end, collectives done]


class CompletionClock:
    """The bucket clock fed by c10d's completion hook instead of a comm hook.

    ``on_completion`` is the listener (``listen(group, clock.on_completion)``). The step
    hooks call ``backward_started``, ``backward_done`` and ``sync_done``; the monitor calls
    ``new_step(step, buckets, generation)`` at each boundary and ``collect()`` after it.
    ``used_map_allreduce``: DDP all-reduces its used-parameter map after the last bucket
    (find_unused_parameters without static_graph).
    """

    IGNORES = frozenset({"forward_started"})
    """Step hook events it does nothing at (``hooks/step.py`` leaves them out)."""

    def __init__(
        self,
        device: torch.device | str,
        used_map_allreduce: bool,
        fuse: Fuse,
        source: str = "c10d",
        max_windows: int = MAX_WINDOWS,
    ) -> None:
        self.source = source
        """``c10d`` (its completion hook) or ``flight_recorder`` (``flight.FlightRecorderFeed``)."""
        self._max_windows = max_windows
        self._device = torch.device(device)
        self._cuda = self._device.type == "cuda"
        self._extra = 1 if used_map_allreduce else 0
        self._fuse = fuse
        self._done: collections.deque[tuple[int, float, float]] = collections.deque(
            maxlen=MAX_COLLECTIVES
        )
        self._pending: list[tuple[int, float, float]] = []
        self._windows: collections.deque[_Window] = collections.deque()
        self._open: _Window | None = None
        self._free_events: list[Any] = []
        self._buckets_now = 0
        self._generation_now = 0
        self._seen_step = False
        self.matched_steps = 0
        self.unmatched_steps = 0
        self._unmatched_run = 0
        self._warned = False
        self.last_mismatch: str | None = None
        self.warning: str | None = None  # while steps keep failing to match
        self.reports = 0  # WorkInfo records c10d handed over, of any collective
        self.received = 0  # all-reduce completions among them
        self.undated = 0  # all-reduces reported without a duration (gloo's flight recorder)
        self.settled_steps = 0  # matched, refused or given up on
        self.off_reason: str | None = None  # set once the self-check found the source useless;
        # from then on the clock does nothing (the monitor stops listening)

    # -- c10d's hook thread -----------------------------------------------------------------

    def on_completion(self, info: Any) -> None:
        if not self._fuse.ok:
            return
        try:
            self.reports += 1
            op = info.op_type
            if getattr(op, "name", str(op).rpartition(".")[2]) != "ALLREDUCE":
                return
            self.add(
                int(getattr(info, "seq", 0) or 0),
                _unix(info.time_started),
                _seconds(info.active_duration),
            )
        except Exception as exc:
            self._fuse.blow(exc)

    def add(self, seq: int, enqueued_unix: float, seconds: float) -> None:
        """One all-reduce of DDP's group completed: its sequence number, when it was enqueued
        and how long it ran. From any thread."""
        self._done.append((seq, enqueued_unix, seconds))
        self.received += 1

    # -- the training thread ----------------------------------------------------------------

    def backward_started(self, step_start: float) -> None:
        """The first backward of a step began; ``step_start`` on ``time.perf_counter``."""
        if self._open is None and self._fuse.ok and self.off_reason is None:
            now = time.time()
            self._open = _Window(
                step_start_unix=now - (time.perf_counter() - step_start), start_unix=now
            )

    def forward_started(self) -> None:
        pass

    def backward_done(self, synced: bool = True) -> None:
        """Backward compute is over: every bucket DDP launches in this backward is enqueued."""
        window = self._open
        if window is not None:
            window.end_unix = time.time()
            if self._cuda:
                self._release(window.events)  # an earlier no_sync microbatch's
                window.events.append(self._record())

    def sync_done(self, synced: bool = True) -> None:
        """DDP waited for its buckets: the stream now runs after every collective."""
        window = self._open
        if window is not None and self._cuda and len(window.events) == 1:
            window.events.append(self._record())

    def new_step(self, step: int, buckets: int = 0, generation: int = 0) -> None:
        """The step ``step`` (a count) ended; DDP's layout (``generation``) has ``buckets``."""
        window, self._open = self._open, None
        self._buckets_now, self._generation_now = buckets, generation
        if window is None:
            return
        if window.end_unix is None:  # a backward that raised
            self._release(window.events)
            return
        window.buckets, window.step, window.generation = buckets, step, generation
        window.first, self._seen_step = not self._seen_step, True
        self._windows.append(window)
        while len(self._windows) > self._max_windows:
            self.settled_steps += 1  # given up on: it counts for the self-check
            self._unmatched(self._windows.popleft(), "its collectives never completed")

    def collect(self) -> list[StepTimings]:
        """Steps whose collectives have all been reported, matched to buckets."""
        while self._done:
            self._pending.append(self._done.popleft())
        self._pending.sort(key=lambda c: (c[1], c[0]))
        newest = self._pending[-1][1] if self._pending else None
        now = time.time()
        out: list[StepTimings] = []
        while self._windows:
            window = self._windows[0]
            assert window.end_unix is not None
            age = now - window.end_unix
            settled = (
                newest is not None and newest > window.end_unix and age > SETTLE_MARGIN
            ) or age > SETTLE_SECONDS
            if not settled or not self._events_done(window, now):
                break
            self._windows.popleft()
            self.settled_steps += 1
            mine = [c for c in self._pending if window.start_unix <= c[1] <= window.end_unix]
            self._pending = [c for c in self._pending if c[1] > window.end_unix]
            exposed = self._exposed(window)
            timings = self._match(window, mine)
            if timings is not None or exposed is not None:
                out.append(
                    StepTimings(timings or [], exposed, measured=self._cuda, step=window.step)
                )
        if len(self._pending) > MAX_COLLECTIVES:
            del self._pending[: len(self._pending) - MAX_COLLECTIVES]
        self._self_check()
        return out

    def _self_check(self) -> None:
        """After the first steps, a source that never matched a step is not working here:
        c10d reported nothing (no WorkInfo) or nothing that fits DDP's buckets."""
        if self.off_reason is not None or self.matched_steps:
            return
        undated = not self.received and self.undated >= SELF_CHECK_STEPS  # conclusive at once
        if self.settled_steps < SELF_CHECK_STEPS and not undated:
            return
        recorder = self.source == "flight_recorder"
        if not self.reports:
            self.off_reason = (
                f"torch's flight recorder recorded no collective of DDP's process group in the first "
                f"{self.settled_steps} steps"
                if recorder
                else f"c10d's completion hook gave no WorkInfo in the first {self.settled_steps} steps"
            )
        elif not self.received and self.undated:
            self.off_reason = (
                f"torch's flight recorder recorded {self.undated} all-reduce(s) of DDP's process group, "
                "none with its duration (this backend's recorder keeps when each was issued, not how "
                "long it ran)"
            )
        elif not self.received:
            self.off_reason = (
                f"{'the flight recorder' if recorder else 'c10d'} reported {self.reports} collective(s) "
                f"but no all-reduce in the first {self.settled_steps} steps"
            )
        else:
            self.off_reason = (
                f"none of the first {self.settled_steps} steps could be matched to DDP's buckets "
                f"({self.last_mismatch or 'completions outside the backward windows'})"
            )

    # -- matching ----------------------------------------------------------------------------

    def _match(
        self, window: _Window, collectives: list[tuple[int, float, float]]
    ) -> list[BucketTiming] | None:
        count = len(collectives)
        if window.generation == self._generation_now:
            buckets = window.buckets
        else:
            # DDP rebuilt its buckets since (after its iteration 0). Its logging data shows
            # them a step late, so the step may have run the new layout already; the first
            # step seen, and one whose count is the old layout's, ran the old one: dropped.
            buckets = self._buckets_now
            if window.first or count != buckets + self._extra:
                return None
        if not buckets or count != buckets + self._extra:
            self._unmatched(
                window,
                f"{count} all-reduce(s) on DDP's process group during backward "
                f"for {buckets} bucket(s)",
            )
            return None
        if all(c[0] for c in collectives):  # c10d's sequence numbers give the issue order
            collectives = sorted(collectives)
        self.matched_steps += 1
        self._unmatched_run = 0
        self.warning = None
        timings = []
        for i, (_seq, start, seconds) in enumerate(collectives[:buckets]):
            ready = start - window.step_start_unix  # enqueued: DDP launches a bucket once ready
            timings.append(BucketTiming(i, ready, ready, ready + seconds))
        return timings

    def _unmatched(self, window: _Window, why: str) -> None:
        self._release(window.events)
        self.unmatched_steps += 1
        self._unmatched_run += 1
        self.last_mismatch = why
        if self._unmatched_run >= WARN_AFTER_UNMATCHED and self.warning is None:
            self.warning = (
                f"per-bucket timing from {self.source} matched no step in the last {self._unmatched_run} "
                f"({why}), so bucket series stay empty: other all-reduces on DDP's process group "
                "during backward (SyncBatchNorm's, a comm hook that issues other than one per "
                "bucket) do this; bucket_timing='hook' times every bucket through a Python comm "
                "hook instead (a few percent of step time)"
            )
            if not self._warned and self.matched_steps:  # never matched: the self-check speaks
                self._warned = True
                log.warning("ddpmon: %s", self.warning)

    # -- exposed communication from two CUDA events per step --------------------------------

    def _record(self) -> Any:
        event = (
            self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)
        )
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _events_done(self, window: _Window, now: float) -> bool:
        if len(window.events) < 2 or window.events[1].query():
            return True
        return now - (window.end_unix or now) > SETTLE_SECONDS  # give up on exposed, keep the rest

    def _exposed(self, window: _Window) -> float | None:
        events, value = window.events, None
        if len(events) == 2 and events[1].query():
            value = max(0.0, events[0].elapsed_time(events[1]) / 1000.0)
        self._release(events)
        return value

    def _release(self, events: list[Any]) -> None:
        self._free_events.extend(events)
        events.clear()


def _unix(moment: Any) -> float:
    """The Unix time of a ``WorkInfo.time_started``. pybind hands a system_clock time as a
    naive local datetime; a time of another clock as a timedelta since that clock's epoch
    (torch 2.11's CUDA build: steady_clock, which on Linux is CLOCK_MONOTONIC, as
    ``time.monotonic``); a number is taken as is."""
    if hasattr(moment, "timestamp"):
        return float(moment.timestamp())
    if hasattr(moment, "total_seconds"):
        seconds = float(moment.total_seconds())
        return seconds if seconds > SINCE_UNIX_EPOCH else seconds + time.time() - time.monotonic()
    return float(moment)


SINCE_UNIX_EPOCH = 1e9
"""Seconds past which a clock reading is taken as a Unix time (2001): a monotonic clock
counts from boot."""


def _seconds(duration: Any) -> float:
    """pybind hands a chrono duration as a timedelta; a bare number is c10d's milliseconds."""
    return (
        duration.total_seconds() if hasattr(duration, "total_seconds") else float(duration) / 1000.0
    )
