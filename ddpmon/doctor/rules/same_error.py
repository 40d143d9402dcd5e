"""same_error (verdict dead_rank): every rank raised the same exception at the same place.

Ranks that all fail alike are not stopped by one of them: the code fails on every rank (DDP's
"Expected to have finished reduction" error with an unused layer and
find_unused_parameters=False, a shape error, a missing file). Which rank's record came first
is a race between their clocks, so none is named first; the error and its place are the
finding, and for DDP's reduction error its cause, the parameters that got no gradient.
Errors of communication (a closed connection, a timeout) are left to ``dead_rank``: ranks
that all lost their peers failed because of something else.
"""

from __future__ import annotations

import re

from ...activity import Status
from .. import words
from ..findings import Finding, Verdict
from ..view import RankView
from .dead_rank import PEER_FAILURE

_NUMBERS = re.compile(r"\d+")


def signature(v: RankView) -> tuple[str, str] | None:
    """(the exception's first line, numbers left out; the user frame it was raised in), or
    None when the rank did not end on an exception of its own. Numbers vary by rank (a rank,
    a device, a size) in one error of one line of code."""
    e = v.ending
    if v.status != Status.CRASHED or e is None or e.signal or not e.exception or not e.where:
        return None
    if PEER_FAILURE.search(e.exception):
        return None
    return _NUMBERS.sub("#", words.short_exception(e.exception)), e.where


def same_error(views: list[RankView], missing: list[int]) -> Verdict | None:
    """same_error: every rank of the job ended on the same exception, raised at the same
    line of the same function. The suspects are all of them: the bug is in the code."""
    if len(views) < 2 or missing:
        return None
    signatures = {signature(v) for v in views}
    if len(signatures) != 1 or None in signatures:
        return None
    views = sorted(views, key=lambda v: v.rank)
    ranks = [v.rank for v in views]
    by_names: dict[tuple[str, ...], list[int]] = {}
    for v in views:
        if unused := words.failed_on_unused(v):
            by_names.setdefault(tuple(unused), []).append(v.rank)
    error = (
        f'DDP\'s "{words.REDUCTION_ERROR}"'
        if by_names
        else words.short_exception(views[0].exception or "", 100)
    )
    summary = (
        f"every rank failed in the same place: a bug in the code, not one rank ({words.who(ranks)} "
        f"raised {error} at {views[0].ending.where})"  # type: ignore[union-attr]
    )
    evidence = [words.gone_line(v) for v in views]
    if by_names:
        one = len(by_names) == 1
        summary += "; its cause: " + "; ".join(
            words.unused_cause(names) + ("" if one else f" on {words.who(rs)}")
            for names, rs in by_names.items()
        )
        for names in by_names:  # long lists are folded, never cut: every name is in the evidence
            folded = words.fold_names(names)
            evidence += [f"unused: {name}" for name in folded] if len(folded) > 8 else []
        fix = " ".join(words.fix_unused_failure(names) for names in by_names)
    else:
        fix = (
            "Fix that error at that line: every rank raised it, so it does not depend on one "
            "rank's data, device or host. The full message and traceback are in each rank's log."
        )
    return Verdict(
        "dead_rank", ranks, [Finding("same_error", "error", ranks, summary, evidence, fix)]
    )
