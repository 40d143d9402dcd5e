"""A run as the report sees it: every rank's history database and state file, from one or
more state directories (one per node without a shared file system) or the node daemons.

Per-step plots use the history (``rank-<R>.history.sqlite``; from a node daemon, a copy of
it read from ``/history``, ``remote/daemons.py``); the summary's identity, exit and findings
also come from the state files through the doctor's own loading and rules
(``ddpmon.doctor.examine``), so the report and the doctor never disagree.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import StateFileError
from ..remote import daemons
from ..state import history
from ..webconfig import HttpConfig

MAX_POINTS = 2000  # plotted points per series: steps are averaged in bins above that
SAMPLE_ROWS = 5000  # rows per rank read for medians and the bucket summary...
SAMPLE_TOTAL = 300_000  # ...and over all ranks (fewer per rank above 60 ranks)


@dataclass
class RankHistory:
    """One rank: identity, a sample of its steps, its steps binned for plots, findings, exit."""

    rank: int
    path: str
    identity: dict[str, Any]
    rows: int
    last_step: int
    sample: dict[str, list[Any]]
    binned: dict[str, list[Any]] = field(default_factory=dict)
    findings: list[dict[str, Any]] = field(default_factory=list)
    exit: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    first: tuple[int, float, float] | None = None
    """(step, start_unix, end_unix) of its first row, and of its last (None: no rows)."""
    last: tuple[int, float, float] | None = None

    def median(self, column: str) -> float | None:
        values = [v for v in self.sample.get(column, []) if isinstance(v, (int, float))]
        return statistics.median(values) if values else None


@dataclass
class Run:
    sources: list[str]
    ranks: dict[int, RankHistory]
    stride: int
    diagnosis: Any = None  # ddpmon.doctor.Diagnosis, or None when no state file is readable
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the reader chose (the job, among several on the daemons)."""

    @property
    def job(self) -> str:
        if self.diagnosis is not None and self.diagnosis.job:
            return str(self.diagnosis.job)
        for r in self.ranks.values():
            if r.identity.get("job"):
                return str(r.identity["job"])
        return "?"


def load(
    state_dirs: Sequence[str] = (),
    remote: Sequence[str] = (),
    *,
    job: str | None = None,
    max_points: int = MAX_POINTS,
    findings: bool = True,
    deadline: float = daemons.HISTORY_DEADLINE_SECONDS,
    client: HttpConfig | None = None,
) -> Run:
    """Read a run from state directories and node daemons (``HOST:PORT``, their ``/history``
    read within ``deadline`` seconds in all, asked with ``client``'s TLS and credentials).
    Raises StateFileError when a directory is missing or nothing is there."""
    problems: list[str] = []
    notes: list[str] = []
    paths: list[str] = []
    for d in state_dirs:
        if not os.path.isdir(d):
            raise StateFileError(
                d,
                "no such directory; pass the job's state directory (DDPMON_STATE_DIR; "
                "by default <tmp>/ddpmon-<uid>/<job>), once per node",
            )
        paths += history.list_files(d)
    with tempfile.TemporaryDirectory(prefix="ddpmon-report-") as scratch:
        shown: dict[str, str] = {}
        if remote:
            fetched = daemons.fetch_histories(
                remote, scratch, job, deadline=deadline, client=client
            )
            problems += fetched.problems
            if job is None and fetched.job is not None and fetched.other_jobs:
                notes.append(
                    f"reading job {fetched.job!r}, the one written last on the daemons (they also hold "
                    f"{', '.join(map(repr, fetched.other_jobs))}; --job picks another)"
                )
            job = fetched.job if job is None else job
            shown = fetched.copies
            paths += list(shown)
        ranks, stride = _read(paths, job, max_points, problems, shown)
    diagnosis = None
    if findings:
        diagnosis = _diagnose(state_dirs, remote, job, problems, client)
    if not ranks and diagnosis is not None:
        problems.append(
            "no step history (rank-<R>.history.sqlite) was read, so the per-step plots are empty: "
            "pass the ranks' state directories, or --from the node daemons (--serve-state)"
        )
    if not ranks and diagnosis is None:
        where = ", ".join(list(state_dirs) + list(remote)) or "(nothing given)"
        raise StateFileError(
            where,
            "holds no ddpmon history (rank-<R>.history.sqlite) and no state files: "
            "attach ddpmon in the training script (history is on by default; "
            "DDPMON_HISTORY=0 turns it off) and pass its state directory"
            + (f" ({'; '.join(problems)})" if problems else ""),
        )
    return Run(
        list(state_dirs) + list(remote),
        dict(sorted(ranks.items())),
        stride,
        diagnosis,
        problems,
        notes,
    )


def _read(
    paths: list[str], job: str | None, max_points: int, problems: list[str], shown: dict[str, str]
) -> tuple[dict[int, RankHistory], int]:
    """Every rank's history (of ``job``, when given) and the step stride of the plots' bins.
    A copy read from a daemon goes by the name ``shown`` gives it."""
    ranks: dict[int, RankHistory] = {}
    last_steps: dict[str, int] = {}
    for p in paths:
        try:
            last_steps[p] = history.max_step(p)
        except history.HistoryError as exc:
            problems.append(str(exc).replace(p, shown.get(p, p)))
    longest = max(last_steps.values(), default=0)
    stride = max(1, -(-longest // max(1, max_points)))
    sample_rows = max(100, min(SAMPLE_ROWS, SAMPLE_TOTAL // max(1, len(last_steps))))
    for p, last in last_steps.items():
        try:
            h = history.read(p, max_points=sample_rows, decode_buckets=False, bin_stride=stride)
            binned = h["binned"]
        except history.HistoryError as exc:
            problems.append(str(exc).replace(p, shown.get(p, p)))
            continue
        identity = h["identity"]
        if job is not None and identity.get("job") not in (None, job):
            continue
        rank = int(identity.get("rank", h["rank"] or 0))
        if rank in ranks and ranks[rank].identity.get("job") != identity.get("job"):
            problems.append(
                f"{shown.get(p, p)}: rank {rank} of job {identity.get('job')!r} also in "
                f"{shown.get(ranks[rank].path, ranks[rank].path)}; kept the one written last"
            )
            if os.path.getmtime(p) < os.path.getmtime(ranks[rank].path):
                continue
        ranks[rank] = RankHistory(
            rank,
            p,
            identity,
            h["rows"],
            last,
            h["steps"],
            binned,
            h["findings"],
            h["exit"],
            h["meta"],
            h["first"],
            h["last"],
        )
    for h in ranks.values():  # type: ignore[assignment]
        h.path = shown.get(h.path, h.path)  # type: ignore[attr-defined]
    return ranks, stride


def _diagnose(
    state_dirs: Sequence[str],
    remote: Sequence[str],
    job: str | None,
    problems: list[str],
    client: HttpConfig | None,
) -> Any:
    """The doctor's diagnosis (no live stacks): per-rank status and the findings. Several
    directories are read one by one and their ranks joined."""
    from ..doctor import examine

    results = []
    try:
        if remote:
            results.append(
                examine("", job=job, live_stacks=False, remote=list(remote), client=client)
            )
        for d in state_dirs:
            results.append(examine(d, job=job, live_stacks=False))
    except StateFileError as exc:
        problems.append(str(exc))
    results = [r for r in results if r.ranks]
    if not results:
        return None
    if len(results) == 1:
        return results[0]
    # Several nodes: one diagnosis over every node's files.
    from ..doctor.rules import decide

    first = results[0]
    views = sorted({v.rank: v for r in results for v in r.ranks}.values(), key=lambda v: v.rank)
    world = max(int(v.state.world_size or 0) for v in views) or len(views)
    missing = sorted(set(range(world)) - {v.rank for v in views})
    verdict, suspects, found = decide(views, missing)
    found = list(found)
    seen = {(f.kind, tuple(f.ranks)) for f in found}
    for r in results:
        for f in r.findings:
            if (f.kind, tuple(f.ranks)) not in seen and f.kind not in (
                "missing_ranks",
                "missing_rank",
            ):
                seen.add((f.kind, tuple(f.ranks)))
                found.append(f)
    first.verdict, first.suspect_ranks, first.findings, first.ranks = (
        verdict,
        suspects,
        found,
        views,
    )
    return first
