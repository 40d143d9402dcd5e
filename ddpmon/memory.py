"""Memory that creeps: the robust trend of a memory series and the rule that calls it a leak.

One home for the arithmetic and the thresholds: the rank computes trends from the samples it
takes (``rank/memory.py``), the doctor judges them (``doctor/rules/memory_creep.py``), the
report shows them. The slope is Theil-Sen's, the median of the slopes between every pair of
samples: noise and a few odd readings do not move it. A rise that comes once and stays flat
(a cache filled, a buffer grown) still tilts that median when it falls near the middle of
the samples, so the trend is the median of the slopes of the window's three thirds: such a
rise lies within one third at most, and the other two are flat. It creeps only when every
third grows (``robust_slope``). Torch-free.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import NamedTuple

from .state.schema import MemoryTrend

WINDOW = 48
"""Samples a trend is computed over (at most). The rank samples every ``SAMPLE_STEPS``
steps; a full window whose samples are closer than a state interval apart is ``thinned``
and the rank samples half as often, until its samples are a state interval apart: fast
steps are judged within their first hundred, and a long run's window spans minutes."""
SAMPLE_STEPS = 4
"""Steps between two samples of a window that is not yet thinned."""
WARMUP_STEPS = 10
"""Steps left out at the start: memory grows while a job warms up (allocator pools,
caches, the first batches)."""
MIN_SAMPLES = 12
"""Samples before a trend is judged at all."""
MIN_STEPS = 24
"""Steps a window spans before a per-step slope is given."""
CREEP_BYTES_PER_STEP = 1 << 20
"""A series creeps from 1 MiB a step: a job of 10,000 steps would grow 10 GiB."""
NOISE_FACTOR = 4.0
"""The growth over the window must exceed this many times the readings' noise."""
MIB = 1 << 20


class Point(NamedTuple):
    """One reading of a series: the step count and the wall clock when it was taken."""

    step: int
    unix: float
    bytes: int


def thinned(points: Sequence[Point]) -> list[Point]:
    """Every other point of a window, the newest kept: half the points over the same span."""
    return list(points)[(len(points) - 1) % 2 :: 2]


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """The median of the slopes between every pair of points with distinct ``xs``; None
    when there is no such pair."""
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] != xs[i]
    ]
    return statistics.median(slopes) if slopes else None


def trend(
    points: Sequence[Point],
    process: str,
    kind: str,
    pid: int,
    limit: str | None = None,
    headroom_bytes: int | None = None,
) -> MemoryTrend:
    """The trend of one series over ``points`` (oldest first, the window's)."""
    steps = [p.step for p in points]
    ys = [p.bytes for p in points]
    out = MemoryTrend(
        process=process,
        kind=kind,
        pid=pid,
        bytes=ys[-1] if ys else 0,
        samples=len(points),
        steps=(steps[-1] - steps[0]) if steps else 0,
        limit=limit,
        headroom_bytes=headroom_bytes,
    )
    if len(points) < MIN_SAMPLES:
        return out
    out.bytes_per_second, _ = robust_slope([p.unix for p in points], ys)
    if out.steps < MIN_STEPS:
        return out
    slope, out.sustained = robust_slope(steps, ys)
    if slope is None:
        return out
    out.bytes_per_step = slope
    residuals = [y - slope * s for s, y in zip(steps, ys)]
    middle = statistics.median(residuals)
    out.noise_bytes = statistics.median(abs(r - middle) for r in residuals)
    return out


def robust_slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float | None, bool]:
    """(the slope, whether it is sustained) of a window: the median of the Theil-Sen slopes
    of its three thirds. A rise that came once, all at one reading or over a few (a sample
    taken while a buffer was being filled), lies within one third or between two, so at
    least two thirds are flat and so is the median, wherever the rise fell; a steady growth
    gives three alike. Sustained: positive, and every third grows at least half as fast."""
    n = len(xs)
    cuts = (0, round(n / 3), round(2 * n / 3), n)
    thirds = [theil_sen(xs[a:b], ys[a:b]) for a, b in zip(cuts, cuts[1:])]
    if None in thirds:
        return None, False
    low, middle, _ = sorted(t for t in thirds if t is not None)
    return middle, middle > 0 and low >= middle / 2


def creeping(t: MemoryTrend) -> bool:
    """Whether ``t`` is memory that creeps: at least ``CREEP_BYTES_PER_STEP`` a step, in every
    third of its window, and its growth over the window well above the readings' noise."""
    return (
        t.bytes_per_step is not None
        and t.bytes_per_step >= CREEP_BYTES_PER_STEP
        and t.sustained
        and t.bytes_per_step * t.steps > NOISE_FACTOR * t.noise_bytes
    )


def seconds_left(t: MemoryTrend) -> float | None:
    """Seconds before ``t`` reaches its limit at its present rate; None when unknown."""
    if t.headroom_bytes is None or not t.bytes_per_second or t.bytes_per_second <= 0:
        return None
    return max(0.0, t.headroom_bytes / t.bytes_per_second)


KINDS = {
    "rss": "resident memory",
    "pss": "proportional memory (PSS)",
    "torch_allocated": "torch's allocated GPU memory",
    "torch_reserved": "torch's reserved GPU memory",
}
"""Each ``MemoryTrend.kind`` in words."""

LIMITS = {
    "host": "the host's available memory",
    "cgroup": "the cgroup's memory limit",
    "device": "the GPU's memory",
}
"""What each ``MemoryTrend.limit`` is, in words."""
