"""A step's parts and who is slow: one home, pure and torch-free, for the rank, the doctor,
``top``, the end-of-run summary, the report and ``compare``.

A step's wall time splits into parts (``PARTS``) that sum to it: ``other`` is what the
measured parts leave (``balance``). A rank's *busy* time is its step less the time it waits
for the other ranks (exposed communication). DDP evens out step times (the fast ranks wait in
the gradient all-reduce for the slow one), so the slow rank shows the longest busy time and
its peers show the cost as waiting: comparing busy times blames the rank that is slow, not
the ones that wait.

Per rank: ``score = gap / baseline``, said as "N% slower" (``slower``) wherever a user reads
it. Ranks are compared step by step (``scores``): in each of the last steps, a rank's busy
time against the median of the other ranks' busy times in that same step. What slows every
rank at once (another job on the machine, a shared core, a slow first step) then cancels
out, and only what is the rank's own remains: the gap is a trimmed mean of those per-step
differences, robust to the heavy tail of scheduling (a rank descheduled for 30 ms in one step
is not 30 ms slower), and its noise is the standard error of that mean. A rank is a
straggler when its score is at least ``SCORE_WARN`` and its gap stands out of zero by
Student's t (``critical_value``, with a margin that grows with the ranks compared), over the
last 20, 50 or 150 steps (``SCORE_WINDOWS``): a short
window names a straggler within 20 steps on a quiet machine, a long one names it through a
busy machine's noise; the shortest window that names it gives its score and cause. The
cause is the part whose own per-step excess explains most of the gap. Files of an older ddpmon, without the steps one by one, are compared on their means.
"""

from __future__ import annotations

import bisect
import math
import operator
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .state.schema import RecentSteps, StepParts


@dataclass(frozen=True)
class Part:
    """A part of a step and how every reader names it: the key (``<name>_seconds`` in the
    state file, the history and the report), the words a sentence uses (the doctor, the
    report's legend, ``compare``), ``top``'s column heading and the report's colour."""

    name: str
    label: str
    column: str
    colour: str
    waiting: bool = False
    """Time spent waiting for the other ranks, not the rank's own work (busy time)."""


PART_TABLE = (
    Part("data_wait", "data wait", "data", "#8c564b"),
    Part("h2d", "host-to-device copies", "h2d", "#e377c2"),
    Part("forward", "forward", "fwd", "#1f77b4"),
    Part("backward", "backward", "bwd", "#2ca02c"),
    Part("exposed_comm", "exposed communication", "comm", "#d62728", waiting=True),
    Part("optimizer", "optimizer step", "optim", "#9467bd"),
    Part("other", "other work", "other", "#7f7f7f"),
)
"""The parts of a step, in the order they stack up to its wall time (``h2d`` only where
visible): the one table every reader of a step's parts names them from."""
PARTS = tuple(p.name for p in PART_TABLE)


@dataclass(frozen=True)
class Gap:
    """A stretch of a step between two of ddpmon's hooks, named by where it lies: the
    ``other`` part is made of these. The loop runs code of its own there (``nanoGPT``
    fetches its next batch between forward and backward); ddpmon says where, not what."""

    name: str
    label: str
    stages: tuple[str, ...]
    """The stages (``schema.Stage``) the training thread is in meanwhile: the stack samples
    taken there (``schema.StackSamples``) show what runs in it."""


GAP_TABLE = (
    Gap("after_forward", "between forward and backward", ("after_forward",)),
    Gap(
        "between_micro_steps",
        "between a backward and the next micro-step's forward",
        ("backward", "after_backward"),
    ),
    Gap("before_optimizer", "between backward and the optimizer step", ("after_backward",)),
    Gap("after_optimizer", "after the optimizer step", ("after_optimizer",)),
)
"""Where the time of ``other`` lies, in step order (``StepRow.gaps``, ``StepParts.gaps``)."""
GAPS = tuple(g.name for g in GAP_TABLE)
GAP_LABELS = {g.name: g.label for g in GAP_TABLE}
PART_STAGES = {
    "data_wait": ("after_optimizer", "after_backward", "first_step"),
    "forward": ("forward",),
    "backward": ("backward", "allreduce"),
    "optimizer": ("optimizer",),
    "other": ("after_forward", "after_backward", "after_optimizer"),
}
"""The stages the training thread is in during each busy part: where to look among its stack
samples for what the part is made of (a gap's own ``stages`` say it more precisely)."""
PART_LABELS = {p.name: p.label for p in PART_TABLE}
WAITING_PARTS = frozenset(p.name for p in PART_TABLE if p.waiting)
"""Parts spent waiting for the other ranks; the rest of a step is the rank's busy time."""
BUSY_PARTS = tuple(p for p in PARTS if p not in WAITING_PARTS)
"""The parts of a step that are the rank's own work."""
SCORE_WARN = 0.05
"""A rank 5% slower than its peers' median is a straggler when the gap also stands out of
its noise: below the 10% that matters, so that a rank 10% slower is named whatever the
noise of its measurement (benchmarks/stragglers.py chose these constants)."""
MIN_GAP_SECONDS = 0.001
MIN_STEPS = 10
"""Fewer steps than this are not compared."""
SCORE_WINDOWS = (20, 50, 150)
"""The last steps each rank is compared over (``_telling`` picks one)."""
PART_STEPS = 20
"""The last steps ``StepParts``' means describe."""
WARMUP_STEPS = 5
"""The job's first steps (allocations, DDP's bucket rebuild, cold caches) are left out."""
TRIM = 0.1
"""The share of the smallest and of the largest values a trimmed mean leaves out."""
FALSE_ALARM = 1e-4
"""The chance that one comparison of a healthy job names any of its ranks (Student's t, the
margin shared out over every rank and window tested, so that a thousand ranks are no likelier
to see a healthy one named than two): zero healthy ranks named in benchmarks/stragglers.py,
quiet or beside a CPU hog, while the doctor, ``top`` and every rank compare each second."""
SUSTAIN_SECONDS = 12.0
"""How long a rank's gap must hold before it is named: a busy machine's scheduler slows one
rank, then another, for seconds at a time (up to about 8 s measured beside two CPU hogs on
two cores, longer than the 150 steps of a fast job), while a straggler is slower for as long
as one looks (``sustained``)."""
SUSTAIN_BLOCKS = 3
"""The consecutive blocks of ``SUSTAIN_SECONDS`` in each of which the gap must hold."""
CAUSE_SHARE = 0.5
"""A part explaining at least half of the gap is named the cause."""


@dataclass(slots=True)
class StepRow:
    """One finished step of a rank: when, how long, and its parts in seconds (``PARTS``:
    they sum to ``step_seconds``, ``other`` taking up what the measured parts leave). The
    rank keeps its recent rows; its history file stores them; ``step_parts`` scores them."""

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
    samples: int = 0
    """The first dimension of the model's first input, summed over the step's forwards."""
    tokens: int = 0
    """Elements of that input where it is a 2-D integer tensor (token ids), else 0."""
    gaps: tuple[float, ...] | None = None
    """Seconds of each gap between hooks (``GAPS``, in order): where ``other`` lies."""

    def part(self, name: str) -> float | None:
        """Seconds of the part ``name`` (one of ``PARTS``)."""
        seconds: float | None = getattr(self, name + "_seconds")
        return seconds

    def set_part(self, name: str, seconds: float | None) -> None:
        setattr(self, name + "_seconds", seconds)

    def history(self) -> dict[str, Any]:
        """The row as the history file stores it (``state/history.HistoryStore.add_steps``)."""
        out = {name: getattr(self, name) for name in _HISTORY_FIELDS}
        if self.buckets is not None:
            out["buckets"] = [{"index": i, "seconds": s, "bytes": b} for i, s, b in self.buckets]
        return out


_HISTORY_FIELDS = (
    "step",
    "start_unix",
    "end_unix",
    "step_seconds",
    *(p + "_seconds" for p in PARTS),
)


def balance(row: StepRow) -> None:
    """Set ``other`` to what the measured parts leave of the step's wall time."""
    known = sum(row.part(p) or 0.0 for p in PARTS if p != "other")
    row.other_seconds = max(0.0, row.step_seconds - known)


def busy_seconds(row: StepRow) -> float:
    """The step's time minus its waiting for the other ranks."""
    waiting = 0.0
    for name in _WAITING_ATTRIBUTES:
        waiting += getattr(row, name) or 0.0
    return max(0.0, row.step_seconds - waiting)


_WAITING_ATTRIBUTES = tuple(p + "_seconds" for p in PARTS if p in WAITING_PARTS)
_BUSY_ATTRIBUTES = tuple(p + "_seconds" for p in BUSY_PARTS)


def slower(score: float) -> str:
    """A score as users read it everywhere: "37% slower" (or "4% faster")."""
    return f"{score * 100:.0f}% slower" if score >= 0 else f"{-score * 100:.0f}% faster"


def over(steps: int, whole: bool = False) -> str:
    """The window a score describes, said beside it wherever a user reads one (the doctor,
    ``top``, the report, ``compare``), so that two figures of one run that differ say why:
    "over its last 50 steps", or "over the whole run (1200 steps)"."""
    return f"over the whole run ({steps} steps)" if whole else f"over its last {steps} steps"


@dataclass
class Score:
    """One rank against the median of the others."""

    rank: int
    score: float
    busy_seconds: float
    baseline_seconds: float
    noise_seconds: float
    """The standard error of the gap."""
    steps: int = 0
    """The steps compared."""
    comparisons: int = 1
    """The gaps tested alongside this one (ranks x windows; two ranks count as one, each
    one's gap being the other's mirrored), which widen its margin."""
    shares: dict[str, float] = field(default_factory=dict)
    """Of the gap, the share each part explains (excess over the peers' median, 0..1); only
    for a rank at least ``SCORE_WARN`` slower, or the slowest."""
    excess: dict[str, float] = field(default_factory=dict)
    """Seconds per step each part takes over the peers' median (as ``shares``)."""

    @property
    def gap_seconds(self) -> float:
        return self.busy_seconds - self.baseline_seconds

    @property
    def margin_seconds(self) -> float:
        """How far above zero the gap must stand to be out of its noise."""
        return critical_value(self.steps, self.comparisons) * self.noise_seconds

    @property
    def straggler(self) -> bool:
        return (
            self.score >= SCORE_WARN
            and self.gap_seconds >= MIN_GAP_SECONDS
            and self.gap_seconds >= self.margin_seconds
        )

    @property
    def cause(self) -> str | None:
        """The part that explains at least ``CAUSE_SHARE`` of the gap, or None."""
        if not self.shares:
            return None
        part = max(self.shares, key=lambda p: self.shares[p])
        return part if self.shares[part] >= CAUSE_SHARE else None


def scores(parts: dict[int, StepParts], whole: bool = False) -> dict[int, Score]:
    """Each rank's score against the others; ranks with fewer than ``MIN_STEPS`` steps are
    left out, and so is everything when fewer than two ranks remain. ``whole``: over every
    step the ranks share (a whole run), not the last 20, 50 or 150. Every median of the
    other ranks comes from one sorted list per step and quantity, so a thousand ranks cost
    a fraction of a second."""
    ranks = {r: p for r, p in parts.items() if p is not None and p.steps >= MIN_STEPS}
    if len(ranks) < 2:
        return {}
    if all(p.recent is not None for p in ranks.values()):
        common = set.intersection(*(set(p.recent.step) for p in ranks.values()))  # type: ignore[union-attr]
        if len(common) >= MIN_STEPS:
            return _step_by_step(ranks, sorted(common), whole)
    return _on_means(ranks)


def _step_by_step(
    ranks: dict[int, StepParts], common: list[int], whole: bool = False
) -> dict[int, Score]:
    """``scores`` on the steps every rank has, each compared with the same step's others."""
    where = {r: _positions(p.recent.step, common) for r, p in ranks.items()}  # type: ignore[union-attr]

    def columns(name: str) -> dict[int, list[float]]:
        out = {}
        for r, p in ranks.items():
            values = getattr(p.recent, name)
            at = where[r]
            out[r] = values[at] if isinstance(at, slice) else [values[i] for i in at]
        return out

    busy_values = columns("busy_seconds")
    busy_others = _OthersMedian(busy_values)
    busy = {r: _against_others(v, busy_others.of(v)) for r, v in busy_values.items()}
    windows = (
        [len(common)]
        if whole
        else sorted({min(w, len(common)) for w in SCORE_WINDOWS} | {len(common)})
    )
    comparisons = (len(ranks) if len(ranks) > 2 else 1) * len(
        windows
    )  # two ranks' gaps are one, mirrored
    out = {}
    for rank, (diffs, baselines) in busy.items():
        tested = []
        for w in windows:
            excess, error = typical(diffs[-w:])
            baseline = typical(baselines[-w:])[0]
            tested.append(
                Score(
                    rank,
                    busy_ratio(baseline + excess, baseline),
                    baseline + excess,
                    baseline,
                    error,
                    w,
                    comparisons,
                )
            )
        out[rank] = _telling(tested)
    top = max(out.values(), key=lambda s: s.score)
    explained = [s for s in out.values() if s.score >= SCORE_WARN or s is top]
    parts = {
        part: (values, _OthersMedian(values))
        for part in BUSY_PARTS
        for values in [columns(part + "_seconds")]
    }
    for s in explained:
        _explain(
            s,
            {
                part: typical(
                    _against_others(values[s.rank], others.of(values[s.rank]))[0][-s.steps :]
                )[0]
                for part, (values, others) in parts.items()
            },
        )
    return out


@dataclass(frozen=True)
class Held:
    """How a rank's gap held over its last ``SUSTAIN_SECONDS``: the seconds its compared
    steps span and its score in each of ``SUSTAIN_BLOCKS`` consecutive blocks, oldest first."""

    seconds: float
    """The seconds the steps compared span (at most ``SUSTAIN_SECONDS`` of them in blocks)."""
    blocks: tuple[float, ...]

    @property
    def blocks_seconds(self) -> float:
        """The last seconds the blocks share out."""
        return min(self.seconds, SUSTAIN_SECONDS)

    @property
    def held(self) -> bool:
        return (
            self.seconds >= SUSTAIN_SECONDS
            and bool(self.blocks)
            and all(b >= SCORE_WARN for b in self.blocks)
        )


def sustained(series: dict[int, dict[str, list[Any]]], rank: int) -> Held:
    """Whether ``rank``'s gap lasts: over the steps every rank has in ``series`` (per rank:
    ``step``, ``end_unix``, ``busy_seconds``, as ``state.history.busy_since`` reads them),
    its last ``SUSTAIN_SECONDS`` split into ``SUSTAIN_BLOCKS`` consecutive blocks of equal
    time (a job's fast steps before a slow phase do not crowd a block; steps so long that a
    block would hold fewer than two: blocks of as many steps), and its score in each
    (trimmed means, step by step against the others' median, as ``scores``). A straggler is
    named only when it is at least ``SCORE_WARN`` slower in every block and the steps span
    ``SUSTAIN_SECONDS``, a job that ended sooner included: like memory creep, which must grow
    in both halves of its window, a gap that one burst of scheduling explains does not hold
    in all of them."""
    common = sorted(
        set.intersection(*(set(s["step"]) for s in series.values())) - set(range(WARMUP_STEPS + 1))
    )
    if len(common) < SUSTAIN_BLOCKS * 2:
        return Held(0.0, ())
    values = {}
    for r, s in series.items():
        busy = dict(zip(s["step"], s["busy_seconds"]))
        values[r] = [busy[step] for step in common]
    end = dict(zip(series[rank]["step"], series[rank]["end_unix"]))
    ends = [end[step] for step in common]
    diffs, baselines = _against_others(values[rank], _OthersMedian(values).of(values[rank]))
    span = min(ends[-1] - ends[0], SUSTAIN_SECONDS)
    start = ends[-1] - span  # the blocks share the last ``span`` seconds out by time
    cuts = [
        bisect.bisect_left(ends, start + i * span / SUSTAIN_BLOCKS) for i in range(SUSTAIN_BLOCKS)
    ]
    bounds = list(zip(cuts, [*cuts[1:], len(ends)]))
    if any(b - a < 2 for a, b in bounds):  # long steps: blocks of as many steps
        size = len(ends) / SUSTAIN_BLOCKS
        bounds = [(round(i * size), round((i + 1) * size)) for i in range(SUSTAIN_BLOCKS)]
    blocks = []
    for a, b in bounds:
        baseline = typical(baselines[a:b])[0]
        blocks.append(busy_ratio(baseline + typical(diffs[a:b])[0], baseline))
    return Held(ends[-1] - ends[0], tuple(blocks))


def _positions(have: list[int], wanted: list[int]) -> slice | list[int]:
    """Where the steps ``wanted`` are in ``have``: a slice when they are its last ones (ranks
    in step, the usual case)."""
    n = len(wanted)
    if have[-n:] == wanted:
        return slice(len(have) - n, len(have))
    index = {step: i for i, step in enumerate(have)}
    return [index[step] for step in wanted]


def _against_others(mine: list[float], others: list[float]) -> tuple[list[float], list[float]]:
    """A rank's values less the others' median, step by step, and that median."""
    return [v - o for v, o in zip(mine, others)], others


class _OthersMedian:
    """Step by step, the median of every rank's value but one. Leaving one value out of a
    step's sorted values leaves one of at most three medians, picked by where the value
    falls, so each rank costs two comparisons per step, not a sort: a thousand ranks'
    150 steps take milliseconds."""

    def __init__(self, values: dict[int, list[float]]) -> None:
        self._table = [self._answers(sorted(step)) for step in zip(*values.values())]

    @staticmethod
    def _answers(a: list[float]) -> tuple[float, float, float, float, float]:
        """(low, high, above high, between, not above low): the medians of ``a`` without a
        value above ``high``, between the two, or not above ``low``."""
        k = (len(a) - 1) // 2
        if len(a) % 2 == 0:  # an odd number of others: their middle one
            return a[k], a[k], a[k], a[k], a[k + 1]
        return (
            a[k - 1],
            a[k],
            (a[k - 1] + a[k]) / 2,
            (a[k - 1] + a[k + 1]) / 2,
            (a[k] + a[k + 1]) / 2,
        )

    def of(self, mine: list[float]) -> list[float]:
        """The others' median in each step, ``mine`` being one rank's values."""
        return [
            above if v > high else (between if v > low else below)
            for v, (low, high, above, between, below) in zip(mine, self._table)
        ]


def _telling(tested: list[Score]) -> Score:
    """Of one rank's windows (shortest first), the shortest that makes it a straggler: the
    most recent evidence, so that its score and cause are what the rank does now (a rank
    slow in its forward, then in its backward, is named for its backward). When none does,
    the one whose gap stands furthest out of its noise."""
    named = [s for s in tested if s.straggler]
    if named:
        return named[0]
    return max(
        tested,
        key=lambda s: s.gap_seconds / s.margin_seconds if s.margin_seconds > 0 else -math.inf,
    )


def _explain(s: Score, excess: dict[str, float]) -> None:
    """Set the excess of each part and the share of the gap it explains."""
    s.excess = excess
    gap = sum(e for e in excess.values() if e > 0)
    s.shares = {part: max(0.0, e) / gap for part, e in excess.items()} if gap > 0 else {}


def _on_means(ranks: dict[int, StepParts]) -> dict[int, Score]:
    """``scores`` from each rank's means alone (files of an older ddpmon): the gap between
    two trimmed means, and the standard error of their difference."""
    values = {
        "busy": {r: p.busy_seconds for r, p in ranks.items()},
        "error": {r: _error(p) for r, p in ranks.items()},
        **{part: {r: _part(p, part) for r, p in ranks.items()} for part in BUSY_PARTS},
    }
    ordered = {name: sorted(by_rank.values()) for name, by_rank in values.items()}

    def others(name: str, rank: int) -> float:
        return median_of_others(ordered[name], values[name][rank])

    out = {}
    for rank, mine in ranks.items():
        baseline = others("busy", rank)
        noise = math.sqrt(2.0) * max(values["error"][rank], others("error", rank))
        s = Score(
            rank,
            busy_ratio(mine.busy_seconds, baseline),
            mine.busy_seconds,
            baseline,
            noise,
            mine.steps,
            len(ranks),
        )
        _explain(s, {part: values[part][rank] - others(part, rank) for part in BUSY_PARTS})
        out[rank] = s
    return out


def critical_value(steps: int, comparisons: int = 1) -> float:
    """How many standard errors a gap over ``steps`` steps, one of ``comparisons``, must stand
    out of zero: Student's t quantile at ``FALSE_ALARM / comparisons`` for a trimmed mean's
    degrees of freedom (the kept steps less one; a Cornish-Fisher expansion, within 1% of the
    exact quantile from 20 steps on, 10% at 10). Few steps make a noisy noise estimate, so a
    short window needs a wider margin."""
    df = max(1, steps - 2 * int(TRIM * steps) - 1)
    z = statistics.NormalDist().inv_cdf(1.0 - FALSE_ALARM / max(1, comparisons))
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


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


def _error(p: StepParts) -> float:
    """The standard error of a rank's busy time; from an older ddpmon, which wrote a median
    and its absolute deviation, that of a median."""
    if p.busy_error_seconds is not None:
        return p.busy_error_seconds
    return 1.2533 * 1.4826 * p.busy_spread_seconds / math.sqrt(p.steps)


def _part(p: StepParts, part: str) -> float:
    return getattr(p, part + "_seconds") or 0.0


def step_parts(rows: list[StepRow], whole: bool = False) -> StepParts | None:
    """What a rank's steps (``Recorder.history_since`` rows) say for its score: mean seconds
    per step of each part over the last ``PART_STEPS`` (means, so that they sum to the mean
    step), the typical busy time with its standard error (``typical``), and the last
    ``SCORE_WINDOWS[-1]`` steps one by one. The job's first ``WARMUP_STEPS`` are left out
    while enough steps remain; ``whole``: every row, for a whole run."""
    later = [r for r in rows if r.step > WARMUP_STEPS]
    if len(later) >= MIN_STEPS:
        rows = later
    if not rows:
        return None
    last = rows if whole else rows[-PART_STEPS:]
    n = len(last)

    def mean(name: str) -> float:
        return sum(getattr(r, name) or 0.0 for r in last) / n

    gapped = [r.gaps for r in last if r.gaps is not None]
    gaps = {name: sum(g[i] for g in gapped) / n for i, name in enumerate(GAPS)} if gapped else {}
    busy = [busy_seconds(r) for r in last]
    middle = statistics.median(busy)
    typical_busy, error = typical(busy)
    return StepParts(
        steps=n,
        step_seconds=mean("step_seconds"),
        data_wait_seconds=mean("data_wait_seconds"),
        h2d_seconds=None,
        forward_seconds=mean("forward_seconds"),
        backward_seconds=mean("backward_seconds"),
        exposed_comm_seconds=mean("exposed_comm_seconds"),
        optimizer_seconds=mean("optimizer_seconds"),
        other_seconds=mean("other_seconds"),
        busy_seconds=typical_busy,
        busy_spread_seconds=statistics.median(abs(b - middle) for b in busy),
        busy_error_seconds=error,
        micro_steps=sum(r.micro_steps for r in last) / n,
        gaps=gaps,
        recent=recent_steps(rows if whole else rows[-SCORE_WINDOWS[-1] :]),
    )


def recent_steps(rows: list[StepRow]) -> RecentSteps:
    """The rows one by one, rounded to the microsecond (the state file is rewritten every second)."""

    # (round(x * 1e6) / 1e6: the same float as round(x, 6) to the microsecond, at a fifth of
    # its cost, for 150 rows every second)
    return RecentSteps(
        step=[r.step for r in rows],
        busy_seconds=[round(busy_seconds(r) * 1e6) / 1e6 for r in rows],
        **{
            name: [round(v * 1e6) / 1e6 for v in column]
            for name, column in zip(_BUSY_ATTRIBUTES, columns(rows, _BUSY_ATTRIBUTES))
        },
    )


def columns(rows: Sequence[StepRow], names: tuple[str, ...]) -> list[list[float]]:
    """Each of the (two or more) attributes ``names`` over ``rows``, None as 0, from one read
    of each row: a rank's state writer sums its recent rows up every second, holding the GIL
    the training thread needs."""
    if not rows:
        return [[] for _ in names]
    get = operator.attrgetter(*names)
    return [[v or 0.0 for v in column] for column in zip(*map(get, rows))]


def typical(values: list[float]) -> tuple[float, float]:
    """The trimmed mean of ``values`` (``TRIM``) and its standard error (Tukey and McLaughlin:
    the winsorized standard deviation over (1 - 2 x the share trimmed) x sqrt(n)). As robust
    to a few slow steps as a median, and as precise as a mean on ordinary jitter: on
    benchmarks/stragglers.py it named more stragglers, and fewer healthy ranks, than the
    median and its absolute deviation."""
    ordered = sorted(values)
    n = len(ordered)
    cut = int(TRIM * n)
    trimmed = ordered[cut : n - cut]
    winsorized = [trimmed[0]] * cut + trimmed + [trimmed[-1]] * cut
    middle = sum(winsorized) / n
    deviation = math.sqrt(sum((v - middle) ** 2 for v in winsorized) / (n - 1)) if n > 1 else 0.0
    return sum(trimmed) / len(trimmed), deviation / (len(trimmed) / n * math.sqrt(n))
