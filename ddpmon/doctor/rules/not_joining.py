"""not_joining (verdict hang): ranks wait in a collective while another rank keeps making
progress without issuing it.

The running rank is not slow, it is elsewhere: it skipped the collective (rank-conditional
code, gradient accumulation under ``no_sync()`` on one rank only) and goes on alone. Its
live stack, where py-spy can read it, shows what it runs instead. A rank whose progress is
forward passes without a step past the waiting ranks (an evaluation under ``no_grad``
before it joins them) works, and the ``busy`` rule before this one says so until they have
waited 5 hang timeouts.
"""

from __future__ import annotations

from ...activity import Status
from .. import words
from ..findings import Finding, Verdict
from ..view import RankView


def not_joining(views: list[RankView], missing: list[int]) -> Verdict | None:
    waiting = [v for v in views if v.status == Status.WAITING]
    if not waiting:
        return None
    joined = {(e.group, e.seq) for v in waiting for e in [v.waiting] if e}
    absent = [
        v for v in views
        if v.status == Status.STEPPING and not any((e.group, e.seq) in joined for e in v.in_flight)
    ]
    if not absent:
        return None
    evidence = [words.wait_line(v) for v in waiting] + [
        f"rank {v.rank} keeps making progress (step {v.state.step}, phase "
        f"{v.state.phase}) but has not issued it" for v in absent
    ]
    for v in absent:
        evidence += words.stack_lines(v)
    suspects = [v.rank for v in absent]
    return Verdict("hang", suspects, [Finding(
        "not_joining", "error", suspects,
        f"{words.who([v.rank for v in waiting])} {words.verb(waiting, 'waits', 'wait')} in "
        f"{words.entry_name(waiting[0].waiting)}; {words.who(suspects)} "
        f"{words.verb(absent, 'runs', 'run')} on without issuing it",
        evidence, words.FIX_STUCK,
    )])
