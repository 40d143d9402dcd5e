"""A step's parts and who is slow: one home, pure and torch-free, for the rank, the doctor,
``top``, the end-of-run summary, the report and ``compare``.

A step's wall time splits into parts (``PARTS``) that sum to it: ``other`` is what the
measured parts leave (``balance``). A rank's *busy* time is its step less the time it waits
for the other ranks (exposed communication). DDP evens out step times (the fast ranks wait in
the gradient all-reduce for the slow one), so the slow rank shows the longest busy time and
its peers show the cost as waiting: comparing busy times blames the rank that is slow, not
the ones that wait.

Per rank: ``score = busy / median(busy of the other ranks) - 1`` over the last steps
(``schema.StepPhases``: a trimmed mean for busy, means per part), said as "N% slower"
(``slower``) wherever a user reads it. A rank is a straggler when its score is at least
``SCORE_WARN`` and the gap stands out of its step-to-step noise (``NOISE_FACTOR`` standard
errors of the difference of two trimmed means), so one noisy step or a jittery healthy job
does not make one. The cause is the part whose excess over the peers' median explains most
of the gap.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from .state.schema import StepPhases

PARTS = ("data_wait", "h2d", "forward", "backward", "exposed_comm", "optimizer", "other")
"""The parts of a step, in the order they stack up to its wall time (``h2d`` only where
visible)."""
PART_LABELS = {
    "data_wait": "data wait", "h2d": "host to device", "forward": "forward", "backward": "backward",
    "exposed_comm": "exposed communication", "optimizer": "optimizer", "other": "other",
}
WAITING_PARTS = frozenset({"exposed_comm"})
"""Parts spent waiting for the other ranks; the rest of a step is the rank's busy time."""
BUSY_PARTS = tuple(p for p in PARTS if p not in WAITING_PARTS)
"""The parts of a step that are the rank's own work."""
SCORE_WARN = 0.05
"""A rank 5% slower than its peers' median is a straggler when the gap also stands out of
its noise: below the 10% that matters, so that a rank 10% slower is named whatever the
noise of its measurement (benchmarks/stragglers.py chose these three)."""
MIN_GAP_SECONDS = 0.001
MIN_STEPS = 10
"""Medians and spreads of fewer steps called healthy jittery ranks stragglers."""
NOISE_FACTOR = 3.5
CAUSE_SHARE = 0.5
"""A part explaining at least half of the gap is named the cause."""


@dataclass(slots=True)
class StepRow:
    """One finished step of a rank: when, how long, and its parts in seconds (``PARTS``:
    they sum to ``step_seconds``, ``other`` taking up what the measured parts leave). The
    rank keeps its recent rows; its history file stores them; ``phases`` scores them."""

    step: int
    start_unix: float
    end_unix: float
    step_seconds: float
    data_wait_seconds: float | None = 0.0
    h2d_seconds: float | None = None
    forward_seconds: float | None = 0.0
    backward_seconds: float | None = None
    """None: no backward seen in the step."""
    exposed_comm_seconds: float | None = None
    """None: not measured (no bucket clock, and the host saw no wait)."""
    optimizer_seconds: float | None = 0.0
    other_seconds: float | None = 0.0
    micro_steps: int = 1
    buckets: list[tuple[int, float, int | None]] | None = None
    """(index, seconds, bytes) of each bucket's all-reduce, once a bucket clock resolved them."""
    gpu_pending: bool = False
    """Its parts will come from the GPU (``rank/gpu_steps.py``); it is counted when they do."""
    gpu_parts: bool = False
    """Its parts are the GPU's."""
    exposed_timed: bool = False
    """A bucket clock measured its exposed communication."""
    gpu_exposed: bool = False
    """The GPU measured its exposed communication (it wins over a bucket clock's)."""

    def part(self, name: str) -> float | None:
        """Seconds of the part ``name`` (one of ``PARTS``)."""
        return getattr(self, name + "_seconds")

    def set_part(self, name: str, seconds: float | None) -> None:
        setattr(self, name + "_seconds", seconds)

    def history(self) -> dict[str, Any]:
        """The row as the history file stores it (``state/history.HistoryStore.add_steps``)."""
        out = {name: getattr(self, name) for name in _HISTORY_FIELDS}
        if self.buckets is not None:
            out["buckets"] = [{"index": i, "seconds": s, "bytes": b} for i, s, b in self.buckets]
        return out


_HISTORY_FIELDS = ("step", "start_unix", "end_unix", "step_seconds", *(p + "_seconds" for p in PARTS))


def balance(row: StepRow) -> None:
    """Set ``other`` to what the measured parts leave of the step's wall time."""
    known = sum(row.part(p) or 0.0 for p in PARTS if p != "other")
    row.other_seconds = max(0.0, row.step_seconds - known)


def busy_seconds(row: StepRow) -> float:
    """The step's time minus its waiting for the other ranks."""
    return max(0.0, row.step_seconds - sum(row.part(p) or 0.0 for p in WAITING_PARTS))


def slower(score: float) -> str:
    """A score as users read it everywhere: "37% slower" (or "4% faster")."""
    return f"{score * 100:.0f}% slower" if score >= 0 else f"{-score * 100:.0f}% faster"


@dataclass
class Score:
    """One rank against the median of the others."""

    rank: int
    score: float
    busy_seconds: float
    baseline_seconds: float
    noise_seconds: float
    shares: dict[str, float] = field(default_factory=dict)
    """Of the gap, the share each part explains (excess over the peers' median, 0..1)."""
    excess: dict[str, float] = field(default_factory=dict)
    """Seconds per step each part takes over the peers' median."""

    @property
    def gap_seconds(self) -> float:
        return self.busy_seconds - self.baseline_seconds

    @property
    def straggler(self) -> bool:
        return (self.score >= SCORE_WARN and self.gap_seconds >= MIN_GAP_SECONDS
                and self.gap_seconds >= NOISE_FACTOR * self.noise_seconds)

    @property
    def cause(self) -> str | None:
        """The part that explains at least ``CAUSE_SHARE`` of the gap, or None."""
        if not self.shares:
            return None
        part = max(self.shares, key=lambda p: self.shares[p])
        return part if self.shares[part] >= CAUSE_SHARE else None


def scores(phases: dict[int, StepPhases]) -> dict[int, Score]:
    """Each rank's score against the others; ranks with fewer than ``MIN_STEPS`` steps are
    left out, and so is everything when fewer than two ranks remain. Every median of the
    other ranks comes from one sorted list per quantity, so a thousand ranks cost
    milliseconds."""
    ranks = {r: p for r, p in phases.items() if p is not None and p.steps >= MIN_STEPS}
    if len(ranks) < 2:
        return {}
    values = {"busy": {r: p.busy_seconds for r, p in ranks.items()},
              "error": {r: _error(p) for r, p in ranks.items()},
              **{part: {r: _part(p, part) for r, p in ranks.items()} for part in BUSY_PARTS}}
    ordered = {name: sorted(by_rank.values()) for name, by_rank in values.items()}

    def others(name: str, rank: int) -> float:
        return median_of_others(ordered[name], values[name][rank])

    out = {}
    for rank, mine in ranks.items():
        baseline = others("busy", rank)
        # Standard error of the difference of two typical busy times (``typical``).
        noise = math.sqrt(2.0) * max(values["error"][rank], others("error", rank))
        excess = {part: values[part][rank] - others(part, rank) for part in BUSY_PARTS}
        gap = sum(e for e in excess.values() if e > 0)
        shares = {part: max(0.0, e) / gap for part, e in excess.items()} if gap > 0 else {}
        out[rank] = Score(rank, busy_ratio(mine.busy_seconds, baseline), mine.busy_seconds, baseline,
                          noise, shares, excess)
    return out


def median_of_others(ordered: list[float], value: float) -> float:
    """The median of ``ordered`` (sorted) without one occurrence of ``value``; with one value
    alone, that value."""
    n = len(ordered) - 1
    if n < 1:
        return value
    skip = bisect.bisect_left(ordered, value)

    def at(i: int) -> float:
        return ordered[i if i < skip else i + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def busy_ratio(busy: float, baseline: float) -> float:
    return busy / baseline - 1.0 if baseline > 0 else (0.0 if busy <= 0 else math.inf)


def _error(p: StepPhases) -> float:
    """The standard error of a rank's busy time; from an older ddpmon, which wrote a median
    and its absolute deviation, that of a median."""
    if p.busy_error_seconds is not None:
        return p.busy_error_seconds
    return 1.2533 * 1.4826 * p.busy_spread_seconds / math.sqrt(p.steps)


def _part(p: StepPhases, part: str) -> float:
    return getattr(p, part + "_seconds") or 0.0


def phases(rows: list[StepRow]) -> StepPhases | None:
    """What a rank's steps (``Recorder.history_since`` rows) say for its score: mean seconds
    per step of each part (means, so that they sum to the mean step), and the typical busy
    time with its standard error (``typical``)."""
    if not rows:
        return None
    n = len(rows)

    def mean(name: str) -> float:
        return sum(getattr(r, name) or 0.0 for r in rows) / n

    busy = [busy_seconds(r) for r in rows]
    middle = statistics.median(busy)
    typical_busy, error = typical(busy)
    return StepPhases(
        steps=n, step_seconds=mean("step_seconds"), data_wait_seconds=mean("data_wait_seconds"),
        h2d_seconds=None, forward_seconds=mean("forward_seconds"), backward_seconds=mean("backward_seconds"),
        exposed_comm_seconds=mean("exposed_comm_seconds"), optimizer_seconds=mean("optimizer_seconds"),
        other_seconds=mean("other_seconds"), busy_seconds=typical_busy,
        busy_spread_seconds=statistics.median(abs(b - middle) for b in busy), busy_error_seconds=error,
        micro_steps=sum(r.micro_steps for r in rows) / n,
    )


TRIM = 0.2


def typical(values: list[float]) -> tuple[float, float]:
    """The 20%-trimmed mean of ``values`` and its standard error (Tukey and McLaughlin: the
    winsorized standard deviation over (1 - 2 x the share trimmed) x sqrt(n)). As robust to
    a few slow steps as a median, and as precise as a mean on ordinary jitter: on
    benchmarks/stragglers.py it named more stragglers, and fewer healthy ranks, than the
    median and its absolute deviation."""
    ordered = sorted(values)
    n = len(ordered)
    cut = int(TRIM * n)
    low, high = ordered[cut], ordered[n - 1 - cut]
    trimmed = ordered[cut:n - cut]
    winsorized = [min(max(v, low), high) for v in ordered]
    middle = sum(winsorized) / n
    deviation = math.sqrt(sum((v - middle) ** 2 for v in winsorized) / (n - 1)) if n > 1 else 0.0
    return sum(trimmed) / len(trimmed), deviation / (len(trimmed) / n * math.sqrt(n))
