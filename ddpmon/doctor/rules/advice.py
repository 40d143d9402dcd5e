"""The silent mistakes (ddpmon/advice/, docs/advice.md): findings that leave the verdict alone.

Cross-rank kinds (same_data, replicas_diverged, nonfinite_gradients, shared_gpu) are
compared here from every rank's fingerprints, so a job whose ranks could not read each
other's files (a state directory per node) gets them too; the kinds a rank saw alone are
merged across the ranks that saw them. ``rank_as_device`` explains an ``invalid device
ordinal`` crash. needless_find_unused_parameters has its own rule (unused_parameters.py).
"""

from __future__ import annotations

from ...advice import FIX
from ...advice.compare import compare
from ...state.schema import Advice
from ..findings import Finding
from ..view import RankView

CROSS_RANK = ("same_data", "replicas_diverged", "nonfinite_gradients", "shared_gpu")
OWN_RULE = ("needless_find_unused_parameters",)


def advice(views: list[RankView]) -> list[Finding]:
    """Every advice kind found in the job: compared across ranks, then as the ranks recorded it."""
    views = sorted(views, key=lambda v: v.rank)
    out = [_finding(a) for a in compare([v.state for v in views])]
    by_kind: dict[str, list[tuple[int, Advice]]] = {}
    for v in views:
        for a in v.state.advice:
            if a.kind not in CROSS_RANK and a.kind not in OWN_RULE:
                by_kind.setdefault(a.kind, []).append((v.rank, a))
    for kind, seen in by_kind.items():
        ranks = sorted({r for r, _ in seen})
        first = min(seen, key=lambda item: (item[1].step or 0, item[0]))[1]
        evidence = (
            [f"rank {r}, step {a.step}: {a.summary}" for r, a in seen] if len(seen) > 1 else []
        )
        evidence += [e for _, a in seen[:1] for e in a.evidence]
        summary = (
            first.summary
            if len(ranks) == 1
            else f"on rank(s) {', '.join(map(str, ranks))}: {first.summary}"
        )
        if len(ranks) == 1 and not summary.startswith("rank"):
            summary = f"rank {ranks[0]}: {summary}"
        out.append(
            Finding(kind, first.severity, ranks, summary, evidence, first.fix or FIX.get(kind, ""))
        )
    return out


def rank_as_device(views: list[RankView]) -> list[Finding]:
    """rank_as_device: a rank ended with CUDA's ``invalid device ordinal``: a device index past
    the GPUs of its node, nearly always the global rank used where LOCAL_RANK belongs."""
    hit = [v for v in views if v.exception and "invalid device ordinal" in v.exception.lower()]
    if not hit:
        return []
    ranks = sorted(v.rank for v in hit)
    evidence = [
        f"rank {v.rank} (LOCAL_RANK {v.state.local_rank}, host {v.state.host}): {v.exception}"
        + (f" at {v.state.exit.where}" if v.state.exit and v.state.exit.where else "")
        for v in hit
    ]
    return [
        Finding(
            "rank_as_device",
            "warning",
            ranks,
            f"rank(s) {', '.join(map(str, ranks))} asked for a GPU their node does not have "
            "(invalid device ordinal): the global rank used as a device index",
            evidence,
            FIX["rank_as_device"],
        )
    ]


def _finding(a: Advice) -> Finding:
    return Finding(a.kind, a.severity, list(a.ranks), a.summary, list(a.evidence), a.fix)
