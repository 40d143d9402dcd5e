"""Ranks that ended: finished, left_early, dead_rank.

A rank that ends while others still need it stops the job: the others fail in their next
collective with a connection error, or wait in it until their timeout. Their errors are
symptoms; the cause is the rank that ended first. Ranks whose own error is a failure of
communication (connection reset, timeout, ...) ended because another did, so they come
last when the first one is chosen, like torchelastic's "first observed failure".
"""

from __future__ import annotations

import re

from ...activity import Status
from .. import words
from ..findings import Finding, Verdict
from ..view import RankView
from .common import gone, stalled
from .straggler import finished_straggler

PEER_FAILURE = re.compile(
    r"connection (closed|reset|refused)|closed by peer|broken pipe|timed out|timeout|"
    r"communicator was aborted|watchdog caught|recvbytes|sendbytes|socket|peer|"
    r"processgroup.*abort|nccl error|gloo",
    re.IGNORECASE,
)
"""An exception that says communication with another rank failed: a symptom."""


def finished(views: list[RankView], missing: list[int]) -> Verdict | None:
    """finished: every rank exited without an error. The job is over: healthy, unless a
    rank straggled over its last steps, which a finished job keeps as its verdict (what
    happened in the run, not only that it ended)."""
    ended = gone(views)
    if views and len(ended) == len(views) and all(v.status == Status.EXITED for v in ended):
        done = Finding(
            "finished",
            "info",
            [v.rank for v in views],
            f"the job has ended: all {len(views)} ranks exited without an error",
        )
        slow = finished_straggler(views)
        if slow is not None:
            return Verdict(slow.verdict, slow.suspects, [*slow.findings, done])
        return Verdict("healthy", [], [done])
    return None


def left_early(views: list[RankView], missing: list[int]) -> Verdict | None:
    """left_early (verdict desync): the first rank to end exited cleanly while others still
    needed it in their collectives: the ranks did not run the same number of steps (uneven
    inputs, or a collective after the loop that not every rank reaches)."""
    first = _first_to_end(views)
    if first is None or first.status != Status.EXITED:
        return None
    stalled_ = stalled(views)
    waiting = [v.rank for v in stalled_] + [
        v.rank for v in gone(views) if v.status != Status.EXITED
    ]
    return Verdict(
        "desync",
        [first.rank],
        [
            Finding(
                "left_early",
                "error",
                [first.rank],
                f"rank {first.rank} left the job (exited without an error at step "
                f"{first.state.step}) while {words.who(waiting)} still needed it in "
                f"{'their' if len(waiting) > 1 else 'its'} collectives: the ranks did not run the "
                "same number of steps",
                _evidence(views, first),
                words.FIX_UNEVEN,
            )
        ],
    )


def dead_rank(views: list[RankView], missing: list[int]) -> Verdict | None:
    """dead_rank: a rank died (no exit record and no process), crashed (an uncaught
    exception) or went silent (another host, its file no longer rewritten) while the others
    needed it. The first to end is the suspect; the others ended or wait because of it."""
    first = _first_to_end(views)
    if first is None or first.status == Status.EXITED:
        return None
    if first.status == Status.CRASHED and not PEER_FAILURE.search(first.exception or ""):
        fix = words.fix_crashed(first)
    elif first.exception:
        fix = words.FIX_PEERS_FAILED
    else:
        fix = words.fix_died(first)
    others = _after(views, first)
    stalled_ = stalled(views)
    summary = f"rank {first.rank} {words.ended(first, brief=True)} first"
    if others:
        summary += f"; {words.who([v.rank for v in others])} ended after it"
    if stalled_:
        summary += f"; {words.who([v.rank for v in stalled_])} {words.verb(stalled_, 'waits', 'wait')} for it"
    evidence = _evidence(views, first)
    if first.ending is not None and first.ending.signal and first.stack:
        evidence[1:1] = words.stack_lines(first)
    return Verdict(
        "dead_rank",
        [first.rank],
        [
            Finding(
                "dead_rank",
                "error",
                [first.rank],
                summary,
                evidence,
                fix,
            )
        ],
    )


def _order(v: RankView) -> tuple[bool, float]:
    secondary = v.status == Status.CRASHED and bool(PEER_FAILURE.search(v.exception or ""))
    return (secondary, v.gone_at if v.gone_at is not None else v.file.written)


def _first_to_end(views: list[RankView]) -> RankView | None:
    """The rank that ended first, when a rank's end matters: one failed, or one left while
    others are stalled. None when no rank ended, or some finished and the rest progress."""
    ended = gone(views)
    failed = [v for v in ended if v.status != Status.EXITED]
    if not ended or (not failed and (len(ended) == len(views) or not stalled(views))):
        return None
    return min(ended, key=_order)


def _after(views: list[RankView], first: RankView) -> list[RankView]:
    return sorted((v for v in gone(views) if v is not first), key=_order)


def _evidence(views: list[RankView], first: RankView) -> list[str]:
    return (
        [words.gone_line(first)]
        + [words.gone_line(v) for v in _after(views, first)]
        + [words.wait_line(v) for v in stalled(views)]
    )
