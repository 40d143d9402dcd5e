"""unused_parameters, needless_find_unused_parameters (info): what DDP's
``find_unused_parameters`` costs and buys.

A parameter without a gradient in a step needs ``find_unused_parameters=True`` (else DDP
fails at the next forward); the flag costs a traversal of the autograd graph every step.
Each rank names its own unused parameters, but only all ranks together can tell that the
flag is needless: another rank may be the one with unused parameters.
"""

from __future__ import annotations

from ...advice import FIX
from .. import words
from ..findings import Finding
from ..view import RankView


def unused_parameters(views: list[RankView]) -> list[Finding]:
    """unused_parameters: the parameters that received no gradient in a rank's last step.
    Ranks with the same list share one finding; long lists are folded, never cut: every name
    is in the evidence. A rank that failed on them (DDP's reduction error) has them named as
    its failure's cause by the verdict (``words.failed_on_unused``), not here."""
    by_names: dict[tuple[str, ...], list[int]] = {}
    for v in sorted(views, key=lambda v: v.rank):
        if v.state.unused_parameters and not words.failed_on_unused(v):
            by_names.setdefault(tuple(v.state.unused_parameters), []).append(v.rank)
    out = []
    for names, ranks in by_names.items():
        folded = words.fold_names(names)
        out.append(
            Finding(
                "unused_parameters",
                "info",
                ranks,
                f"{words.who(ranks)}: {len(names)} parameter(s) received no gradient in "
                f"{'its' if len(ranks) == 1 else 'their'} last step: {words.names_shown(names)}",
                evidence=[f"unused: {name}" for name in folded] if len(folded) > 8 else [],
                fix=words.FIX_UNUSED,
            )
        )
    return out


def needless_find_unused_parameters(views: list[RankView]) -> list[Finding]:
    """needless_find_unused_parameters: every rank runs with find_unused_parameters=True and
    has flagged it as needless (no unused parameter for a while), and no rank has any now."""
    flagged = [v for v in views if "find_unused_parameters" in v.state.notes]
    if not views or len(flagged) != len(views) or any(v.state.unused_parameters for v in views):
        return []
    return [
        Finding(
            "needless_find_unused_parameters",
            "info",
            [v.rank for v in views],
            "find_unused_parameters=True, but no rank has had an unused parameter for "
            f"{min(v.state.step for v in views)}+ steps; it costs a traversal of the "
            "autograd graph every step",
            fix=FIX["needless_find_unused_parameters"],
        )
    ]
