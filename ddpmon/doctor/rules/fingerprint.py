"""mismatch (verdict desync): the ranks issued different collectives under one sequence number.

Every rank numbers the collectives of a process group in order, so ``all_reduce #14`` must
be the same call on every rank: same op, same dtype, same element count. Each rank keeps
its recent collectives (``collective_log`` and ``in_flight``: op, dtype, element count, call
site) and this rule lines them up by (group, seq): the first number where they differ is
where the ranks went apart. A size or dtype mismatch makes gloo abort (SIGABRT) or raise,
or NCCL hang or corrupt memory; an order mismatch (a barrier on one rank where the others
all-reduce) deadlocks. So the death or the hang that follows is a consequence, and this
rule comes before ``dead_rank`` and the hang rules.

The odd ranks are the minority side. On a tie (two ranks), the side the other went past:
at the same step, lined up in the code both run, the rank further along passed the place
where the other issued its collective without issuing it, so that collective is the one too
many (``common.behind``; a rank between steps at a later line of the loop in which the
other runs its step is a pass behind, not further along). A rank still in DDP's gradient all-reduce while the other has gone
past the training loop to a collective after it (the script's final barrier) runs a step
the other does not have: it has more batches (uneven inputs), and the fix is Join or even
batches. Else the ranks whose call site no other rank used; else every rank (two ranks
that disagree and do not tell cannot say which one is wrong).
"""

from __future__ import annotations

from collections import Counter

from ...frames import is_library_anywhere
from ...state.schema import Collective
from .. import words
from ..findings import Finding, Verdict
from ..view import GONE, STALLED, RankView
from .common import behind, parting


def entries(v: RankView) -> dict[tuple[str, int], Collective]:
    """The rank's recent collectives by (group, seq), point-to-point left out (their
    sequence is per pair of ranks)."""
    s = v.state
    out = {}  # type: ignore[var-annotated]
    for e in (
        list(s.collective_log)
        + list(s.in_flight)
        + ([s.last_collective] if s.last_collective else [])
    ):
        if not e.p2p and e.source is None:
            out.setdefault((e.group, e.seq), e)
    return out


def difference(a: Collective, b: Collective) -> str | None:
    """The first field in which two ranks' collectives of one sequence number differ."""
    if a.op != b.op:
        return "op"
    if (a.bucket is None) != (b.bucket is None):
        return "call"  # a DDP gradient bucket on one rank, a call of the user's on the other
    if a.dtype and b.dtype and a.dtype != b.dtype:
        return "dtype"
    if a.numel is not None and b.numel is not None and a.numel != b.numel:
        return "numel"
    if a.bucket is not None and a.bytes is not None and b.bytes is not None and a.bytes != b.bytes:
        return "bytes"
    return None


FIELD_NAMES = {
    "op": "operation",
    "call": "call",
    "dtype": "dtype",
    "numel": "element count",
    "bytes": "size",
}


def first_mismatch(
    views: list[RankView],
) -> tuple[tuple[str, int], str, dict[int, Collective]] | None:
    """((group, seq), field, each rank's collective there) at the earliest sequence number,
    over every group, where the ranks that recorded it disagree."""
    at: dict[tuple[str, int], dict[int, Collective]] = {}  # one pass over every rank's
    for v in views:
        for key, e in entries(v).items():
            at.setdefault(key, {})[v.rank] = e
    for key in sorted(at, key=lambda k: (k[1], k[0])):
        there = at[key]
        if len(there) < 2:
            continue
        ref = Counter(_fingerprint(e) for e in there.values()).most_common(1)[0][0]
        base = next(e for e in there.values() if _fingerprint(e) == ref)
        fields = [f for e in there.values() if (f := difference(base, e)) is not None]
        if fields:
            return key, fields[0], there
    return None


def _fingerprint(e: Collective) -> tuple[object, ...]:
    return (e.op, e.bucket is None, e.dtype, e.numel)


def aborted_in(v: RankView) -> str | None:
    """The collective a rank was in when the backend aborted it (SIGABRT): ``op`` and the
    user frame that called it, from its faulthandler file."""
    if v.ending is None or v.ending.signal != "SIGABRT" or not v.stack:
        return None
    frames = v.stack[0].frames
    for i in range(len(frames) - 1, -1, -1):
        f = frames[i]
        if str(f.file).endswith("distributed_c10d.py") and f.function in TRACKED_OPS:
            user = next(
                (u for u in reversed(frames[:i]) if not is_library_anywhere(str(u.file))), None
            )
            return f"{f.function} {user.file}:{user.line}" if user else f.function
    return None


TRACKED_OPS = frozenset(
    (
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "scatter",
        "barrier",
        "all_reduce_coalesced",
        "all_gather_object",
        "broadcast_object_list",
    )
)


def _same_call(aborted: str, e: Collective) -> bool:
    op, _, where = aborted.partition(" ")
    return op == e.op and (not where or not e.call_site or where.endswith(e.call_site))


def mismatch(views: list[RankView], missing: list[int]) -> Verdict | None:
    found = first_mismatch(views)
    aborted = {v.rank: a for v in views if (a := aborted_in(v))}
    if found is None:
        return _abort_only(views, aborted)
    (group, seq), field, there = found
    inferred = []
    for r, a in aborted.items():
        if (
            r not in there
            and any(_same_call(a, e) for e in there.values())
            and field in ("numel", "dtype")
        ):
            # gloo aborts the rank that receives more than it expects: the smaller side
            smallest = min(there.values(), key=lambda e: e.bytes or 0)
            there[r] = smallest
            inferred.append(r)
    sides: dict[tuple[object, ...], list[int]] = {}
    for r, e in sorted(there.items()):
        sides.setdefault(_fingerprint(e), []).append(r)
    ordered = sorted(sides.values(), key=len, reverse=True)
    by_rank = {v.rank: v for v in views}
    last = (
        behind([[by_rank[r] for r in side] for side in ordered])
        if field in ("op", "call")
        else None
    )
    if len(ordered[0]) > len(ordered[-1]):
        odd = sorted(r for side in ordered[1:] for r in side)
    elif last is not None:
        odd = sorted(v.rank for v in last)
    else:
        never = [
            r
            for r, e in there.items()
            if all(not by_rank[o].state.collective_sites.get(e.site_key) for o in there if o != r)
        ]
        odd = sorted(never) if 0 < len(never) < len(there) else sorted(there)
    name = FIELD_NAMES[field]
    parts = []
    for side in sorted(sides.values(), key=lambda rs: (rs[0] in odd, rs)):
        e = there[side[0]]
        parts.append(f"{words.who(side)}: {describe(e)}")
    summary = (
        f"the ranks issued different collectives as #{seq} of group {group}: the {name} differs "
        f"({'; '.join(parts)})"
    )
    evidence = [
        f"rank {r}: "
        + (
            f"aborted by the backend in {e.op} at {e.call_site} (counted with the smaller side: "
            "gloo aborts the rank that receives more than it expects)"
            if r in inferred
            else f"{words.entry_name(e)}{_shape(e)}"
        )
        for r, e in sorted(there.items())
    ]
    fix = words.fix_mismatch(field)
    if last is not None:
        others = [by_rank[r] for r in sorted(there) if by_rank[r] not in last]
        if all(
            there[v.rank].bucket is not None for v in last
        ):  # it trains on, the others left the loop
            more = sorted(v.rank for v in last)
            summary = _uneven(more, [v.rank for v in others], odd, there, seq, group)
            evidence.append(_past(last, others, f"the place of {words.who(more)}'s training step"))
            fix = words.FIX_UNEVEN
        elif sorted(v.rank for v in last) == odd:
            evidence.append(_past(last, others, f"the place of {words.who(odd)}'s collective"))
    evidence += _abort_reasons(by_rank, aborted)
    ended = [v for v in views if v.ending is not None and v.exception and v.rank not in aborted]
    if ended:
        evidence.append(
            "the ranks that ended did so because of it: "
            + ", ".join(
                f"rank {v.rank} ({words.short_exception(v.exception or '', 80)})" for v in ended
            )
        )
    state = next(iter(views)).state
    fix += " " + words.rerun_advice(state.backend, state.debug_level, desync=True)
    return Verdict("desync", odd, [Finding("mismatch", "error", odd, summary, evidence, fix)])


def _uneven(
    more: list[int],
    fewer: list[int],
    odd: list[int],
    there: dict[int, Collective],
    seq: int,
    group: str,
) -> str:
    """The summary for ranks that run another training step (DDP's gradient all-reduce)
    while the others have gone past the training loop to a collective of their own: the
    ranks have different numbers of batches."""
    head, tail = (more, fewer) if set(odd) <= set(more) else (fewer, more)
    return (
        f"{words.who(head)} {words.verb(head, 'has', 'have')} {'more' if head is more else 'fewer'} "
        f"batches than {words.who(tail)} (uneven inputs): as #{seq} of group {group}, "
        f"{words.who(more)} {words.verb(more, 'runs', 'run')} another training step "
        f"({describe(there[more[0]])}) while {words.who(fewer)} {words.verb(fewer, 'has', 'have')} "
        f"gone past the training loop to {describe(there[fewer[0]])}"
    )


def _past(last: list[RankView], others: list[RankView], what: str) -> str:
    """The evidence that ``last`` issued the collective too many: at the same step, the
    others stand further along in the code both run."""
    ranks, ahead = [v.rank for v in last], [v.rank for v in others]
    head = f"at the same step ({last[0].state.step}), {words.who(ahead)} {words.verb(others, 'is', 'are')}"
    tail = f"{words.who(ahead)} went past {what} without {'running' if 'step' in what else 'issuing'} it"
    part = parting(others[0], last[0])
    if part is None:
        return f"{head} further along in the code than {words.who(ranks)}: {tail}"
    where, fa, fb = part
    if fa[2] > fb[2] and fb[3] and fa[2] > fb[3][1]:
        return (
            f"{head} at line {fa[2]} of {where}, past the loop (lines {fb[3][0]}-{fb[3][1]}) that "
            f"{words.who(ranks)} {words.verb(last, 'is', 'are')} in, at line {fb[2]}: {tail}"
        )
    if fa[2] < fb[2] and fa[3]:
        return (
            f"{head} in the next pass of the loop (lines {fa[3][0]}-{fa[3][1]} of {where}), at line "
            f"{fa[2]}, {words.who(ranks)} at line {fb[2]}, the end of the pass before: {tail}"
        )
    return f"{head} at line {fa[2]} of {where}, {words.who(ranks)} at line {fb[2]}: {tail}"


def describe(e: Collective) -> str:
    if e.bucket is not None:
        return f"{e.op} of DDP gradient bucket {e.bucket}"
    func = f" in {e.function}" if e.function and e.function != "?" else ""
    caller = f", called from {e.callers[0]}" if e.callers else ""
    return f"{e.op}{_shape(e)} at {e.call_site}{func}{caller}"


def _shape(e: Collective) -> str:
    bits = [b for b in (f"{e.numel} elements" if e.numel is not None else "", e.dtype or "") if b]
    return f" ({', '.join(bits)})" if bits else ""


def _abort_only(views: list[RankView], aborted: dict[int, str]) -> Verdict | None:
    """A rank aborted inside a collective (gloo's answer to a message of another size than
    it expects) and the ranks' records cannot line the call up (the aborted rank's file
    predates it). The others issued the same call (its tensors differ in size or dtype), or
    at their end wait in another one: a DDP gradient bucket, or a call of the user's at
    another place (a collective that only some ranks issue, such as a metric all-reduced in
    rank 0's logging)."""
    if not aborted:
        return None
    first = min(aborted)
    call = aborted[first]
    same, other = [], []
    for v in views:
        if v.rank in aborted:
            continue
        last, waiting = v.state.last_collective, v.waiting
        if last is not None and _same_call(call, last):
            same.append((v.rank, last))
        elif waiting is not None and v.status in GONE + STALLED and not _same_call(call, waiting):
            other.append((v.rank, waiting))
    if not same and not other:
        return None
    op, _, where = call.partition(" ")
    state = views[0].state
    by_rank = {v.rank: v for v in views}
    ending = by_rank[first].ending
    if ending is not None and ending.where and where in ending.where:
        where = ending.where  # with the function
    if same:
        suspects = sorted([*aborted, *(r for r, _ in same)])
        summary = (
            f"the backend aborted {words.who(sorted(aborted))} (SIGABRT) inside {op} at {where}, a "
            "collective the other ranks issued at the same place: the ranks' tensors differ in "
            "size or dtype"
        )
        evidence = [f"rank {r}: {words.entry_name(e)}{_shape(e)}" for r, e in same]
        evidence.append(
            "the aborted rank's own tensor is not in its state file (it died before the next write)"
        )
        fix = words.fix_mismatch("numel")
    else:
        alone = not any(_site_used(by_rank[r], call) for r, _ in other)
        suspects = sorted(aborted) if alone else sorted([*aborted, *(r for r, _ in other)])
        peers = [r for r, _ in other]
        summary = (
            f"the ranks issued different collectives: {state.backend or 'the backend'} aborted "
            f"{words.who(sorted(aborted))} "
            f"(SIGABRT) inside {op} at {where} while {words.who(peers)} "
            f"{words.verb(peers, 'was', 'were')} in {describe(other[0][1])}"
            + (f": a collective that only {words.who(sorted(aborted))} issued" if alone else "")
        )
        evidence = [f"rank {r}: aborted in {op} at {where}" for r in sorted(aborted)]
        evidence += [f"rank {r}: {words.entry_name(e)}{_shape(e)}, at its end" for r, e in other]
        fix = words.fix_mismatch("call")
    evidence += _abort_reasons(by_rank, aborted)
    fix += " " + words.rerun_advice(state.backend, state.debug_level, desync=True)
    return Verdict(
        "desync", suspects, [Finding("mismatch", "error", suspects, summary, evidence, fix)]
    )


def _abort_reasons(by_rank: dict[int, RankView], aborted: dict[int, str]) -> list[str]:
    """Each aborted rank's end in the backend's own words (``state/fault.py`` reads them from
    its stderr when that is a file), else where to find them."""
    return [
        f"rank {r}: {by_rank[r].exception}"
        if ", after " in (by_rank[r].exception or "")
        else f'rank {r}: the backend\'s reason is on its stderr ("terminate called after throwing ..."), '
        "not a file ddpmon could read"
        for r in sorted(aborted)
    ]


def _site_used(v: RankView, call: str) -> bool:
    """Has rank ``v`` ever issued ``call`` (``op file:line``, from a fault file's stack)?"""
    op, _, where = call.partition(" ")
    for key in v.state.collective_sites:
        if key.endswith(" (DDP bucket)") or not key.startswith(op + " "):
            continue
        site = key[len(op) + 1 :].split(" < ")[0]
        if where.endswith(site):
            return True
    return False
