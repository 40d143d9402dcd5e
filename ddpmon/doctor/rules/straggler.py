"""straggler (a warning): one or more ranks compute clearly slower than the others while the
job progresses; every step then runs at their speed.

Step and backward wall times cannot show it: DDP evens them out, as the fast ranks wait in
the gradient all-reduce for the slow one. Compute (forward plus backward compute) does, and
the wait that follows confirms it: the slow rank waits least for communication.
"""

from __future__ import annotations

import statistics

from .. import words
from ..findings import Finding, Verdict
from ..view import RankView

STRAGGLER_RATIO = 1.25
STRAGGLER_MIN_SECONDS = 0.005
STRAGGLER_MIN_STEPS = 5
"""Slower by this ratio and this many seconds per step, over at least this many steps."""


def straggler(views: list[RankView], missing: list[int]) -> Verdict | None:
    compute = {
        v.rank: c for v in views
        if (c := v.timing("compute_seconds")) is not None
        and v.state.timings.window_steps >= STRAGGLER_MIN_STEPS
    }
    if len(compute) < 2:
        return None
    values = sorted(compute.values())
    baseline = values[0] if len(values) == 2 else statistics.median(values)
    slow = sorted(
        r for r, c in compute.items()
        if c >= STRAGGLER_RATIO * baseline and c - baseline >= STRAGGLER_MIN_SECONDS
    )
    if not slow or len(slow) == len(compute):
        return None
    exposed = {v.rank: v.timing("exposed_comm_seconds") for v in views}
    others = [r for r in compute if r not in slow]
    evidence = [
        f"rank {r}: compute {words.ms(compute[r])} per step (forward + backward, median), waits "
        f"{words.ms(exposed.get(r))} for communication after backward"
        for r in sorted(compute)
    ]
    confirmed = all(
        (mine := exposed.get(s)) is not None
        and all((theirs := exposed.get(o)) is not None and mine <= theirs for o in others)
        for s in slow
    )
    evidence.append(
        "confirmed: the slow rank waits least for communication (the others wait for it)"
        if confirmed else "the exposed communication times do not single it out"
    )
    evidence += words.ready_lines(views, slow)
    slowest = max(compute[s] for s in slow)
    ratio = slowest / baseline if baseline else float("inf")
    return Verdict("straggler", slow, [Finding(
        "straggler", "warning", slow,
        f"{words.who(slow)} {words.verb(slow, 'computes', 'compute')} "
        f"{ratio:.1f}x slower than the others ({words.ms(slowest)} against "
        f"{words.ms(baseline)} per step); the whole job runs at its speed",
        evidence, words.FIX_STRAGGLER,
    )])
