"""``ddpmon doctor``: which rank stopped a DDP job, doing what, and what to do about it.

It reads every rank's state file in a directory, checks which rank processes on this host
are alive, reads live stacks of the stalled ones with py-spy where it can, and applies the
rules of ``diagnose``. It never imports torch and works on a dead job from its files alone.

    from ddpmon.doctor import examine
    diagnosis = examine("/tmp/ddpmon/myjob")
    diagnosis.verdict, diagnosis.suspect_ranks
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Sequence

from ..errors import StateFileError
from ..state import files as state_files
from . import procs, stacks
from .diagnose import STALLED, Diagnosis, Finding, RankView, decide, state_interval, view
from .load import StateFile, load_dir, load_remote

__all__ = ["examine", "Diagnosis", "Finding", "RankView"]


def examine(
    state_dir: str,
    *,
    job: str | None = None,
    live_stacks: bool = True,
    stall: float | None = None,
    now: float | None = None,
    stack_timeout: float = 4.0,
    remote: Sequence[str] = (),
) -> Diagnosis:
    """Diagnose the job whose state files are in ``state_dir``.

    ``job`` picks one job when the directory holds several (default: the one written last);
    ``stall`` overrides the seconds without progress after which a rank counts as stalled;
    ``live_stacks=False`` skips py-spy; ``remote`` (``HOST:PORT`` of node daemons serving
    ``/state``) replaces the directory. A missing directory, or a job that is not there,
    raises StateFileError.
    """
    now = time.time() if now is None else now
    loaded = load_remote(remote) if remote else load_dir(state_dir)
    if remote:
        state_dir = loaded.state_dir
    notes = [_bad_file(path, reason) for path, reason in loaded.bad]
    jobs = loaded.jobs()
    job_ranks = {name: [f.rank for f in files] for name, files in jobs.items()}
    if not jobs:
        notes.append(Finding(
            "no_state_files", "warning", [],
            f"no readable rank state files (rank-<R>.json) in {state_dir}",
            fix="Attach ddpmon in the training script (`ddpmon.attach(model)`) and point the "
            "doctor at the job's state directory (DDPMON_STATE_DIR; by default <tmp>/ddpmon/<job>).",
        ))
        return Diagnosis("no_data", [], notes, [], None, state_dir, job_ranks, now)
    if job is None:
        job = max(jobs, key=lambda name: max(f.mtime for f in jobs[name]))
    elif job not in jobs:
        raise StateFileError(
            state_dir, f"holds no state files of job {job!r}; jobs there: {', '.join(sorted(jobs))}"
        )
    for other in sorted(set(jobs) - {job}):
        notes.append(Finding(
            "other_job", "info", job_ranks[other],
            f"the directory also holds state files of job {other!r} (ranks "
            f"{_ranks(job_ranks[other])}); this diagnosis is about job {job!r}",
            fix=f"Pass --job {other} to diagnose that one; remove the files of jobs that ended.",
        ))
    files = jobs[job]
    files, world, missing, more = _membership(files)
    notes += more

    local_host = procs.this_host()
    lives = {
        f.rank: procs.check(f.data.get("host"), f.data.get("pid"), _local(f, "started_unix"), local_host)
        for f in files
    }
    lives = _guard_pid_namespace(files, lives, now)
    views = [view(f, lives[f.rank], now, stall) for f in files]
    for v in views:
        hang = v.data.get("hang")
        if isinstance(hang, dict) and hang.get("threads"):
            v.stack = hang["threads"]
            v.stack_source = f"its hang report ({max(0.0, now - _local(v.file, 'now_unix')):.0f} s old)"
    if live_stacks:
        _live_stacks(views, stack_timeout)

    verdict, suspects, findings = decide(views, missing)
    findings += notes
    unreadable = {r for path, _ in loaded.bad if (r := state_files.rank_of(path)) is not None}
    absent = [r for r in missing if r not in unreadable]
    if absent and not any(f.kind == "missing_rank" for f in findings):
        findings.append(Finding(
            "missing_ranks", "warning", absent,
            f"no state file for ranks {_ranks(absent)} of {world}",
            fix="Those ranks have not attached yet, or write their state files on another host: "
            "give every rank the same shared DDPMON_STATE_DIR, or run the doctor on each host.",
        ))
    findings += _unused_parameters(files)
    for v in views:
        if v.rank in suspects and v.stack is None and v.stack_error:
            findings.append(Finding("no_stack", "info", [v.rank], f"no live stack of rank {v.rank}: {v.stack_error}"))
        if v.data.get("errors"):
            parts = "; ".join(f"{k}: {m}" for k, m in sorted(v.data["errors"].items()))
            findings.append(Finding(
                "ddpmon_part_off", "info", [v.rank],
                f"on rank {v.rank}, parts of ddpmon switched themselves off after a failure ({parts})",
                fix="Training is not affected; the rank's log has the traceback. Please report it.",
            ))
    return Diagnosis(verdict, suspects, findings, views, job, state_dir, job_ranks, now)


def _unused_parameters(files: list[StateFile]) -> list[Finding]:
    """Unused parameters by rank, and find_unused_parameters=True that no rank needs (a rank
    alone cannot tell: another rank may be the one with unused parameters)."""
    out = []
    unused = {f.rank: f.data.get("unused_parameters") or [] for f in files}
    for rank, names in sorted(unused.items()):
        if names:
            shown = ", ".join(names[:8]) + (f" (+{len(names) - 8} more)" if len(names) > 8 else "")
            out.append(Finding(
                "unused_parameters", "info", [rank],
                f"rank {rank}: {len(names)} parameter(s) received no gradient in its last step: {shown}",
                fix="Expected for branches some ranks skip (DDP needs find_unused_parameters=True "
                "for them); otherwise make those parameters take part in the loss.",
            ))
    flagged = [f for f in files if "find_unused_parameters" in (f.data.get("notes") or {})]
    if files and len(flagged) == len(files) and not any(unused.values()):
        out.append(Finding(
            "needless_find_unused_parameters", "info", [f.rank for f in files],
            "find_unused_parameters=True, but no rank has had an unused parameter for "
            f"{min(f.data.get('step', 0) for f in files)}+ steps; it costs a traversal of the "
            "autograd graph every step",
            fix="Pass find_unused_parameters=False to DistributedDataParallel (or static_graph=True "
            "if the graph never changes).",
        ))
    return out


def _membership(files: list[StateFile]) -> tuple[list[StateFile], int, list[int], list[Finding]]:
    """Files of ranks beyond the job's world size are leftovers of an earlier run."""
    sizes = Counter(f.data.get("world_size") for f in files if isinstance(f.data.get("world_size"), int))
    world = sizes.most_common(1)[0][0] if sizes else max(f.rank for f in files) + 1
    leftover = [f for f in files if f.rank >= world]
    notes = []
    if leftover:
        notes.append(Finding(
            "leftover_state_file", "info", [f.rank for f in leftover],
            f"ignored {', '.join(f.name for f in leftover)}: rank beyond the job's world size "
            f"{world} (left by an earlier, larger run)",
            fix="Delete state files of runs that ended.",
        ))
    files = [f for f in files if f.rank < world]
    missing = sorted(set(range(world)) - {f.rank for f in files})
    return files, world, missing, notes


def _guard_pid_namespace(files: list[StateFile], lives: dict[int, procs.Liveness], now: float) -> dict[int, procs.Liveness]:
    """A rank whose pid is gone while its file is fresh either died a moment ago or runs in
    another pid namespace (another container with this hostname). Its writer tells which:
    when the file is rewritten once more, the rank is alive and this host's pids are not the
    ranks', so no local pid is trusted. Waits at most a few seconds, only in that case."""
    doubtful = [
        f for f in files
        if lives[f.rank].alive is False and not f.data.get("exit")
        and now - f.mtime < state_interval(f.data) + 0.5
    ]
    if not doubtful:
        return lives
    until = time.time() + min(3.0, max(2 * state_interval(f.data) + 0.5 for f in doubtful))
    while time.time() < until:
        for f in doubtful:
            try:
                rewritten = os.stat(f.path).st_mtime != f.mtime
            except OSError:
                rewritten = False
            if rewritten:
                unknown = procs.Liveness(None, "this host's pids are not the ranks' (another pid namespace?)")
                return {rank: (unknown if live.alive is not None else live) for rank, live in lives.items()}
        time.sleep(0.05)
    return lives


def _live_stacks(views: list[RankView], timeout: float) -> None:
    """py-spy stacks of this host's live ranks that stalled (and of the running ones, when
    others wait for them)."""
    anyone_stalled = any(v.status in STALLED for v in views)
    wanted = [
        v for v in views
        if v.liveness.alive and isinstance(v.data.get("pid"), int)
        and (v.status in STALLED or (anyone_stalled and v.status == "running"))
    ]
    if not wanted:
        return
    found = stacks.dump_many([v.data["pid"] for v in wanted], timeout)
    for v in wanted:
        result = found.get(v.data["pid"])
        if result is None:
            continue
        if result.threads:
            v.stack, v.stack_source, v.stack_error = result.threads, "py-spy, live", None
        else:
            v.stack_error = result.error


def _bad_file(path: str, reason: str) -> Finding:
    if path.startswith(("http://", "https://")):
        return Finding(
            "unreachable_daemon", "warning", [], f"{path} {reason}",
            fix="Start `ddpmon daemon --serve-state` on that node (docs/daemon.md) and check the "
            "address and any firewall between here and there.",
        )
    return Finding(
        "bad_state_file", "warning", [],
        f"{path} {reason}",
        fix="A rank replaces its state file atomically, so a truncated or corrupt one was written "
        "by something else or the disk is full; delete it if that rank no longer runs.",
    )


def _local(f: StateFile, key: str) -> float:
    value = f.data.get(key)
    return value + f.offset if isinstance(value, (int, float)) else f.mtime


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))
