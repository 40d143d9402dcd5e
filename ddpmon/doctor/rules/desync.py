"""desync: the ranks wait in different collectives.

Every rank must issue the same collectives in the same order; here one issued what the
others did not (a rank-conditional barrier, a collective skipped on uneven inputs), and
each now waits for a partner that never comes. With two sides of one size, the odd ranks
are those the others went past in the code both run (``common.behind``); else those whose
collective comes from a call site no other rank ever used, else the minority.
"""

from __future__ import annotations

from collections import Counter

from .. import words
from ..findings import Finding, Verdict
from ..view import RankView
from .common import behind, in_collectives, same_collective, stalled


def desync(views: list[RankView], missing: list[int]) -> Verdict | None:
    if not stalled(views):
        return None
    waiting = in_collectives(views)
    if same_collective(waiting):
        return None
    evidence = [words.wait_line(v) for v in waiting]
    odd = odd_ranks(waiting)
    steps = {v.rank: v.state.step for v in waiting}
    if len(set(steps.values())) > 1:
        evidence.append(
            "the ranks are at different steps: "
            + ", ".join(f"rank {r}: {s}" for r, s in steps.items())
        )
    parts = [
        f"rank {v.rank} in {words.entry_name(v.waiting)}"
        for v in sorted(waiting, key=lambda v: (v.rank not in odd, v.rank))
    ]
    summary = (
        f"the ranks wait in different collectives ({'; '.join(parts)}): "
        f"{words.who(odd)} issued a collective the others did not"
    )
    fix = (
        words.FIX_DESYNC
        + " "
        + words.rerun_advice(waiting[0].state.backend, waiting[0].state.debug_level, desync=True)
    )
    return Verdict("desync", odd, [Finding("desync", "error", odd, summary, evidence, fix)])


def odd_ranks(waiting: list[RankView]) -> list[int]:
    """The ranks that issued what the others did not. With two sides of one size, the side
    the other went past (``common.behind``); else a call site no other rank ever used, else
    the minority collective."""
    sides: dict[tuple[str, str, str], list[RankView]] = {}
    for v in waiting:
        if v.waiting:
            sides.setdefault((v.waiting.group, v.waiting.op, v.waiting.site_key), []).append(v)
    if len(sides) == 2 and len({len(side) for side in sides.values()}) == 1:
        last = behind(list(sides.values()))
        if last is not None:
            return sorted(v.rank for v in last)
    keys = {v.rank: v.waiting.site_key for v in waiting if v.waiting}
    sites = {v.rank: v.state.collective_sites for v in waiting}
    never = [r for r, k in keys.items() if all(not sites[o].get(k) for o in keys if o != r)]
    if 0 < len(never) < len(keys):
        return sorted(never)
    sig = {
        v.rank: (v.waiting.group, v.waiting.op, v.waiting.site_key) for v in waiting if v.waiting
    }
    counts = Counter(sig.values()).most_common()
    if len(counts) > 1 and counts[0][1] > counts[1][1]:
        return sorted(r for r, s in sig.items() if s != counts[0][0])
    return sorted(sig)
