"""busy (verdict healthy): ranks make no progress but are working outside the training step.

An evaluation under ``no_grad``, a checkpoint on rank 0 while the others wait in a barrier,
work after the training loop: no step ends, yet nothing is hung. Each rank's watchdog
samples its main thread (``ddpmon/activity.py``): a stack that moves, CPU or I/O is work.
A rank that evaluates through the DDP model under ``no_grad`` while the others wait in a
barrier makes progress (its forwards are heartbeats) but no step: it works too
(``common.evaluating``), not a rank that runs on without joining.
The waiting ranks wait for the busy ones, which is reported as such, however long: a
rank that works is never hung (``activity.is_hang``, the watchdog's rule too), and the
process group's own timeout bounds the wait. A stuck, frozen or failed rank anywhere leaves
the verdict to the rules after this one.
"""

from __future__ import annotations

from ...activity import Status
from .. import words
from ..findings import Finding, Verdict
from ..view import RankView
from .common import evaluating


def busy(views: list[RankView], missing: list[int]) -> Verdict | None:
    working = [v for v in views if v.status == Status.BUSY] + evaluating(views)
    if not working or any(
        v.status in (Status.STUCK, Status.FROZEN, Status.DEAD, Status.CRASHED, Status.SILENT)
        for v in views
    ):
        return None
    waiting = [v for v in views if v.status == Status.WAITING]
    where = "; ".join(f"rank {v.rank} in {_where(v)}" for v in working[:4])
    if len(working) > 4:
        where += f"; {len(working) - 4} more"
    if waiting:
        oldest = max(waiting, key=lambda v: v.waiting.age_seconds or 0.0 if v.waiting else 0.0)
        summary = (
            f"{words.who([v.rank for v in waiting])} {words.verb(waiting, 'has', 'have')} waited "
            f"{(oldest.waiting.age_seconds or 0.0) if oldest.waiting else oldest.silent:.0f} s in "
            f"{words.entry_name(oldest.waiting)} for {words.who([v.rank for v in working])}, busy "
            f"outside the training step ({where}): not a hang{words.group_timeout_end(waiting, working)}"
        )
    else:
        summary = f"{words.who([v.rank for v in working])} {words.verb(working, 'is', 'are')} busy outside the training step ({where}): not a hang"
    evidence = [words.busy_line(v) for v in working] + [words.wait_line(v) for v in waiting]
    return Verdict(
        "healthy",
        [],
        [Finding("busy", "info", [v.rank for v in working], summary, evidence, words.FIX_BUSY)],
    )


def _where(v: RankView) -> str:
    act = v.state.activity
    return act.where if act is not None and act.where else "code outside any step"
