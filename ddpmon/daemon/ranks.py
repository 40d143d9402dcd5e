"""The ranks of this node as the daemon sees them: up or down, what each is doing (frozen,
dead and crashed included, which only another process can see), from their state files and
their processes."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import psutil

from ..activity import Status
from ..collectors import host
from ..metrics.catalog import DAEMON_ACTIVITIES
from ..state import fault, schema
from .discovery import StateFiles


@dataclass
class NodeRank:
    """One rank of this node as the daemon exports it (the doctor's view of a rank, from
    its files and more, is ``doctor/view.RankView``)."""

    job: str
    rank: int
    up: bool
    last_progress_unix: float
    hang: bool
    heartbeat_unix: float
    proc: psutil.Process | None
    activity: str | None = None
    """What it is doing (``ddpmon_rank_activity``); None when no one can tell (the rank's
    watchdog is off)."""
    attempt: int | None = None
    """The job's attempt under a launcher that restarts it (``ddpmon_rank_attempt``)."""
    step_seconds: float | None = None
    """The median of its recent step times (its state file's ``timings``), None before
    its first steps."""
    busy_seconds: float | None = None
    """The median of its recent busy times (a step less its wait for the other ranks)."""


def activity_of(path: str, state: schema.RankState, life: host.Liveness, fresh: bool) -> str | None:
    """What a rank of this node is doing: its own word (the state file's ``activity``) while
    its process runs and the file is fresh; else what only another process sees: frozen
    (stopped, or no longer writing its file), crashed (an exception, a fatal signal or a
    non-zero exit status; a clean end is not exported at all) or dead (gone without a word:
    killed from outside). The doctor's view (``doctor/view.py``) draws the same lines."""
    if life.alive is not True:
        ending = state.exit
        if ending is None or ending.how == "os._exit":  # a signal leaves only its fault file
            try:
                offset = os.lstat(path).st_mtime - (state.now_unix or 0.0)
                ending = fault.of_run(path, state, offset) or ending
            except OSError:
                pass
        return Status.CRASHED if ending is not None else Status.DEAD
    if not fresh or life.stopped:
        return Status.FROZEN
    act = state.activity
    return act.state if act is not None and act.state in DAEMON_ACTIVITIES else None


class Ranks:
    """This node's ranks, read from ``files``; a rank is down once its process is gone or
    its file is older than ``stale_after`` seconds. Each file's process is looked up once
    per incarnation."""

    def __init__(
        self, files: StateFiles, stale_after: float = 15.0, node_local: bool = False
    ) -> None:
        self.files = files
        self.stale_after = stale_after
        self.node_local = node_local
        self.hostname = socket.gethostname()
        self._procs: dict[str, tuple[tuple[int, float | None, int], psutil.Process | None]] = {}

    def is_local(self, state: schema.RankState) -> bool:
        return self.node_local or state.host == self.hostname

    def ranks(self) -> list[NodeRank]:
        """This node's ranks: state files written on this host (every file with
        ``node_local``), minus detached ones; one view per (job, rank), the freshest."""
        now = time.time()
        views: dict[tuple[str, int], NodeRank] = {}
        seen = set()
        for path, state, owner, written in self.files.read_all():
            clean = state.exit is not None and not (state.exit.exception or state.exit.code)
            if state.stage == schema.Stage.DETACHED or clean:
                continue  # detached, or the process ended normally: nothing is down
            if state.pid is None or state.host is None or state.now_unix is None:
                self.files.problem(
                    path + "#keys",
                    f"state file {path} has no pid, host or now_unix; skipped until it is fixed",
                )
                continue
            self.files.resolved(path + "#keys", f"state file {path} is complete again")
            if not self.is_local(state):
                continue
            seen.add(path)
            # the writer's clock, but never past what the file system saw: a file stamped in
            # the future is fresh for at most stale_after past its last write (the slack is
            # for a network file system whose server's clock is behind this host's)
            beat = min(state.now_unix, written + self.stale_after)
            proc = self._process(
                path, state.pid, state.started_unix, state.host == self.hostname, state.rank, owner
            )
            life = host.judge(proc, state.pid, state.started_unix)  # the doctor's rule too
            alive = life.alive is True
            fresh = now - beat <= self.stale_after
            view = NodeRank(
                state.job or "",
                state.rank,
                up=alive and fresh,
                last_progress_unix=min(state.last_progress_unix or 0.0, beat),
                hang=state.hang is not None
                and alive,  # a killed job's last report is not a hang now
                heartbeat_unix=beat,
                proc=proc,
                activity=activity_of(path, state, life, fresh),
                attempt=state.attempt,
                step_seconds=step.median if (step := state.timings.step_seconds) else None,
                busy_seconds=busy.median if (busy := state.timings.busy_seconds) else None,
            )
            key = (view.job, view.rank)
            if key not in views or views[key].heartbeat_unix < beat:
                views[key] = view
        for path in [p for p in self._procs if p not in seen]:
            del self._procs[path]
        return sorted(views.values(), key=lambda v: (v.job, v.rank))

    def _process(
        self, path: str, pid: int, started: float | None, same_host: bool, rank: int, owner: int
    ) -> psutil.Process | None:
        """The rank's process, looked up once per incarnation (pid, start) of the file: only
        a process of the file's owner (a file naming another user's process is not that
        process's word)."""
        key = (pid, started, owner)
        cached = self._procs.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        proc = host.locate_process(pid, started, same_host, rank)
        if (
            proc is not None and host.uid_of(proc) != owner
        ):  # said once per owner, however many files
            self.files.problem(
                f"{self.files.state_dir}#pid#{owner}",
                f"state files of uid {owner} name processes of "
                "other users, which are not their ranks: such a rank counts as gone",
            )
            proc = None
        self._procs[path] = (key, proc)
        return proc
