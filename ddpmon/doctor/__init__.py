"""``ddpmon doctor``: which rank stopped a DDP job, doing what, and what to do about it.

It reads every rank's state file in a directory (``load``), puts each rank in a status from
its file and its process (``view``), reads live stacks of the stalled ones with py-spy where
it can (``stacks``), and applies the rules (``rules/``, one per finding kind); ``words`` holds
what they say and ``report`` renders it. It never imports torch and works on a dead job from
its files alone.

    from ddpmon.doctor import examine
    diagnosis = examine("/tmp/ddpmon-1000/myjob")
    diagnosis.verdict, diagnosis.suspect_ranks
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence

from ..activity import Status
from ..collectors import host
from ..errors import StateFileError
from ..state import files as state_files
from ..state import owners
from ..webconfig import HttpConfig
from . import rules, stacks
from .findings import VERDICTS, Diagnosis, Finding
from .load import StateFile, earlier_attempts, load_dir, load_remote
from .rules import cannot_write, launch, lost_node
from .rules import files as file_rules
from .view import STALLED, RankView, state_interval, view

__all__ = ["examine", "Diagnosis", "Finding", "RankView", "VERDICTS"]


def examine(
    state_dir: str,
    *,
    job: str | None = None,
    live_stacks: bool = True,
    stall: float | None = None,
    now: float | None = None,
    stack_timeout: float = 4.0,
    remote: Sequence[str] = (),
    client: HttpConfig | None = None,
) -> Diagnosis:
    """Diagnose the job whose state files are in ``state_dir``.

    ``job`` picks one job when the directory holds several (default: the one written last);
    ``stall`` overrides the seconds without progress after which a rank counts as stalled;
    ``live_stacks=False`` skips py-spy; ``remote`` (``HOST:PORT`` of node daemons serving
    ``/state``, asked with ``client``'s TLS and credentials) replaces the directory. A
    missing directory, or a job that is not there, raises StateFileError.
    """
    diagnosis = _examine(
        state_dir,
        job,
        live_stacks,
        stall,
        now,
        stack_timeout,
        remote,
        settle=now is None,
        client=client,
    )
    if (
        not remote
    ):  # a restarted job's earlier attempts (attempt-<N>/), each diagnosed from its files
        diagnosis.attempts = earlier_attempts(
            state_dir,
            diagnosis.job,
            lambda d: _examine(
                d, diagnosis.job, False, stall, now, stack_timeout, (), settle=False
            ),
        )
    return diagnosis


SETTLE_MAX_SECONDS = 3.0
"""The longest the doctor waits to tell whether far ranks are gone (``lost_node.undecided``)."""


def _examine(
    state_dir: str,
    job: str | None,
    live_stacks: bool,
    stall: float | None,
    now: float | None,
    stack_timeout: float,
    remote: Sequence[str],
    settle: bool,
    client: HttpConfig | None = None,
) -> Diagnosis:
    """examine(); with ``settle``, when ranks on other hosts stopped writing just before the
    others failed on their connections, it waits until they would have written again (at
    most a few seconds, only then) and reads everything anew: they are gone, or alive."""
    asked = state_dir
    now = time.time() if now is None else now
    loaded = load_remote(remote, client=client) if remote else load_dir(state_dir)
    if remote:
        state_dir = loaded.state_dir
    notes = file_rules.bad_files(loaded.bad)
    jobs = loaded.jobs()
    job_ranks = {name: [f.rank for f in files] for name, files in jobs.items()}
    launching = launch.findings(loaded.launchers, now, loaded.unreachable)
    if not jobs:
        if launching:  # no rank started anywhere: what the launchers tried says why
            return Diagnosis("not_started", [], launching + notes, [], None, state_dir, {}, now)
        if starting := launch.starting(loaded.launchers, now):  # ranks not written yet
            return Diagnosis("healthy", [], [starting, *notes], [], None, state_dir, {}, now)
        notes.append(file_rules.no_state_files(state_dir))
        return Diagnosis("no_data", [], notes, [], None, state_dir, job_ranks, now)
    chosen = job is not None
    if job is not None and job not in jobs and owners.owned_name(job, os.geteuid()) in jobs:
        job = owners.owned_name(job, os.geteuid())  # several users' files claim that name: yours
    if job is None:
        job = max(jobs, key=lambda name: max(f.mtime for f in jobs[name]))
    elif job not in jobs:
        raise StateFileError(
            state_dir, f"holds no state files of job {job!r}; jobs there: {', '.join(sorted(jobs))}"
        )
    if chosen:  # the job asked for, and nothing of the others
        job_ranks = {job: job_ranks[job]}
    else:
        notes += file_rules.other_job(job, job_ranks)
    files, world, missing, leftover = file_rules.membership(jobs[job])
    notes += leftover

    local_host = socket.gethostname()
    lives = {
        f.rank: host.check(
            f.state.host, f.state.pid, _local(f, f.state.started_unix), local_host, f.rank
        )
        for f in files
    }
    lives = _guard_pid_namespace(files, lives, now)
    views = [view(f, lives[f.rank], now, stall) for f in files]
    wait = lost_node.undecided(views)
    if settle and 0 < wait <= SETTLE_MAX_SECONDS:
        time.sleep(wait)
        return _examine(
            asked,
            job if chosen else None,
            live_stacks,
            stall,
            None,
            stack_timeout,
            remote,
            settle=False,
            client=client,
        )
    notes += _read_only(state_dir if not remote else None, views)
    cannot_write.mark(views, state_dir if not remote else None)
    if live_stacks:
        _live_stacks(views, stack_timeout)

    verdict, suspects, findings = rules.decide(views, missing, loaded.unreachable)
    if launching and verdict in ("not_started", "healthy", "no_data"):
        verdict, findings = "not_started", launching + findings  # a node's launch first
    findings += notes
    unreadable = {r for path, _ in loaded.bad if (r := state_files.rank_of(path)) is not None}
    findings += file_rules.missing_ranks(missing, world, unreadable, findings)
    findings += rules.notes(views, suspects)
    return Diagnosis(verdict, suspects, findings, views, job, state_dir, job_ranks, now)


def _guard_pid_namespace(
    files: list[StateFile], lives: dict[int, host.Liveness], now: float
) -> dict[int, host.Liveness]:
    """A rank whose pid is gone while its file is fresh either died a moment ago or runs in
    another pid namespace (another container with this hostname). Its writer tells which:
    when the file is rewritten once more, the rank is alive and this host's pids are not the
    ranks', so no local pid is trusted. Waits at most a few seconds, only in that case."""
    doubtful = [
        f
        for f in files
        if lives[f.rank].alive is False
        and f.state.exit is None
        and now - f.mtime < state_interval(f.state) + 0.5
    ]
    if not doubtful:
        return lives
    until = time.time() + min(3.0, max(2 * state_interval(f.state) + 0.5 for f in doubtful))
    while time.time() < until:
        for f in doubtful:
            try:
                rewritten = state_files.written_unix(os.stat(f.path)) != f.mtime
            except OSError:
                rewritten = False
            if rewritten:
                unknown = host.Liveness(
                    None, "this host's pids are not the ranks' (another pid namespace?)"
                )
                return {
                    rank: (unknown if live.alive is not None else live)
                    for rank, live in lives.items()
                }
        time.sleep(0.05)
    return lives


def _live_stacks(views: list[RankView], timeout: float) -> None:
    """py-spy stacks of this host's live ranks that stalled or whose files say nothing new
    (unknown), and of the running ones when others wait for them."""
    anyone_stalled = any(v.status in STALLED for v in views)
    wanted = [
        (v, v.state.pid)
        for v in views
        if v.liveness.alive
        and v.state.pid is not None
        and (
            v.status in STALLED
            or v.status == Status.UNKNOWN
            or (anyone_stalled and v.status == Status.STEPPING)
        )
    ]
    if not wanted:
        return
    found = stacks.dump_many([pid for _, pid in wanted], timeout)
    for v, pid in wanted:
        result = found.get(pid)
        if result is None:
            continue
        if result.threads:
            v.stack, v.stack_source, v.stack_error = result.threads, "py-spy, live", None
        else:
            v.stack_error = result.error


def _local(f: StateFile, t: float | None) -> float:
    """A time of the file's writer on the file system's clock (its mtime when absent)."""
    return t + f.offset if t is not None else f.mtime


def _read_only(state_dir: str | None, views: list[RankView]) -> list[Finding]:
    """A state directory on a read-only file system: live ranks cannot rewrite their files,
    so a stale file says nothing about them. Such ranks are not taken for frozen (a hang);
    the finding says what is known and what is not."""
    if not state_dir:
        return []
    try:
        read_only = bool(os.statvfs(state_dir).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return []
    if not read_only:
        return []
    unknown = [
        v
        for v in views
        if v.status == Status.FROZEN and v.liveness.alive and not v.liveness.stopped
    ]
    for v in unknown:
        v.status = Status.UNKNOWN
    ranks = sorted(v.rank for v in unknown)
    return [
        Finding(
            "state_dir_read_only",
            "warning",
            ranks,
            f"the state directory {state_dir} is on a read-only file system: the ranks cannot rewrite "
            "their state files, so their files show what they did when the file system turned "
            "read-only"
            + (
                f"; ranks {', '.join(map(str, ranks))} are alive, doing what is unknown"
                if ranks
                else ""
            ),
            fix="Remount it read-write (or point DDPMON_STATE_DIR at a writable directory for the next "
            "run); for what the ranks do now, run `py-spy dump --pid PID` on them.",
        )
    ]
