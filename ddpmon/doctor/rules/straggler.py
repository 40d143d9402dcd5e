"""straggler (a warning): one or more ranks are consistently slower than the others while the
job progresses; every step then runs at their speed.

Step wall times cannot show it: DDP evens them out, as the fast ranks wait in the gradient
all-reduce for the slow one. Busy time (the step less that wait) does: the straggler score
(ddpmon/steps.py) compares each rank's busy time with the median of the others over the
last steps, and names the part of the step (data wait, forward, backward, optimizer, other)
that explains the gap, where in the step it lies and the user's frame the rank's stack
samples there were in (``doctor/where.py``). State files without step parts (older ddpmon) are compared on compute
(forward plus backward) as before.
"""

from __future__ import annotations

import os
import statistics

from ... import steps
from ...activity import Status
from ...formats import format_seconds
from ...state import captures
from .. import busy, where, words
from ..findings import Finding, Verdict
from ..view import RankView

HISTORY_LAG_SECONDS = 3.0
"""How much more history than ``steps.SUSTAIN_SECONDS`` is read: a rank commits its steps
to its history about once a second, some a little later than others."""
STRAGGLER_RATIO = 1.25
STRAGGLER_MIN_SECONDS = 0.005
STRAGGLER_MIN_STEPS = 5
"""Without step parts: slower by this ratio and this many seconds per step, over at least
this many steps."""


def straggler(views: list[RankView], missing: list[int]) -> Verdict | None:
    return _by_busy_time(views) if _parts_known(views) else _by_compute(views)


def finished_straggler(views: list[RankView]) -> Verdict | None:
    """A finished job's straggler over the last steps each rank published. Only by busy
    time: the compute medians of older files mix in the warm-up steps of a short job. Its
    gap must have lasted like a running job's (``steps.sustained``): a job that ended within
    the sustain time shows no more than one burst of a busy machine's scheduling can."""
    return _by_busy_time(views) if _parts_known(views) else None


def _parts_known(views: list[RankView]) -> bool:
    return len(views) >= 2 and all(v.state.timings.parts is not None for v in views)


def slowest_within_noise(views: list[RankView]) -> list[Finding]:
    """An info note when the slowest rank is at least ``SCORE_WARN`` slower but its gap is
    still within its step-to-step noise: a rank near the line is named in some polls and
    not in others, and this says where it stands whichever way the verdict went."""
    parts = {v.rank: v.state.timings.parts for v in views}
    if (
        len(views) < 2
        or any(p is None for p in parts.values())
        or any(v.status != Status.STEPPING for v in views)
    ):
        return []
    scores = steps.scores(parts)  # type: ignore[arg-type]
    if not scores:
        return []
    named, lasting = _named(views, scores)
    if named:
        return []
    pending = {r: h for r, h in lasting.items() if not h.held}
    if pending:
        return [_not_lasting(scores[r], h) for r, h in sorted(pending.items())]
    top = max(scores.values(), key=lambda s: s.score)
    if top.score < steps.SCORE_WARN or top.gap_seconds < steps.MIN_GAP_SECONDS:
        return []
    part = f", most of it in {steps.PART_LABELS[top.cause]}" if top.cause else ""
    return [
        Finding(
            "slowest_rank",
            "info",
            [top.rank],
            f"rank {top.rank} is {steps.slower(top.score)} than the others {steps.over(top.steps)}{part}, but within its "
            f"step-to-step noise ({format_seconds(top.gap_seconds)} more work per step, where the noise asks for {format_seconds(top.margin_seconds)}): not named a straggler yet",
            [],
            "Ask again in a few steps (ranks are compared over their last 20 to 150 steps), or watch "
            "the Straggler score panel, which the DDPStraggler alert reads over 10 minutes.",
        )
    ]


def _lasting(views: list[RankView], scores: dict[int, steps.Score]) -> dict[int, steps.Held]:
    """For each rank the state files' window names, how its gap held over the last
    ``steps.SUSTAIN_SECONDS`` of the ranks' histories (read only then, here or from the
    daemons asked ``--from``: ``doctor/busy.py``). Empty when a rank's history cannot be
    had (history off, an older daemon): the window alone decides."""
    named = [r for r, s in scores.items() if s.straggler]
    if not named or any(v.rank not in scores for v in views):
        return {}
    series = busy.recent(
        views,
        steps.SUSTAIN_SECONDS + HISTORY_LAG_SECONDS,
        at_least=steps.MIN_STEPS,
    )
    if series is None:
        return {}
    return {r: steps.sustained(series, r) for r in named}


def _named(
    views: list[RankView], scores: dict[int, steps.Score]
) -> tuple[list[steps.Score], dict[int, steps.Held]]:
    """The ranks named stragglers, slowest first: those the window names whose gap lasted
    (``steps.sustained``); and how each gap the window names held (``_lasting``)."""
    lasting = _lasting(views, scores)
    slow = [
        s
        for s in scores.values()
        if s.straggler and (s.rank not in lasting or lasting[s.rank].held)
    ]
    return sorted(slow, key=lambda s: -s.score), lasting


def _not_lasting(s: steps.Score, held: steps.Held) -> Finding:
    blocks = ", ".join(f"{b:+.0%}" for b in held.blocks) or "none yet"
    return Finding(
        "slowest_rank",
        "info",
        [s.rank],
        f"rank {s.rank} is {steps.slower(s.score)} than the others {steps.over(s.steps)}, "
        f"but that has not lasted {steps.SUSTAIN_SECONDS:.0f} s (over its last "
        f"{held.blocks_seconds:.0f} s, in {steps.SUSTAIN_BLOCKS} blocks: {blocks}): not named a straggler "
        "yet (a busy machine slows one rank, then another, for seconds at a time)",
        [],
        f"Ask again in {steps.SUSTAIN_SECONDS:.0f} s: a straggler is still slower then.",
    )


def _by_busy_time(views: list[RankView]) -> Verdict | None:
    scores = steps.scores({v.rank: v.state.timings.parts for v in views})  # type: ignore[misc]
    slow, lasting = _named(views, scores)
    if not slow or len(slow) == len(scores):
        return None
    exposed = {
        v.rank: v.state.timings.parts.exposed_comm_seconds for v in views if v.state.timings.parts
    }
    suspects = sorted(s.rank for s in slow)
    findings = []
    for s in slow:
        cause = s.cause
        evidence = [
            f"rank {r}: busy {format_seconds(scores[r].busy_seconds)} per step, {steps.slower(scores[r].score)} "
            f"than the others' median step by step (over its last {scores[r].steps} steps), waits "
            f"{format_seconds(exposed.get(r))} for communication"
            for r in sorted(scores)
        ]
        parts = sorted(((p, e) for p, e in s.excess.items() if e > 0), key=lambda pe: -pe[1])
        found = where.place(s, views)
        evidence.append(
            "over the others' median: "
            + ", ".join(
                f"{steps.PART_LABELS[p]} +{format_seconds(e)} ({s.shares[p]:.0%})" for p, e in parts
            )
        )
        if found is not None:
            evidence.append(found.line(s.rank))
        others = [r for r in scores if r not in suspects]
        if all(exposed.get(o, 0.0) >= exposed.get(s.rank, 0.0) for o in others):
            evidence.append(
                "confirmed: the slow rank waits least for communication (the others wait for it)"
            )
        if s.rank in lasting:
            held = lasting[s.rank]
            evidence.append(
                f"it lasts: {', '.join(f'{b:+.0%}' for b in held.blocks)} in "
                f"{steps.SUSTAIN_BLOCKS} consecutive blocks of its last {held.blocks_seconds:.0f} s "
                f"(a straggler's gap must hold {steps.SUSTAIN_SECONDS:.0f} s)"
            )
        fix = words.FIX_STRAGGLER_PART[cause] if cause else words.FIX_STRAGGLER
        if found is not None and found.gap is not None and found.part == cause:
            fix = f"look at the code that rank runs {found.label}"
        findings.append(
            Finding(
                "straggler",
                "warning",
                [s.rank],
                words.straggler_summary(
                    s.rank,
                    s.score,
                    cause,
                    s.shares.get(cause, 0.0) if cause else 0.0,
                    found.gap if found is not None and found.part == cause else None,
                    found.frame if found is not None and found.part == cause else None,
                    window=steps.over(s.steps),
                )
                + f" ({format_seconds(s.busy_seconds)} against {format_seconds(s.baseline_seconds)} of work per step); "
                "the whole job runs at its speed",
                evidence,
                f"{fix.rstrip('.')}. {_capture_hint(views, s.rank, scores)}",
            )
        )
    return Verdict("straggler", suspects, findings)


def _capture_hint(views: list[RankView], rank: int, scores: dict[int, steps.Score]) -> str:
    """The command that profiles the straggler beside its most typical peer over the same
    steps (docs/capture.md): run where its state directory is."""
    peers = [r for r, s in scores.items() if r != rank and not s.straggler]
    peer = min(peers, key=lambda r: abs(scores[r].score)) if peers else None
    view = next(v for v in views if v.rank == rank)
    where = os.path.dirname(view.file.path)
    if os.path.isdir(where):
        return f"To see where its time goes: {captures.command(where, rank, peer)}"
    return (
        f"To see where its time goes, on {view.state.host or 'its node'}: "
        f"{captures.command('STATE_DIR', rank, peer)} (STATE_DIR: the job's state directory there)"
    )


def _by_compute(views: list[RankView]) -> Verdict | None:
    compute = {
        v.rank: c
        for v in views
        if (c := v.timing("compute_seconds")) is not None
        and v.state.timings.window_steps >= STRAGGLER_MIN_STEPS
    }
    if len(compute) < 2:
        return None
    values = sorted(compute.values())
    baseline = values[0] if len(values) == 2 else statistics.median(values)
    slow = sorted(
        r
        for r, c in compute.items()
        if c >= STRAGGLER_RATIO * baseline and c - baseline >= STRAGGLER_MIN_SECONDS
    )
    if not slow or len(slow) == len(compute):
        return None
    exposed = {v.rank: v.timing("exposed_comm_seconds") for v in views}
    others = [r for r in compute if r not in slow]
    evidence = [
        f"rank {r}: compute {format_seconds(compute[r])} per step (forward + backward, median), waits "
        f"{format_seconds(exposed.get(r))} for communication after backward"
        for r in sorted(compute)
    ]
    confirmed = all(
        (mine := exposed.get(s)) is not None
        and all((theirs := exposed.get(o)) is not None and mine <= theirs for o in others)
        for s in slow
    )
    evidence.append(
        "confirmed: the slow rank waits least for communication (the others wait for it)"
        if confirmed
        else "the exposed communication times do not single it out"
    )
    evidence += words.ready_lines(views, slow)
    slowest = max(compute[s] for s in slow)
    ratio = slowest / baseline if baseline else float("inf")
    return Verdict(
        "straggler",
        slow,
        [
            Finding(
                "straggler",
                "warning",
                slow,
                f"{words.who(slow)} {words.verb(slow, 'computes', 'compute')} "
                f"{ratio:.1f}x slower than the others ({format_seconds(slowest)} against "
                f"{format_seconds(baseline)} per step); the whole job runs at its speed",
                evidence,
                words.FIX_STRAGGLER,
            )
        ],
    )
