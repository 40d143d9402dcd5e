"""The facts of one rank, as the doctor sees them: its state file and its process.

Each rank is put in one status: stepping (progress recently), waiting (no progress, a
collective in flight), stuck (no progress, no collective in flight), frozen (its process
is there but its state file is no longer rewritten: the main thread holds the GIL or the
process is stopped), unknown (its file is stale because the file system refuses the
writes, read-only or full: alive, or ended without a record), busy (no progress, not in a
collective, but its watchdog sees it working: ``ddpmon/activity.py``), dead (the process is
gone without a word), crashed (it ended with an uncaught exception), exited (it ended
without one), silent (another host; its file stopped changing). The rules (``rules/``)
then compare the ranks.

Times are compared on one clock: each file's writer times are shifted by its own offset
(see load.py: measured against rank 0's clock where the rank could), and the doctor's clock
is compared only with file modification times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import activity
from ..activity import Status
from ..collectors.host import Liveness
from ..state import fault, records
from ..state.schema import Collective, Exit, RankState, Stage, Thread
from .load import StateFile

GONE = (Status.DEAD, Status.CRASHED, Status.EXITED, Status.SILENT)
"""The rank's process has ended (or, on another host, stopped writing)."""
STALLED = (Status.WAITING, Status.STUCK, Status.FROZEN)
"""The rank's process is there and makes no progress."""

STALE_MIN = 10.0
STALE_FACTOR = 5.0
"""A file not rewritten for this long (or this many write intervals) is no longer written."""
STALL_MIN = 5.0
STALL_FACTOR = 5.0
"""No progress for this long (or this many of the slowest recent steps) is a stall."""


class Unwritable(NamedTuple):
    """Why a rank cannot write its state file (``rules/cannot_write.py``): ``reason`` in the
    system's words (``no space left on device``), and the evidence for it."""

    reason: str
    evidence: list[str]


@dataclass
class RankView:
    """One rank as the doctor sees it. Times in seconds: ``age`` of its file and ``silent``
    (since its last progress) as of the doctor's clock, ``gone_at`` on the file system's."""

    file: StateFile
    liveness: Liveness
    age: float
    status: Status = Status.STEPPING
    silent: float = 0.0
    stall_after: float = STALL_MIN
    in_flight: list[Collective] = field(default_factory=list)
    """Its collectives in flight, ``age_seconds`` set (at its last write when it is gone)."""
    stack: list[Thread] | None = None
    stack_source: str | None = None
    stack_error: str | None = None
    gone_at: float | None = None
    stalled_when_written: bool = False
    ending: Exit | None = None
    """How it ended: its exit record, or the fatal signal its faulthandler file names."""
    cannot_write: Unwritable | None = None
    """Set when its file is stale because it cannot write it (then its status is unknown)."""

    @property
    def state(self) -> RankState:
        return self.file.state

    @property
    def rank(self) -> int:
        return self.file.rank

    @property
    def waiting(self) -> Collective | None:
        """The collective this rank is blocked in: its oldest in flight."""
        return min(self.in_flight, key=lambda e: e.issued_unix) if self.in_flight else None

    @property
    def exception(self) -> str | None:
        return self.ending.exception if self.ending else None

    def timing(self, name: str) -> float | None:
        """The median of one of its per-step timings (``compute_seconds``, ...)."""
        summary = getattr(self.state.timings, name)
        return summary.median if summary is not None else None

    def as_dict(self) -> dict[str, Any]:
        s = self.state
        waiting = self.waiting
        main = main_thread(self.stack)
        return {
            "rank": self.rank,
            "host": s.host,
            "pid": s.pid,
            "status": str(self.status),
            "alive": self.liveness.alive,
            "liveness": self.liveness.detail,
            "step": s.step,
            "stage": str(s.stage),
            "silent_seconds": round(self.silent, 3),
            "file_age_seconds": round(self.age, 3),
            "stale": self.status in (Status.FROZEN, Status.SILENT, Status.UNKNOWN),
            "cannot_write": self.cannot_write.reason if self.cannot_write else None,
            "waiting_in": brief_entry(waiting) if waiting else None,
            "activity": records.dump(s.activity),
            "in_flight": len(self.in_flight),
            "collectives_issued": s.collectives.issued,
            "hang_reported": s.hang is not None,
            "exit": records.dump(self.ending),
            "compute_seconds": self.timing("compute_seconds"),
            "exposed_comm_seconds": self.timing("exposed_comm_seconds"),
            "stack": {"source": self.stack_source, "frames": records.dump(main.frames[-20:])}
            if main
            else None,
            "stack_error": self.stack_error,
            "backend": s.backend,
            "debug_level": s.debug_level,
            "ddp": s.ddp,
            "file": self.file.path,
        }


def view(f: StateFile, liveness: Liveness, now: float, stall: float | None) -> RankView:
    """Place one rank in its status from its file and its process. ``now`` is the doctor's
    clock; ``stall`` overrides the seconds without progress that make a stall."""
    s = f.state
    age = max(0.0, now - f.mtime)
    off = f.offset
    last = s.last_progress_unix
    silent = (
        age + max(0.0, s.now_unix - last) if last is not None and s.now_unix is not None else age
    )
    slowest = s.timings.step_seconds.max if s.timings.step_seconds else None
    stall_after = stall if stall is not None else max(STALL_MIN, STALL_FACTOR * (slowest or 0.0))
    in_flight = s.in_flight
    if not in_flight and "nccl" in str(s.backend):
        # NCCL ops leave the CPU at once; the flight recorder knows which ones the GPU has
        # not completed. (gloo completes on the CPU, where ddpmon tracks it exactly, and its
        # flight-recorder completion states lag behind.)
        in_flight = flight_recorder_waits(s)
    in_flight = list(in_flight)
    for e in in_flight:  # the doctor's own copy of the file's records: set in place (cheap)
        e.age_seconds = round(now - (e.issued_unix + off), 3)
    v = RankView(f, liveness, age, silent=silent, stall_after=stall_after, in_flight=in_flight)
    if s.hang is not None and s.hang.threads:  # py-spy may replace it with a live one
        v.stack, v.stack_source = s.hang.threads, f"its hang report ({age:.0f} s old)"
    interval = state_interval(s)
    stale = age > max(STALE_MIN, STALE_FACTOR * interval)
    v.ending = s.exit
    signalled = fault.of_run(f.path, s, f.offset)
    if signalled is not None:
        v.ending, off = signalled, 0.0  # the fault file's time is the file system's
    if v.ending is not None and v.ending.how == "signal" and v.ending.threads:
        # read here, or by the node daemon that served the file (--from)
        v.stack, v.stack_source = v.ending.threads, f"its faulthandler file ({v.ending.signal})"
    if v.ending is not None:  # it ended (possibly still tearing down)
        v.status = Status.CRASHED if failed(v.ending) else Status.EXITED
        v.gone_at = v.ending.unix + off
    elif liveness.alive is False:
        v.status = Status.EXITED if s.stage == Stage.DETACHED else Status.DEAD
        v.gone_at = f.written + interval / 2
    elif liveness.alive is None and stale:
        v.status = Status.SILENT
        v.gone_at = f.written + interval / 2
    elif liveness.stopped or (liveness.alive and stale):
        v.status = Status.FROZEN
    elif s.hang is not None or silent > stall_after:
        v.status = Status.WAITING if in_flight else Status.STUCK
        if (
            v.status == Status.STUCK
            and s.hang is None
            and activity.working_since(s.activity, silent, s.now_unix)
        ):
            v.status = Status.BUSY  # working outside a step: evaluation, checkpoint, post-loop
    written_silent = silent - age
    v.stalled_when_written = s.hang is not None or (
        written_silent > stall_after
        and (bool(in_flight) or not activity.working_since(s.activity, written_silent, s.now_unix))
    )
    if v.status in GONE:  # the ages that matter are those at its last write
        for e in v.in_flight:
            e.age_seconds = round((s.now_unix or e.issued_unix) - e.issued_unix, 3)
    return v


NEEDS_EVERY_RANK = frozenset(
    (
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_coalesced",
        "all_gather_object",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
    )
)
"""Collectives that complete on no rank before every rank of the group has joined them."""


def settle(views: list[RankView]) -> None:
    """A rank whose file shows it waiting in a collective that a peer completed after that
    file was written (that collective, or a later one of the group that needed every rank)
    waits no more: its next write will show it. It is counted as stepping, so that no
    rule takes the moment between two writes for a hang."""
    completed = _completions(views)
    for w in views:
        e = w.waiting
        if (
            w.status != Status.WAITING
            or e is None
            or e.source is not None
            or w.state.now_unix is None
        ):
            continue
        written = w.state.now_unix + w.file.offset
        if any(
            who != id(w) and when > written
            for seq, latest in completed.get(e.group, {}).items()
            if seq >= e.seq
            for when, who in latest
        ):
            w.status = Status.STEPPING
            w.in_flight = [c for c in w.in_flight if c.group != e.group or c.seq > e.seq]


def _completions(views: list[RankView]) -> dict[str, dict[int, list[tuple[float, int]]]]:
    """group -> seq -> the two latest completions (on the doctor's clock) of that collective,
    by two different ranks (``id`` of the view), of collectives that need every rank: one
    pass over every rank's log, so that ``settle`` asks each waiting rank's question of a
    few sequence numbers, not of every peer (a thousand ranks each asking of a thousand)."""
    out: dict[str, dict[int, list[tuple[float, int]]]] = {}
    for p in views:
        for c in p.state.collective_log:
            if c.op not in NEEDS_EVERY_RANK or c.error or c.completed_unix is None:
                continue
            latest = out.setdefault(c.group, {}).setdefault(c.seq, [])
            when = c.completed_unix + p.file.offset
            mine = [i for i, (_, who) in enumerate(latest) if who == id(p)]
            if mine:
                latest[mine[0]] = (max(when, latest[mine[0]][0]), id(p))
            else:
                latest.append((when, id(p)))
            latest.sort(reverse=True)
            del latest[2:]
    return out


def failed(e: Exit) -> bool:
    """An end that is a failure: an exception, a fatal signal or a non-zero exit status."""
    return bool(e.exception or e.signal or (e.code not in (None, 0)))


def flight_recorder_waits(s: RankState) -> list[Collective]:
    """Collectives that torch's flight recorder (in the rank's hang report) shows enqueued
    and not completed: the first one per process group, numbered by torch's own sequence."""
    fr = (s.hang.flight_recorder if s.hang else None) or {}
    entries = [e for e in fr.get("entries") or [] if isinstance(e, dict) and not e.get("is_p2p")]
    out = []
    for pg, status in sorted((fr.get("pg_status") or {}).items()):
        enqueued, completed = _count(status, "enqueued"), _count(status, "completed")
        if enqueued is None or completed is None or enqueued <= completed:
            continue
        seq = completed + 1
        match = next(
            (
                e
                for e in entries
                if e.get("collective_seq_id") == seq
                and pg in (str(e.get("pg_id")), str((e.get("process_group") or [None])[0]))
            ),
            {},
        )
        created = match.get("time_created_ns")
        out.append(
            Collective(
                seq=seq,
                op=str(match.get("profiling_name", "?")).split(":")[-1],
                group=pg,
                issued_unix=created / 1e9
                if isinstance(created, (int, float))
                else (s.last_progress_unix or 0.0),
                source="flight recorder",
            )
        )
    return out


def _count(status: Any, which: str) -> int | None:
    """A group's ``last_<which>_collective`` in the flight recorder's ``pg_status``."""
    try:
        return int(status[f"last_{which}_collective"])
    except (KeyError, TypeError, ValueError):
        return None


def gpu_not_started(v: RankView) -> bool:
    """Has the rank's GPU not even started the collective the rank waits in? Its flight
    recorder (NCCL) counts the collectives the GPU started: below this one, the GPU still
    runs work enqueued before it."""
    e = v.waiting
    if e is None or e.source != "flight recorder":
        return False
    fr = (v.state.hang.flight_recorder if v.state.hang else None) or {}
    started = _count((fr.get("pg_status") or {}).get(e.group), "started")
    return started is not None and started < (e.seq or 0)


def state_interval(s: RankState) -> float:
    """Seconds between the rank's state-file rewrites."""
    return float(s.state_interval) if s.state_interval is not None and s.state_interval > 0 else 1.0


def main_thread(threads: list[Thread] | None) -> Thread | None:
    if not threads:
        return None
    return next((t for t in threads if t.main), threads[0])


_BRIEF = (
    "op",
    "seq",
    "group",
    "group_size",
    "bytes",
    "call_site",
    "function",
    "bucket",
    "age_seconds",
)


def brief_entry(e: Collective) -> dict[str, Any]:
    """A collective in the few fields a reader of the JSON needs."""
    keys = [k for k in _BRIEF if not (k == "bucket" and e.source == "flight recorder")]
    return {k: getattr(e, k) for k in keys}
