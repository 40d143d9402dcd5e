"""Notes on one rank: no_stack, ddpmon_part_off (info)."""

from __future__ import annotations

from .. import words
from ..findings import Finding
from ..view import RankView


def no_stack(v: RankView, suspects: list[int]) -> Finding | None:
    """no_stack: a suspect rank whose stack could not be read, and why (py-spy missing or not
    permitted): the answer lacks its most useful piece, and the reader can supply it."""
    if v.rank in suspects and v.stack is None and v.stack_error:
        return Finding(
            "no_stack", "info", [v.rank], f"no live stack of rank {v.rank}: {v.stack_error}"
        )
    return None


def ddpmon_part_off(v: RankView, suspects: list[int]) -> Finding | None:
    """ddpmon_part_off: parts of ddpmon on this rank failed and switched themselves off, so
    some of its facts may be missing (training itself is not affected)."""
    if not v.state.errors:
        return None
    parts = "; ".join(f"{k}: {m}" for k, m in sorted(v.state.errors.items()))
    return Finding(
        "ddpmon_part_off",
        "info",
        [v.rank],
        f"on rank {v.rank}, parts of ddpmon switched themselves off after a failure ({parts})",
        fix=words.FIX_PART_OFF,
    )
