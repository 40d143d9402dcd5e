"""Every rank waits in the same collective: missing_rank, gpu_behind, comm_hang (verdict
hang).

When all ranks the doctor sees wait in one collective (the same group, sequence number and
op, or one rank a collective ahead after completing it), none of them is behind on the
host. Either the group has members without a state file here, which are then the ones the
others wait for (missing_rank); or a rank's GPU has not started the collective, still
running work enqueued before it (gpu_behind: NCCL's flight recorder counts the collectives
each GPU started; a kernel that never ends looks like this); or the collective itself does
not complete: the network or the communication library (comm_hang, no suspect rank), once
every rank that waits in it has waited as long as a stall takes (a rank that joined the
others' long wait a moment ago, after an evaluation of its own, is still stepping, and the
collective may yet complete).
"""

from __future__ import annotations

from .. import words
from ..findings import Finding, Verdict
from ..view import STALLED, RankView, gpu_not_started
from .common import in_collectives, key, same_collective, stalled


def _unseen(waiting: list[RankView], missing: list[int]) -> list[int]:
    """Ranks without a state file that belong to the group the others wait in."""
    e = next(v.waiting for v in waiting if v.waiting)
    size = e.group_size or 0
    return [r for r in missing if size == 0 or size > len(waiting)]


def _waiting_in_one(views: list[RankView]) -> list[RankView] | None:
    if not stalled(views):
        return None
    waiting = in_collectives(views)
    return waiting if same_collective(waiting) else None


def missing_rank(views: list[RankView], missing: list[int]) -> Verdict | None:
    waiting = _waiting_in_one(views)
    if waiting is None:
        return None
    unseen = _unseen(waiting, missing)
    if not unseen:
        return None
    entries = [v.rank for v in waiting if v.waiting]
    e = next(v.waiting for v in waiting if v.waiting)
    return Verdict(
        "hang",
        unseen,
        [
            Finding(
                "missing_rank",
                "error",
                unseen,
                f"{words.who(entries)} {words.verb(entries, 'waits', 'wait')} in {words.entry_name(e)}; the "
                f"group has {e.group_size or 'more'} members and {words.who(unseen)} "
                f"{words.verb(unseen, 'has', 'have')} no state file here",
                [words.wait_line(v) for v in waiting]
                + [f"no state file for ranks {words.ranks(missing)}"],
                words.fix_missing_rank(unseen),
            )
        ],
    )


def gpu_behind(views: list[RankView], missing: list[int]) -> Verdict | None:
    waiting = _waiting_in_one(views)
    if waiting is None or _unseen(waiting, missing):
        return None
    behind = sorted(v.rank for v in waiting if gpu_not_started(v))
    if not behind:
        return None
    e = next(v.waiting for v in waiting if v.waiting)
    evidence = [words.wait_line(v) for v in waiting] + words.flight_recorder_lines(waiting)
    evidence += [
        f"rank {v.rank}: {words.gpu_wait(act.gpu_behind_seconds)}, its watchdog says (at {act.where or '?'})"
        for v in waiting
        if v.rank in behind and (act := v.state.activity) and act.gpu_behind_seconds
    ]
    return Verdict(
        "hang",
        behind,
        [
            Finding(
                "gpu_behind",
                "error",
                behind,
                f"the GPU of {words.who(behind)} has not started {words.entry_name(e)}: it still runs work "
                "enqueued before it, so the collective cannot complete",
                evidence,
                words.fix_gpu_behind(behind),
            )
        ],
    )


def _just_joined(waiting: list[RankView]) -> bool:
    """A rank not stalled waits in the collective the stalled ones wait in: it joined a
    moment ago (after an evaluation of its own, say), and the collective may yet complete."""
    held = {key(v.waiting) for v in stalled(waiting) if v.waiting}
    return any(
        v.waiting is not None and key(v.waiting) in held for v in waiting if v.status not in STALLED
    )


def comm_hang(views: list[RankView], missing: list[int]) -> Verdict | None:
    waiting = _waiting_in_one(views)
    if waiting is None or _unseen(waiting, missing) or _just_joined(waiting):
        return None
    entries = [v.rank for v in waiting if v.waiting]
    e = next(v.waiting for v in waiting if v.waiting)
    evidence = [words.wait_line(v) for v in waiting]
    backend, debug_level = waiting[0].state.backend, waiting[0].state.debug_level
    if "nccl" in str(backend):
        evidence += words.flight_recorder_lines(waiting)
    return Verdict(
        "hang",
        [],
        [
            Finding(
                "comm_hang",
                "error",
                sorted(entries),
                f"all ranks wait in {words.entry_name(e)} and none is behind: the collective itself "
                "does not complete (network or communication library)",
                evidence,
                words.fix_comm(backend, debug_level),
            )
        ],
    )
