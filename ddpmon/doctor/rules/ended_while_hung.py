"""ended_while_hung: every rank's process is gone without an error of its own, and each one
was stalled when it last wrote its state file.

A timeout, the scheduler or a person ended a hung job. Read as it is, the first rank to go
would be blamed (dead_rank) although it was only the first to be ended; the hang as it was
at the last writes says which rank the others waited for. So the doctor puts every rank
back in its stall (waiting or stuck) and lets the hang rules decide, adding this note.
"""

from __future__ import annotations

from ...activity import Status
from ..findings import Finding
from ..view import RankView


def applies(views: list[RankView]) -> bool:
    return bool(views) and all(
        v.status in (Status.DEAD, Status.SILENT) and v.stalled_when_written for v in views
    )


def replay(views: list[RankView]) -> None:
    """Each rank back in the stall it reported at its last write."""
    for v in views:
        v.status = Status.WAITING if v.in_flight else Status.STUCK


def ended_while_hung(views: list[RankView]) -> Finding:
    return Finding(
        "ended_while_hung",
        "info",
        [v.rank for v in views],
        "every rank's process is gone without an error of its own, and each one was "
        "stalled at its last state-file write: this is the hang as it was when the ranks "
        "were ended (by a timeout, the scheduler or a person)",
    )
