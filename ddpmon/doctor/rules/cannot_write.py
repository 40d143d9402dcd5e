"""cannot_write (verdict cannot_write): a rank's state file is stale because the rank cannot
write it (a full disk), not because the rank froze or died.

A rank rewrites its file every second. Read as it is, a file that stops changing while the
process runs is a frozen rank (a hang), and a process gone without an exit record was
killed from outside (the OOM killer). Both are wrong when the writes fail: training goes on,
or ended cleanly, and only the file is old. So a rank whose file is late (``LATE_INTERVALS``
write intervals and a second) and that is not stopped is put in status ``unknown`` when the
evidence says its writes fail: the state directory's file system is full now
(``files.full``), or the last write that got through says a write of the rank's was failing
(usually its history's: SQLite needs new pages before a state file of the same size does).
What it does now, or how it ended, is not in its file; a live one's stack is read with
py-spy. (A read-only directory is ``state_dir_read_only``'s, in ``doctor/__init__.py``.)

The verdict comes after ``dead_rank`` and ``stuck_rank``, so that a rank whose own file
shows it failed or stuck stays the cause (this finding is then a note), and before
``busy`` (not healthy while ranks cannot be seen) and the rules that take the ranks seen
for the whole job (a wait with nobody behind reads as the network's fault).
"""

from __future__ import annotations

import errno
import os

from ...activity import Status
from ...state import files
from ...state.schema import WriteFailure
from .. import words
from ..findings import Finding, Verdict
from ..view import RankView, Unwritable, state_interval

LATE_INTERVALS = 2.0
"""A file older than this many write intervals (and a second) was due to be rewritten."""
NO_SPACE = os.strerror(errno.ENOSPC).lower()


def mark(views: list[RankView], state_dir: str | None) -> None:
    """Ranks whose file is late and that cannot write it: status unknown, with why.
    ``state_dir``: the directory the files were read from (None: read from node daemons,
    whose file systems the doctor cannot see)."""
    free = files.free_space(state_dir) if state_dir else None
    full = state_dir is not None and files.full(state_dir)
    for v in views:
        if (
            v.ending is not None
            or v.liveness.stopped
            or v.status in (Status.EXITED, Status.UNKNOWN)
            or v.age <= LATE_INTERVALS * state_interval(v.state) + 1.0
        ):
            continue
        failing = [
            (what, f) for what, f in sorted(v.state.write_failures.items()) if f.ended_unix is None
        ]
        if not (full or failing):
            continue
        evidence = [words.free_space_line(str(state_dir), free)] if full and free else []
        evidence += [words.write_failure_line(v, what, f) for what, f in failing]
        v.cannot_write = Unwritable(NO_SPACE if full else reason(failing[0][1]), evidence)
        v.status = Status.UNKNOWN


def reason(f: WriteFailure) -> str:
    """A failed write's cause as a sentence goes on: ``no space left on device``."""
    return f.error[:1].lower() + f.error[1:] if f.errno else f.error


def cannot_write(views: list[RankView], missing: list[int]) -> Verdict | None:
    found = finding(views, "error")
    return Verdict("cannot_write", found.ranks, [found]) if found is not None else None


def finding(views: list[RankView], severity: str = "warning") -> Finding | None:
    """cannot_write: the ranks that cannot write their state, why, and what is known of each
    (a note, ``warning``, when another rule gives the verdict)."""
    blocked = [v for v in views if v.cannot_write is not None]
    if not blocked:
        return None
    ranks = [v.rank for v in blocked]
    reasons = list(dict.fromkeys(v.cannot_write.reason for v in blocked if v.cannot_write))
    summary = f"{words.who(ranks)} cannot write {words.verb(blocked, 'its', 'their')} state: {'; '.join(reasons)}"
    ended = [v for v in blocked if v.liveness.alive is False]
    if ended:
        summary += (
            f"; {words.who([v.rank for v in ended])} {words.verb(ended, 'has', 'have')} ended, "
            "how is not recorded"
        )
    evidence: list[str] = []
    for v in blocked:
        evidence += v.cannot_write.evidence if v.cannot_write else []
        evidence.append(words.unwritten_line(v))
        if v.stack:
            evidence += words.stack_lines(v)
    waiting = [v for v in views if v.status == Status.WAITING]
    evidence += [words.wait_line(v) for v in waiting]
    where = os.path.dirname(blocked[0].file.path) or "."
    return Finding(
        "cannot_write",
        severity,
        ranks,
        summary,
        list(dict.fromkeys(evidence)),
        words.fix_cannot_write(where, bool(ended)),
    )
