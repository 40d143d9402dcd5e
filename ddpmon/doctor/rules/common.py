"""What several rules ask of the ranks: who is stalled, who takes part in the collectives,
whether they wait in one collective, who works without stepping while others wait, which of
two ranks stands further along in the code they share."""

from __future__ import annotations

from ...activity import Status
from ...state.schema import Collective
from ..view import GONE, STALLED, RankView


def gone(views: list[RankView]) -> list[RankView]:
    return [v for v in views if v.status in GONE]


def stalled(views: list[RankView]) -> list[RankView]:
    return [v for v in views if v.status in STALLED]


def in_collectives(views: list[RankView]) -> list[RankView]:
    """The ranks that wait in a collective, then those that run (and so join it)."""
    return [v for v in views if v.status == Status.WAITING] + [
        v for v in views if v.status == Status.STEPPING
    ]


def key(e: Collective) -> tuple[str, int, str]:
    return (e.group, e.seq, e.op)


def same_collective(waiting: list[RankView]) -> bool:
    """True when the ranks wait in one collective: the same (group, seq, op), or a rank is
    one collective ahead after completing the one the others still wait in."""
    entries = [v.waiting for v in waiting if v.waiting]
    if len({key(e) for e in entries}) == 1:
        return True
    if len({e.group for e in entries}) != 1:
        return False
    low = min(e.seq for e in entries)
    behind = [e for e in entries if e.seq == low]
    if len({e.op for e in behind}) != 1:
        return False
    target = (behind[0].group, low, behind[0].op)
    for v in waiting:
        e = v.waiting
        if e is None or e.seq == low:
            continue
        done = list(v.state.collective_log) + (
            [v.state.last_collective] if v.state.last_collective else []
        )
        if not any(key(c) == target and not c.error for c in done):
            return False
    return True


def evaluating(views: list[RankView]) -> list[RankView]:
    """Ranks that others wait for and that make progress without training: stepping, not
    in the waiting ranks' collectives, no step past theirs. Their progress is forward passes
    without gradients (heartbeats, no step): an evaluation under ``no_grad`` on some ranks
    while the others wait in a barrier. Working, however long (``activity.is_hang``), unless
    the waiting ranks' watchdogs proved a hang."""
    waiting = [v for v in views if v.status == Status.WAITING]
    if not waiting or any(v.state.hang is not None for v in waiting):
        return []
    joined = {(e.group, e.seq) for v in waiting for e in [v.waiting] if e}
    step = min(v.state.step for v in waiting)
    return [
        v
        for v in views
        if v.status == Status.STEPPING
        and v.state.step <= step
        and not any((e.group, e.seq) in joined for e in v.in_flight)
    ]


Frame = tuple[str, str, int, tuple[int, ...] | None]
"""(file, function, line, loop) of a user frame: the first and last line of the innermost
loop the line is in, () when in none, None when not known."""


def position(v: RankView) -> list[Frame] | None:
    """Where the rank stands in its own code, outermost frame first: its watchdog's last
    sample of the main thread (``activity.where``, its callers and their loops), when taken
    in the collective the rank waits in; else the user frames of that collective's call."""
    e = v.waiting
    act = v.state.activity
    lines: list[str] = []
    loops: list[list[int]] = []
    if act is not None and act.where and (e is None or act.sampled_unix >= e.issued_unix):
        lines, loops = [act.where, *act.callers], list(act.loops)
    elif e is not None and e.bucket is None and e.call_site not in ("?", "DDP backward"):
        lines = [f"{e.call_site} in {e.function}", *e.callers]
    frames = [
        f
        for i, line in enumerate(lines)
        if (f := _frame(line, tuple(loops[i]) if i < len(loops) else None)) is not None
    ]
    return frames[::-1] or None


def _frame(line: str, loop: tuple[int, ...] | None) -> Frame | None:
    site, sep, function = line.rpartition(" in ")
    file, _, number = site.rpartition(":")
    if not sep or not file or not number.isdigit():
        return None
    return file, function, int(number), loop


def parting(a: RankView, b: RankView) -> tuple[str, Frame, Frame] | None:
    """Where two ranks at the same step part in the code both run: (``function (file)``,
    ``a``'s frame there, ``b``'s). Their stacks are lined up on the outermost function both
    are in; the first frame where they differ must be in one function, at two lines. None
    when it cannot be told: other steps, no position, or they part into different
    functions."""
    if a.state.step != b.state.step:
        return None
    pa, pb = position(a), position(b)
    if not pa or not pb:
        return None
    start = next(
        ((i, j) for i, fa in enumerate(pa) for j, fb in enumerate(pb) if fa[:2] == fb[:2]), None
    )
    if start is None:
        return None
    for fa, fb in zip(pa[start[0] :], pb[start[1] :]):
        if fa[:3] == fb[:3]:
            continue
        if fa[:2] != fb[:2] or fa[2] == fb[2]:
            return None
        return f"{fa[1]} ({fa[0]})", fa, fb
    return None


def in_step(v: RankView) -> bool:
    """The rank waits in DDP's gradient all-reduce: inside a training step."""
    return v.waiting is not None and v.waiting.bucket is not None


def ahead(a: RankView, b: RankView) -> bool | None:
    """Does rank ``a`` stand further along than rank ``b`` in the code both run, at the same
    step? A later line where they part is further along, with one exception: a rank between
    steps at a later line than a rank inside its training step's all-reduce may be a pass
    behind (at the end of the loop's body, while the other began the next step); it is
    further along only when its line is past that loop. None when it cannot be told
    (``parting``, or that loop not known)."""
    part = parting(a, b)
    if part is None:
        return None
    _, fa, fb = part
    if fa[2] > fb[2] and in_step(b) and not in_step(a):
        return _past_loop(fa, fb)
    if fb[2] > fa[2] and in_step(a) and not in_step(b):
        past = _past_loop(fb, fa)
        return None if past is None else not past
    return fa[2] > fb[2]


def _past_loop(later: Frame, stepping: Frame) -> bool | None:
    """Is the frame at the later line past the loop the stepping rank's frame is in?"""
    loop = stepping[3]
    if loop is None or (loop and len(loop) != 2):
        return None
    return not loop or later[2] > loop[1]


def behind(sides: list[list[RankView]]) -> list[RankView] | None:
    """Of two sides of ranks that issued different collectives, the one every rank of the
    other side stands further along than: the others went past the place where it issued
    its collective without issuing it, so its collective is the one too many (a
    rank-conditional call, or one more training step on more batches). None when the
    ranks do not tell."""
    if len(sides) != 2:
        return None
    first, second = sides
    votes = {ahead(a, b) for a in first for b in second}
    if votes == {True}:
        return second
    if votes == {False}:
        return first
    return None
