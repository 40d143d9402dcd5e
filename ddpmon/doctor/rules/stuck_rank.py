"""stuck_rank (verdict hang): a rank makes no progress outside any collective (stuck), or
its process is there but its state file is no longer rewritten (frozen).

Ranks that wait in a collective wait for someone; a rank that is in none is that someone:
its own code blocks (a data loader, I/O, a deadlock) or it skipped a collective. Its stack
(from its hang report, or py-spy for a frozen one) shows where.
"""

from __future__ import annotations

from ...activity import Status
from .. import words
from ..findings import Finding, Verdict
from ..view import RankView


def stuck_rank(views: list[RankView], missing: list[int]) -> Verdict | None:
    stuck = [v for v in views if v.status in (Status.STUCK, Status.FROZEN)]
    if not stuck:
        return None
    waiting = [v for v in views if v.status == Status.WAITING]
    evidence = []
    for v in stuck:
        evidence.append(words.stuck_line(v))
        evidence += words.stack_lines(v)
    evidence += [words.wait_line(v) for v in waiting]
    summary = f"{words.who([v.rank for v in stuck])} {words.verb(stuck, 'is', 'are')} stuck outside any collective"
    if waiting:
        summary += (
            f"; {words.who([v.rank for v in waiting])} {words.verb(waiting, 'waits', 'wait')} for "
            f"{words.verb(stuck, 'it', 'them')} in {words.entry_name(waiting[0].waiting)}"
        )
    fix = words.FIX_STUCK
    if any(v.status == Status.FROZEN for v in stuck):
        fix = words.FIX_FROZEN + " " + fix
    suspects = [v.rank for v in stuck]
    return Verdict(
        "hang", suspects, [Finding("stuck_rank", "error", suspects, summary, evidence, fix)]
    )
