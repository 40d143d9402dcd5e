"""Where a straggler's excess lies: in which part of the step or gap between ddpmon's hooks
(``steps.GAP_TABLE``), and in which of the user's own frames, from the stack samples the
rank took while it looked slow (``schema.StackSamples``). Named by where it lies, never by
what usually sits there."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from dataclasses import dataclass

from .. import steps
from ..formats import format_seconds
from .view import RankView

MIN_SAMPLES = 20
"""Fewer samples in a place than this say nothing about it."""
_FRAME = re.compile(r"^(?P<file>.*):(?P<line>\d+) in (?P<func>.*)$")


@dataclass
class Place:
    """Where a rank's excess per step lies."""

    part: str
    """The part of the step (``steps.BUSY_PARTS``)."""
    gap: str | None
    """Of ``other``, the gap between hooks it lies in (``steps.GAPS``), when one explains most."""
    excess_seconds: float
    """Seconds per step over the other ranks' median there."""
    frame: str | None = None
    """The user's function most samples there were in, at its most sampled line:
    ``train.py:118 in get_batch``."""
    frame_share: float = 0.0
    samples: int = 0
    """Samples taken there."""

    @property
    def label(self) -> str:
        return steps.GAP_LABELS[self.gap] if self.gap else f"in {steps.PART_LABELS[self.part]}"

    def line(self, rank: int) -> str:
        """``rank 1: +40.0 ms/step between forward and backward, 95% of 2911 stack samples
        there in train.py:118 in get_batch``."""
        text = f"rank {rank}: +{format_seconds(self.excess_seconds)}/step {self.label}"
        if self.frame is not None:
            text += (
                f", {self.frame_share:.0%} of {self.samples} stack samples there in {self.frame}"
            )
        return text


def place(score: steps.Score, views: list[RankView]) -> Place | None:
    """Where ``score``'s excess lies: its cause, or else the part with the most excess; for
    ``other``, the gap whose own excess explains most of it."""
    part = score.cause or max(score.excess, key=lambda p: score.excess[p], default=None)
    if part is None or score.excess.get(part, 0.0) <= 0:
        return None
    found = Place(part, None, score.excess[part])
    stages = steps.PART_STAGES.get(part, ())
    if part == "other":
        gaps = gap_excess(views, score.rank)
        if gaps:
            gap = max(gaps, key=lambda g: gaps[g])
            if gaps[gap] >= steps.CAUSE_SHARE * found.excess_seconds:
                found.gap, found.excess_seconds = gap, gaps[gap]
                stages = next(g.stages for g in steps.GAP_TABLE if g.name == gap)
    view = next((v for v in views if v.rank == score.rank), None)
    if view is not None and view.state.stack_samples is not None:
        found.frame, found.frame_share, found.samples = hottest(
            view.state.stack_samples.by_stage, stages
        )
    return found


def gap_excess(views: list[RankView], rank: int) -> dict[str, float]:
    """Seconds per step each gap between hooks takes on ``rank`` over the other ranks'
    median; empty when its file or all of theirs lack them (an older ddpmon)."""
    gaps = {v.rank: p.gaps for v in views if (p := v.state.timings.parts) is not None and p.gaps}
    mine = gaps.pop(rank, None)
    if not mine or not gaps:
        return {}
    return {
        g: mine.get(g, 0.0) - statistics.median(other.get(g, 0.0) for other in gaps.values())
        for g in steps.GAPS
    }


def hottest(
    by_stage: dict[str, dict[str, int]], stages: tuple[str, ...]
) -> tuple[str | None, float, int]:
    """(the user's function most samples in ``stages`` were in, at its most sampled line;
    its share of them; how many there were). Lines of one function count together: a
    function's time is spread over its lines."""
    lines: Counter[str] = Counter()
    for stage in stages:
        lines.update(by_stage.get(stage, {}))
    total = sum(lines.values())
    if total < MIN_SAMPLES:
        return None, 0.0, total
    functions: Counter[str] = Counter()
    for frame, count in lines.items():
        m = _FRAME.match(frame)
        functions[f"{m['file']} in {m['func']}" if m else frame] += count
    function, count = functions.most_common(1)[0]
    line = max(
        (f for f in lines if (m := _FRAME.match(f)) and f"{m['file']} in {m['func']}" == function),
        key=lambda f: lines[f],
        default=function,
    )
    return line, count / total, total
