"""memory_creep (warning): a rank's memory, or its DataLoader workers', grows step after step.

The rank fits each series' trend (``ddpmon/memory.py``); this rule names the ranks where one
creeps, with the rate, the time left before the limit it runs into, and the cause where the
pattern is known: workers that grow together (copy-on-read), torch's reserved memory
growing while its allocated memory is flat (fragmentation). A rise that came once and
stayed flat is not named (the trend is not ``sustained``).
"""

from __future__ import annotations

from ... import memory
from ...formats import format_bytes, format_time_left
from ...state.schema import MemoryTrend
from .. import words
from ..findings import Finding
from ..view import RankView


def memory_creep(v: RankView, suspects: list[int]) -> Finding | None:
    """memory_creep: a series of this rank creeps (``memory.creeping``): name it, its rate
    and its time left, worst first."""
    trends = v.state.memory.trends
    creeping = [t for t in trends if memory.creeping(t)]
    if not creeping:
        return None
    gpu = {t.kind: t for t in trends if t.kind.startswith("torch_")}
    workers = {t.pid for t in trends if t.process == "worker"}
    growing_workers = sorted({t.pid for t in creeping if t.process == "worker"})
    head = max(creeping, key=_urgency)
    who = (
        f"rank {v.rank}'s DataLoader worker (pid {head.pid})"
        if head.process == "worker"
        else f"rank {v.rank}"
    )
    summary = f"{who}: {memory.KINDS[head.kind]} grows {rate(head)}"
    left = memory.seconds_left(head)
    if left is not None and head.limit is not None:
        summary += (
            f"; about {format_time_left(left)} left before {memory.LIMITS[head.limit]} "
            f"({format_bytes(head.headroom_bytes or 0)} free)"
        )
    if len(growing_workers) > 1:
        summary += f"; {len(growing_workers)} of its {len(workers)} workers grow together"
    if head.process == "worker":  # together: every worker, or more than one
        together = len(growing_workers) > 1 or len(growing_workers) == len(workers)
        fix = words.FIX_COPY_ON_READ if together else words.FIX_WORKER_LEAK
    elif head.kind == "torch_reserved" and not _grows(gpu.get("torch_allocated")):
        fix = words.FIX_FRAGMENTATION
    elif head.kind.startswith("torch_"):
        fix = words.FIX_TENSORS_KEPT
    else:
        fix = words.FIX_HOST_LEAK
    return Finding(
        "memory_creep",
        "warning",
        [v.rank],
        summary,
        evidence=[evidence_line(v.rank, t) for t in sorted(creeping, key=_urgency, reverse=True)],
        fix=fix,
    )


def rate(t: MemoryTrend) -> str:
    """``4.0 MB a step (1.44 GB an hour)``."""
    text = f"{format_bytes(t.bytes_per_step or 0)} a step"
    if t.bytes_per_second:
        text += f" ({format_bytes(t.bytes_per_second * 3600)} an hour)"
    return text


def evidence_line(rank: int, t: MemoryTrend) -> str:
    """One creeping series: whose, which, how much now, how fast, over what."""
    whose = f"rank {rank}" + (f" worker pid {t.pid}" if t.process == "worker" else "")
    return (
        f"{whose} {t.kind}: {format_bytes(t.bytes)} now, +{rate(t)}, over its last "
        f"{t.steps} steps ({t.samples} samples)"
    )


def _urgency(t: MemoryTrend) -> tuple[float, float]:
    """Soonest at its limit first, then fastest."""
    left = memory.seconds_left(t)
    return (-(left if left is not None else float("inf")), t.bytes_per_step or 0.0)


def _grows(t: MemoryTrend | None) -> bool:
    """Whether ``t`` grows at all over its window (a quarter of the creep rate)."""
    return (
        t is not None
        and t.bytes_per_step is not None
        and t.bytes_per_step >= memory.CREEP_BYTES_PER_STEP / 4
    )
