"""not_joining (verdict hang): ranks wait in a collective while another rank keeps making
progress without issuing it.

The running rank is not slow, it is elsewhere: it skipped the collective (rank-conditional
code, gradient accumulation under ``no_sync()`` on one rank only) and goes on alone. Its
live stack, where py-spy can read it, shows what it runs instead. A rank whose progress is
forward passes without a step past the waiting ranks (an evaluation under ``no_grad``
before it joins them) works, and the ``busy`` rule before this one says so however long
they wait (unless their watchdogs proved a hang).
"""

from __future__ import annotations

from ...activity import Status
from ...state.schema import Collective
from .. import words
from ..findings import Finding, Verdict
from ..view import RankView


def not_joining(views: list[RankView], missing: list[int]) -> Verdict | None:
    waiting = [v for v in views if v.status == Status.WAITING]
    if not waiting:
        return None
    awaited = [e for v in waiting for e in [v.waiting] if e]
    absent = [
        v for v in views if v.status == Status.STEPPING and not any(joined(v, e) for e in awaited)
    ]
    if not absent:
        return None
    evidence = [words.wait_line(v) for v in waiting] + [
        f"rank {v.rank} keeps making progress (step {v.state.step}, stage "
        f"{v.state.stage}) but has not issued it"
        for v in absent
    ]
    for v in absent:
        evidence += words.stack_lines(v)
    suspects = [v.rank for v in absent]
    return Verdict(
        "hang",
        suspects,
        [
            Finding(
                "not_joining",
                "error",
                suspects,
                f"{words.who([v.rank for v in waiting])} {words.verb(waiting, 'waits', 'wait')} in "
                f"{words.entry_name(waiting[0].waiting)}; {words.who(suspects)} "
                f"{words.verb(absent, 'runs', 'run')} on without issuing it",
                evidence,
                words.FIX_STUCK,
            )
        ],
    )


def joined(v: RankView, entry: Collective) -> bool:
    """Whether rank ``v`` has issued ``entry``: it is in flight there, or (numbered by ddpmon,
    not by torch's flight recorder) its sequence has reached it, the collective then done
    after the waiting rank's file was written."""
    if any((e.group, e.seq) == (entry.group, entry.seq) for e in v.in_flight):
        return True
    return entry.source is None and v.state.has_issued(entry)
