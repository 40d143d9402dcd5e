"""Goodput: how much of a job's wall time trained the model, across its attempts.

The wall time runs from the first attempt's process start to the last attempt's end. It is
cut into parts that add up to it: the steps (productive, less the pauses between them) and
the time lost, by cause (``CAUSES``). Each attempt is read on one rank's clock (its lowest
rank, normally rank 0): its process start (``process_started_unix``), its first and last
steps (its history) and its end (its exit record, or its last write when it was killed).
A hang's two parts are durations on the clock of the rank that reported it; only a restart,
the gap between two attempts, joins two readings that may come from two hosts, and then
the result says so (``notes``).

Not counted apart, because ddpmon cannot see them: the work a failed attempt did since its
last checkpoint (its steps count as productive here), and the launcher's own start before
the first process. Nothing here imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import StateFileError
from .formats import format_seconds
from .state import attempts, files, history, schema

CAUSES = (
    "startup",
    "pauses",
    "hang_until_detected",
    "hang_until_ended",
    "after_last_step",
    "restarts",
)
"""Where the lost time went: a process's start to its first step; evaluation, checkpoint
and other pauses between steps; a hang from the last progress to the watchdog's report, and
from the report to the attempt's end (``hang_action=abort``, or whatever ended it); the last
step's end to the attempt's end otherwise (a failed step, the work after the loop, the
exit); an attempt's end to the next attempt's first process start."""


@dataclass
class Attempt:
    """One attempt as its reference rank saw it (seconds since the epoch, one host's clock)."""

    number: int
    rank: int
    host: str | None
    process_start: float
    first_step: float | None
    """The first step's start (its first forward), None without steps."""
    last_step_end: float | None
    end: float
    paused: float
    hang: tuple[float, float] | None = None
    """(seconds from the last progress to the hang report, from the report to the end),
    each on the reporting rank's clock."""
    without_history: bool = False
    """Its steps read from its state file alone (its history was off or unreadable): from
    its attach to its last progress, the first step's start-up counted as a step."""


def attempts_of(state_dirs: Sequence[str], job: str | None = None) -> list[Attempt]:
    """Every attempt found in ``state_dirs`` (their ``attempt-<N>/`` and the current one),
    oldest first."""
    found: dict[int, list[tuple[schema.RankState, str]]] = {}
    for state_dir in state_dirs:
        directories = [(n, d) for n, d in attempts.earlier(state_dir)] + [(None, state_dir)]
        for number, directory in directories:
            for path in files.list_files(directory):
                try:
                    state = files.read(path)
                except (StateFileError, OSError):
                    continue
                if job is not None and state.job != job:
                    continue
                n = number if number is not None else (state.attempt or 0)
                found.setdefault(n, []).append((state, directory))
    return [_attempt(n, ranks) for n, ranks in sorted(found.items())]


def _attempt(number: int, ranks: list[tuple[schema.RankState, str]]) -> Attempt:
    state, directory = min(ranks, key=lambda r: r[0].rank)
    first = last = None
    try:
        span = history.span(history.path_for(directory, state.rank))
    except history.HistoryError:
        span = None
    if span is not None:
        first, last = span
    elif state.step and state.started_unix and state.last_progress_unix:
        first, last = state.started_unix, state.last_progress_unix  # no history: attach on
    start = state.process_started_unix or state.started_unix or first or 0.0
    end = state.exit.unix if state.exit is not None else (state.now_unix or 0.0)
    end = max(end, last or 0.0, start)
    hangs = [s for s, _ in ranks if s.hang is not None]
    hang = None
    if hangs:  # the first report, preferring one on the reference rank's host
        h = min(hangs, key=lambda s: (s.host != state.host, s.hang.detected_unix))  # type: ignore[union-attr]
        assert h.hang is not None
        ended = h.exit.unix if h.exit is not None else (h.now_unix or h.hang.detected_unix)
        hang = (
            max(0.0, h.hang.detected_unix - h.hang.last_progress_unix),
            max(0.0, ended - h.hang.detected_unix),
        )
    return Attempt(
        number,
        state.rank,
        state.host,
        start,
        first,
        last,
        end,
        state.paused_seconds,
        hang,
        without_history=span is None and first is not None,
    )


def goodput(found: Sequence[Attempt]) -> dict[str, Any] | None:
    """``ratio`` (productive over wall time, 0..1), ``wall_seconds``, ``productive_seconds``,
    ``lost_seconds`` (per cause, ``CAUSES``), ``attempts`` and ``notes``; None without an
    attempt."""
    if not found:
        return None
    lost = dict.fromkeys(CAUSES, 0.0)
    productive = 0.0
    notes: list[str] = []
    for before, a in zip([None, *found[:-1]], found):
        if before is not None:
            lost["restarts"] += max(0.0, a.process_start - before.end)
            if before.host != a.host:
                notes.append(
                    f"attempt {before.number} ended on {before.host} and attempt {a.number} "
                    f"started on {a.host}: the restart between them is read on two clocks"
                )
        if a.without_history:
            notes.append(
                f"attempt {a.number} has no step history (DDPMON_HISTORY=0?): its steps are "
                "counted from its attach to its last progress"
            )
        if a.first_step is None or a.last_step_end is None:
            lost["startup"] += a.end - a.process_start  # never stepped
            continue
        lost["startup"] += max(0.0, a.first_step - a.process_start)
        steps = max(0.0, a.last_step_end - max(a.first_step, a.process_start))
        paused = min(steps, max(0.0, a.paused))
        lost["pauses"] += paused
        productive += steps - paused
        tail = max(0.0, a.end - max(a.last_step_end, a.process_start))
        if a.hang is not None:
            until_detected = min(tail, a.hang[0])
            until_ended = min(tail - until_detected, a.hang[1])
            lost["hang_until_detected"] += until_detected
            lost["hang_until_ended"] += until_ended
            tail -= until_detected + until_ended
        lost["after_last_step"] += tail
    wall = productive + sum(lost.values())
    return {
        "ratio": productive / wall if wall > 0 else None,
        "wall_seconds": wall,
        "productive_seconds": productive,
        "lost_seconds": lost,
        "attempts": len(found),
        "start_unix": found[0].process_start,
        "end_unix": found[-1].end,
        "clock": f"rank {found[0].rank} on {found[0].host}",
        "notes": notes,
    }


def of_dirs(state_dirs: Sequence[str], job: str | None = None) -> dict[str, Any] | None:
    """The goodput of the job whose files are in ``state_dirs`` (local directories)."""
    return goodput(attempts_of([d for d in state_dirs if os.path.isdir(d)], job))


def text(g: dict[str, Any] | None) -> str | None:
    """``goodput 87% (52.1 s of 60.0 s trained); lost: startup 4.2 s, ...``."""
    if not g or g["ratio"] is None:
        return None
    lost = ", ".join(
        f"{cause.replace('_', ' ')} {format_seconds(s)}"
        for cause, s in g["lost_seconds"].items()
        if s >= 0.05
    )
    return (
        f"goodput {g['ratio'] * 100:.0f}% ({format_seconds(g['productive_seconds'])} of "
        f"{format_seconds(g['wall_seconds'])} in steps"
        + (f" over {g['attempts']} attempts" if g["attempts"] > 1 else "")
        + ")"
        + (f"; lost: {lost}" if lost else "")
    )
