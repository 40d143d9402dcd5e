"""What several rules ask of the ranks: who is stalled, who takes part in the collectives,
whether they wait in one collective."""

from __future__ import annotations

from ...activity import Status
from ...state.schema import Collective
from ..view import GONE, STALLED, RankView


def gone(views: list[RankView]) -> list[RankView]:
    return [v for v in views if v.status in GONE]


def stalled(views: list[RankView]) -> list[RankView]:
    return [v for v in views if v.status in STALLED]


def in_collectives(views: list[RankView]) -> list[RankView]:
    """The ranks that wait in a collective, then those that run (and so join it)."""
    return [v for v in views if v.status == Status.WAITING] + [v for v in views if v.status == Status.STEPPING]


def key(e: Collective) -> tuple[str, int, str]:
    return (e.group, e.seq, e.op)


def same_collective(waiting: list[RankView]) -> bool:
    """True when the ranks wait in one collective: the same (group, seq, op), or a rank is
    one collective ahead after completing the one the others still wait in."""
    entries = [v.waiting for v in waiting if v.waiting]
    if len({key(e) for e in entries}) == 1:
        return True
    if len({e.group for e in entries}) != 1:
        return False
    low = min(e.seq for e in entries)
    behind = [e for e in entries if e.seq == low]
    if len({e.op for e in behind}) != 1:
        return False
    target = (behind[0].group, low, behind[0].op)
    for v in waiting:
        e = v.waiting
        if e is None or e.seq == low:
            continue
        done = list(v.state.collective_log) + ([v.state.last_collective] if v.state.last_collective else [])
        if not any(key(c) == target and not c.error for c in done):
            return False
    return True
