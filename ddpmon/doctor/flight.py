"""torch's flight-recorder numbers beside ddpmon's own, for a rank whose hang report carries
the recorder's entries (``hang.flight_recorder``).

ddpmon numbers the collectives it sees issued, per process group (``Collective.seq``);
torch's recorder numbers every collective the group ran (``collective_seq_id``), also those
issued before ddpmon attached and those torch issues itself (DDP's parameter check at its
construction), so the two differ by a constant per group. The constant is found by
matching the two records: pairs of the same group, operation and element count vote for
their difference, and the one most pairs agree on wins. The recorder's entry of the
collective a rank waits in then says what torch knows of it; where it records another
operation or size at that number, or no entry, the line says so.

On gloo (torch 2.13 to 2.15) an entry's ``state`` stays ``scheduled`` (gloo has no events to
time) and ``retired`` turns true when the work completed; ``pg_status``'s
``last_started_collective`` stays -1 and ``last_completed_collective`` lags. NCCL's entries
go ``scheduled``, ``started``, ``completed``.
"""

from __future__ import annotations

from typing import Any

from ..state.schema import Collective
from .view import RankView

ALIASES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "_allgather_base": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "allreduce_coalesced": "all_reduce_coalesced",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
}
"""torch's recorder names (``gloo:allreduce``) that differ from the Python call ddpmon records."""


def op_of(entry: dict[str, Any]) -> str:
    """``all_reduce`` of ``gloo:all_reduce`` (or ``nccl:allreduce``)."""
    name = str(entry.get("profiling_name") or "?").rsplit(":", 1)[-1]
    return ALIASES.get(name, name)


def numel_of(entry: dict[str, Any]) -> int | None:
    """Elements of an entry's input tensors (None when it does not say)."""
    sizes = entry.get("input_sizes")
    if not isinstance(sizes, list):
        return None
    total = 0
    for shape in sizes:
        if not isinstance(shape, list) or not all(isinstance(n, int) for n in shape):
            return None
        count = 1
        for n in shape:
            count *= n
        total += count
    return total


DTYPE_BYTES = {
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
}
"""Bytes per element of the recorder's ``input_dtypes`` names."""


def bytes_of(entry: dict[str, Any]) -> int | None:
    """Bytes of an entry's input tensors (None when it does not say)."""
    sizes, dtypes = entry.get("input_sizes"), entry.get("input_dtypes")
    if not isinstance(sizes, list) or not isinstance(dtypes, list) or len(sizes) != len(dtypes):
        return None
    total = 0
    for shape, dtype in zip(sizes, dtypes):
        numel = numel_of({"input_sizes": [shape]})
        if numel is None or dtype not in DTYPE_BYTES:
            return None
        total += numel * DTYPE_BYTES[dtype]
    return total


def _group_of(entry: dict[str, Any]) -> str:
    pg = entry.get("process_group")
    if isinstance(pg, list) and pg:
        return str(pg[0])
    return str(entry.get("pg_id", "?"))


def _entries(v: RankView, group: str) -> dict[int, dict[str, Any]]:
    """The recorder's collectives (not point-to-point) of ``group`` in the rank's hang report,
    by torch's sequence number."""
    fr = (v.state.hang.flight_recorder if v.state.hang else None) or {}
    out = {}
    for e in fr.get("entries") or []:
        if not isinstance(e, dict) or e.get("is_p2p") or _group_of(e) != group:
            continue
        seq = e.get("collective_seq_id")
        if isinstance(seq, int) and not isinstance(seq, bool):
            out[seq] = e
    return out


def _ours(v: RankView, group: str) -> list[Collective]:
    """ddpmon's own collectives of ``group`` on the rank, done and in flight."""
    seen: dict[int, Collective] = {}
    hang = v.state.hang
    for c in [
        *v.state.collective_log,
        *(hang.in_flight if hang else []),
        *([hang.last_collective] if hang and hang.last_collective else []),
        *v.in_flight,
    ]:
        if c.group == group and not c.p2p and c.source is None:
            seen.setdefault(c.seq, c)
    return [seen[s] for s in sorted(seen)]


def _same(c: Collective, e: dict[str, Any]) -> bool:
    """The same operation of the same size (elements, else bytes, where both records say)."""
    if op_of(e) != c.op:
        return False
    if c.numel is not None and (numel := numel_of(e)) is not None:
        return numel == c.numel
    if c.bytes is not None and (size := bytes_of(e)) is not None:
        return size == c.bytes
    return True


def _agrees(c: Collective, e: dict[str, Any]) -> bool:
    """The same collective by op and size, and, on gloo, done on both sides or on neither
    (gloo's entries retire when they complete, as ddpmon sees them complete)."""
    if not _same(c, e):
        return False
    if str(e.get("profiling_name")).startswith("gloo:") and not c.async_op:
        return (c.completed_unix is not None or c.error is not None) == bool(e.get("retired"))
    return True


def offset(v: RankView, group: str) -> int | None:
    """torch's sequence number less ddpmon's for ``group`` on this rank: of the differences
    some pair matches at (op and size), the one whose pairs agree most (op, size and, on gloo,
    completion: a step's collectives repeat, so only completion tells the steps apart), then
    whose pairs were created closest in time (both records are on this host's clock); None
    when no pair matches."""
    entries, ours = _entries(v, group), _ours(v, group)
    candidates = {seq - c.seq for c in ours for seq, e in entries.items() if _same(c, e)}
    if not candidates:
        return None

    def fit(d: int) -> tuple[int, float]:
        pairs = [(c, entries[c.seq + d]) for c in ours if c.seq + d in entries]
        agree = sum(_agrees(c, e) for c, e in pairs)
        gaps = sorted(
            abs(c.issued_unix - e["time_created_ns"] / 1e9)
            for c, e in pairs
            if isinstance(e.get("time_created_ns"), int) and e["time_created_ns"] > 0
        )
        return 2 * agree - len(pairs), -(gaps[len(gaps) // 2] if gaps else 0.0)

    return max(sorted(candidates, key=abs), key=fit)


def _state(e: dict[str, Any]) -> str:
    """What the entry says of the collective: gloo's entries stay ``scheduled`` and retire
    when they complete; NCCL's go ``started`` and ``completed`` (retired before that: timed
    out)."""
    state = str(e.get("state") or "?")
    said = "enqueued" if state == "scheduled" else state
    if state == "completed" or (
        e.get("retired") and str(e.get("profiling_name")).startswith("gloo:")
    ):
        return "completed"
    return f"{said}, {'retired without completing' if e.get('retired') else 'not completed'}"


def beside(v: RankView, c: Collective | None) -> str:
    """`` (flight recorder: pg 0 seq 57, started, not completed)``: torch's record of
    ddpmon's collective ``c`` on rank ``v``, with where they disagree; "" when the rank's
    hang report has no flight-recorder entries of its group (or ``c`` came from the
    recorder itself)."""
    if c is None or c.source is not None or c.p2p:
        return ""
    entries = _entries(v, c.group)
    if not entries:
        return ""
    d = offset(v, c.group)
    if d is None:
        return (
            f" (flight recorder: no entry of group {c.group} matches ddpmon's collectives by "
            f"op and size; its last is seq {max(entries)} {op_of(entries[max(entries)])})"
        )
    seq = c.seq + d
    counted = (
        f"; torch counts {d} collective{'s' if abs(d) != 1 else ''} of the group that ddpmon "
        "did not see (before attach, or torch's own)"
        if d > 0
        else (f"; torch counts {-d} fewer than ddpmon" if d < 0 else "")
    )
    e = entries.get(seq)
    if e is None:
        last = max(entries)
        where = "its last is" if seq > last else "its oldest kept is"
        edge = last if seq > last else min(entries)
        return (
            f" (flight recorder: pg {c.group} has no seq {seq}, {where} seq {edge}: "
            f"torch does not record it{counted})"
        )
    differs = ""
    if not _same(c, e):
        differs = (
            f"; it records {op_of(e)} of {numel_of(e)} elements there, ddpmon {c.op} of "
            f"{c.numel} elements: they disagree"
        )
    return f" (flight recorder: pg {c.group} seq {seq}, {_state(e)}{counted}{differs})"
