"""The node daemon: one per node, exporting what a rank cannot say about itself.

It exports every GPU of the node under the ranks' metric names (job and rank labels from
the rank whose process uses the GPU), the processes on each GPU mapped to ranks by pid,
XID errors from NVML events, and the liveness of every rank of this node whose state file
it reads: ``ddpmon_rank_up`` is 1 while the rank's process runs and its state file is
fresh, and drops to 0 within one ``interval`` of the process dying; ``ddpmon_rank_activity``
says what the rank is doing, frozen, dead or crashed included (``_activity``).

A sampler thread builds one list of plain samples every ``interval`` seconds; a scrape
only formats the latest list, so scrapes cost nothing and never wait on NVML. The daemon
never imports torch, and nothing it reads (a missing directory, a corrupt file, a lost
GPU) stops it: each problem is logged once and the rest keeps being served.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import psutil

from . import __version__
from .activity import Status
from .collectors import host, nvml
from .errors import StateFileError
from .metrics.catalog import DAEMON_ACTIVITIES
from .metrics.exposition import (
    BadRequest,
    Query,
    Reader,
    Sample,
    Unhealthy,
    families,
    state_set,
)
from .state import attempts, fault, files, history, launcher, owners, records, schema

log = logging.getLogger("ddpmon")

HEALTHY_PASSES = 5
HEALTHY_MIN_SECONDS = 10.0


class Found(NamedTuple):
    """A state file as read: its rank's own word (``state``), whose file it is (``owner``,
    its uid) and when it was written, as its file system says (``files.written_unix``)."""

    path: str
    state: schema.RankState
    owner: int
    written: float


class StateFiles:
    """Reads a node's state files: ``DIR/rank-*.json`` and ``DIR/*/rank-*.json`` (ranks
    default to one directory per job under a common root). Every problem (the directory
    missing, a file corrupt) is logged once, and once more when it is gone."""

    def __init__(self, state_dir: str, max_per_user: int = owners.MAX_RANKS_PER_USER) -> None:
        self.state_dir = state_dir
        self.max_per_user = max_per_user
        self._problems: dict[str, str] = {}
        self._lock = threading.RLock()  # the sampler and /state requests read concurrently
        self.shared: dict[str, list[int]] = {}
        """The jobs that files of several owners claim (``state/owners.py``), at the last read."""

    def read_all(self) -> list[Found]:
        """Every readable state file, a job that several users' files claim renamed for each
        owner (``state/owners.py``)."""
        with self._lock:
            return self._read_all()

    def _read_all(self) -> list[Found]:
        paths = self._bounded(self._paths())
        read = []
        for path in paths:
            try:
                data, info = files.read_stat(path)
            except StateFileError as exc:
                if os.path.exists(path):  # (else it went away between listing and reading)
                    self.problem(path, f"state file {exc}; skipped until it is fixed")
                continue
            self.resolved(path, f"state file {path} is readable again")
            read.append((path, data, info))
        separated, self.shared = owners.separate(
            [(path, data, info.st_uid) for path, data, info in read]
        )
        for job, uids in self.shared.items():
            self.problem(
                f"{self.state_dir}#owners#{job}",
                (
                    f"state files of {len(uids)} users claim job {job!r} ({', '.join(f'uid {u}' for u in uids)}): "
                    "each user's are exported as a job of their own, "
                    f"{', '.join(repr(owners.owned_name(job, u)) for u in uids)}, since one of them may be "
                    "forged; give concurrent jobs distinct names"
                ),
            )
        out = [
            Found(path, state, info.st_uid, files.written_unix(info))
            for (path, state), (_, _, info) in zip(separated, read)
        ]
        for key in [
            k
            for k in self._problems
            if k.split("#")[0] != self.state_dir and not os.path.exists(k.split("#")[0])
        ]:
            del self._problems[key]  # the file is gone: a new one of that name is news again
        for key in [
            k
            for k in self._problems
            if "#owners#" in k and k.split("#owners#")[1] not in self.shared
        ]:
            del self._problems[key]
        return out

    def _bounded(self, paths: list[str]) -> list[str]:
        """At most ``max_per_user`` of each owner's files, those written last; the rest are
        skipped, said once per owner."""
        by_owner: dict[int, list[tuple[float, str]]] = {}
        for path in paths:
            try:
                info = os.lstat(path)
            except OSError:
                continue
            by_owner.setdefault(info.st_uid, []).append((files.written_unix(info), path))
        kept: set[str] = set()
        for uid, found in by_owner.items():
            key = f"{self.state_dir}#bound#{uid}"
            if len(found) > self.max_per_user:
                found = sorted(found, reverse=True)[: self.max_per_user]
                self.problem(
                    key,
                    f"uid {uid} has more than {self.max_per_user} state files here, the most the "
                    f"daemon reads per user (--max-ranks-per-user): the {self.max_per_user} "
                    "written last are read, the others skipped",
                )
            else:
                self.resolved(key, f"uid {uid}'s state files are within --max-ranks-per-user again")
            kept.update(path for _, path in found)
        return [path for path in paths if path in kept]

    def problem(self, key: str, message: str) -> None:
        with self._lock:
            if self._problems.get(key) == message:
                return
            self._problems[key] = message
        log.warning("ddpmon: daemon: %s", message)

    def resolved(self, key: str, message: str) -> None:
        with self._lock:
            if self._problems.pop(key, None) is None:
                return
        log.warning("ddpmon: daemon: %s", message)

    def launcher_paths(self) -> list[str]:
        """The launchers' records under the state roots (``launcher-*.json`` beside the rank
        files, and in each job's directory)."""
        roots = (
            [r for r in sorted(glob.glob(self.state_dir)) if not _foreign_root(r)]
            if glob.has_magic(self.state_dir)
            else [self.state_dir]
        )
        out = []
        for root in roots:
            out += launcher.list_paths(root)
            try:
                subdirs = sorted(
                    e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False)
                )
            except OSError:
                continue
            for sub in subdirs:
                if not attempts.is_attempt_dir(sub):
                    out += launcher.list_paths(sub)
        return out

    def _paths(self) -> list[str]:
        if not glob.has_magic(self.state_dir):
            return self._paths_under(self.state_dir)
        paths: list[str] = []  # a pattern: the per-user roots <tmp>/ddpmon-<uid>
        for root in sorted(glob.glob(self.state_dir)):
            what = _foreign_root(root)
            if what:
                self.problem(
                    root, f"state directory {root} {what}; skipped (planted by another user?)"
                )
                continue
            self.resolved(root, f"state directory {root} is fine now")
            paths.extend(self._paths_under(root))
        return paths

    def _paths_under(self, root: str) -> list[str]:
        if not os.path.isdir(root):
            if os.path.exists(root):
                self.problem(root, f"state directory {root} is not a directory; waiting for one")
            else:
                self.problem(root, f"state directory {root} does not exist yet; waiting for it")
            return []
        self.resolved(root, f"state directory {root} is there now")
        try:
            paths = files.list_files(root)
            subdirs = sorted(e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False))
        except OSError as exc:
            self.problem(
                root + "#list", f"state directory {root} cannot be listed ({exc.strerror or exc})"
            )
            return []
        self.resolved(root + "#list", f"state directory {root} can be listed again")
        for sub in subdirs:
            if attempts.is_attempt_dir(sub):
                continue  # an earlier attempt of a restarted job: counted, not a rank now
            try:
                paths.extend(files.list_files(sub))
            except OSError as exc:
                self.problem(
                    sub + "#list", f"state directory {sub} cannot be listed ({exc.strerror or exc})"
                )
                continue
            self.resolved(sub + "#list", f"state directory {sub} can be listed again")
        return paths


def _activity(
    path: str, state: schema.RankState, proc: psutil.Process | None, fresh: bool
) -> str | None:
    """What a rank of this node is doing: its own word (the state file's ``activity``) while
    its process runs and the file is fresh; else what only another process sees: frozen
    (stopped, or no longer writing its file), crashed (an exception, a fatal signal or a
    non-zero exit status; a clean end is not exported at all) or dead (gone without a word:
    killed from outside). The doctor's view (``doctor/view.py``) draws the same lines."""
    if proc is None:
        ending = state.exit
        if ending is None or ending.how == "os._exit":  # a signal leaves only its fault file
            try:
                offset = os.lstat(path).st_mtime - (state.now_unix or 0.0)
                ending = fault.of_run(path, state, offset) or ending
            except OSError:
                pass
        return Status.CRASHED if ending is not None else Status.DEAD
    if not fresh or host.is_stopped(proc):
        return Status.FROZEN
    act = state.activity
    return act.state if act is not None and act.state in DAEMON_ACTIVITIES else None


def _foreign_root(path: str) -> str | None:
    """What is wrong with a per-user root ``ddpmon-<uid>``: it must be a real directory
    owned by that uid and writable by no one else, so another user cannot pass files off
    as that user's ranks. None when it is fine (or not named for a uid)."""
    m = re.fullmatch(r"ddpmon-(\d+)", os.path.basename(path))
    if m is None:
        return None
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"cannot be checked ({exc.strerror or exc})"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory (a symbolic link?)"
    if info.st_uid != int(m.group(1)):
        return f"is owned by uid {info.st_uid}, not by uid {m.group(1)} its name says"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


@dataclass
class HistoryFile:
    """One rank's step history on this node, as ``/history`` serves it."""

    job: str
    rank: int
    path: str
    mtime: float
    """When it was last written (its write-ahead log included)."""


def _may_read(reader: Reader | None) -> Callable[[str], bool]:
    """Which files may be served to ``reader``: every one to a client that proved who it is
    (the web config's users, or a verified client certificate: trusted with the node's
    files), and to the daemon's own callers (None); to a client on this host without
    credentials, what its own user could read (its uid from the kernel's socket tables);
    nothing to anyone else."""
    if reader is None or reader.authenticated:
        return lambda path: True
    uid = host.peer_uid(reader.local, reader.peer)
    if uid is None:
        return lambda path: False
    return owners.readable_by(uid)


def _mtime(path: str) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0


def _json(data: Any) -> tuple[str, bytes]:
    return "application/json", json.dumps(data, default=str).encode()


@dataclass
class RankView:
    """One rank of this node as the daemon sees it."""

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


class Daemon:
    """Samples the node every ``interval`` seconds; its ``collect()`` serves the result."""

    def __init__(
        self,
        state_dir: str,
        interval: float = 1.0,
        stale_after: float = 15.0,
        gpus: bool = True,
        node_local: bool = False,
        slow_interval: float = nvml.SLOW_INTERVAL,
        max_per_user: int = owners.MAX_RANKS_PER_USER,
    ) -> None:
        self.state_dir = state_dir
        self.interval = interval
        self.stale_after = stale_after
        self.node_local = node_local
        self.hostname = socket.gethostname()
        self.files = StateFiles(state_dir, max_per_user)
        self._want_gpus = gpus
        self._slow_interval = slow_interval
        self._nv: Any = None
        self._readers: list[nvml.GpuReader] = []
        self._lost: set[int] = set()
        self._gpu_labels: dict[int, dict[str, str]] = {}
        self._xid: dict[tuple[int, int], list[float]] = {}  # (gpu, code) -> [count, last unix]
        self._xid_lock = threading.Lock()
        self._watcher: nvml.XidWatcher | None = None
        self._procs: dict[str, tuple[tuple[int, Any, int], psutil.Process | None]] = {}
        self._aborts: dict[
            str, tuple[float, str, int, bool]
        ] = {}  # path -> (mtime, job, rank, aborted)
        self._samples: list[Sample] = []
        self._last_pass = time.monotonic()
        self._failing: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpmon-daemon", daemon=True)

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._want_gpus:
            self._open_gpus()
        self.refresh()
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._watcher is not None:
            self._watcher.stop()
        if self._nv is not None:
            nvml.close_nvml(self._nv)
            self._nv = None

    @property
    def gpus(self) -> list[nvml.Gpu]:
        return [r.gpu for r in self._readers]

    def _open_gpus(self) -> None:
        nv = nvml.open_nvml("daemon")
        if nv is None:
            return
        try:
            gpus = nvml.list_gpus(nv)
        except Exception as exc:
            log.warning("ddpmon: daemon: GPU metrics are off: %s", nvml.explain(exc))
            nvml.close_nvml(nv)
            return
        if not gpus:
            log.warning("ddpmon: daemon: GPU metrics are off: NVML sees no GPU on this node")
            nvml.close_nvml(nv)
            return
        self._nv = nv
        self._readers = [nvml.GpuReader(nv, g, self._slow_interval) for g in gpus]
        watcher = nvml.XidWatcher(nv, gpus, self._on_xid)
        if watcher.start():
            self._watcher = watcher
        log.info(
            "ddpmon: daemon: watching %d GPU(s): %s",
            len(gpus),
            ", ".join(f"{g.index} {g.name} {g.uuid}" for g in gpus),
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refresh()
                if self._failing:
                    log.warning("ddpmon: daemon: sampling works again")
                    self._failing = None
            except Exception as exc:  # the loop cannot die; say each new failure once
                if self._failing != repr(exc):
                    self._failing = repr(exc)
                    log.warning("ddpmon: daemon: a sampling pass failed: %r", exc, exc_info=exc)

    # -- what a scrape sees -------------------------------------------------------------------

    def collect(self) -> Iterator[Any]:
        yield from families(self._samples)

    def refresh(self) -> None:
        """One pass over the state files, the ranks' processes and the GPUs."""
        ranks = self.ranks()
        samples = self._rank_samples(ranks)
        samples += self._gpu_samples(ranks)
        samples += self._xid_samples()
        samples += self._hang_abort_samples()
        samples.append(
            (
                "ddpmon_daemon_info",
                {"host": self.hostname, "version": __version__, "gpus": str(len(self._readers))},
                1.0,
            )
        )
        self._samples = samples
        self._last_pass = time.monotonic()

    @property
    def stale_after_seconds(self) -> float:
        """Age of the last finished sampling pass beyond which the daemon is unhealthy."""
        return max(HEALTHY_PASSES * self.interval, HEALTHY_MIN_SECONDS)

    def health_route(
        self, query: Query | None = None, reader: Reader | None = None
    ) -> tuple[str, bytes]:
        """``/healthz``: 200 while sampling passes finish, 503 (Unhealthy) once the last one
        is older than ``stale_after_seconds`` (a hung file system or NVML call): serving
        old samples forever would hide it, so a liveness probe restarts the daemon."""
        age = time.monotonic() - self._last_pass
        if age > self.stale_after_seconds or not self._thread.is_alive():
            raise Unhealthy(
                f"the last sampling pass finished {age:.0f} s ago "
                f"(interval {self.interval:g} s): sampling is stuck"
            )
        return "text/plain", f"ok: last sampling pass {age:.1f} s ago\n".encode()

    def states(self, reader: Reader | None = None) -> list[dict[str, Any]]:
        """The state files of this node's ranks that ``reader`` may read (``_may_read``),
        read now (for ``/state``). Each carries ``file_mtime_unix`` and ``served_unix`` (this
        host's clock), so a reader elsewhere can tell how old each file is whatever the
        clocks say."""
        out, served = [], time.time()
        may_read = _may_read(reader)
        for path, state, _, mtime in self.files.read_all():
            if not self._is_local(state) or not may_read(path):
                continue
            data = schema.to_json(state)
            signalled = fault.of_run(
                path, state, mtime - state.now_unix if state.now_unix is not None else 0.0
            )
            if (
                signalled is not None
            ):  # carried to a doctor elsewhere (--from), which cannot read it
                data["exit"] = records.dump(signalled)
            data["file_mtime_unix"] = mtime
            data["served_unix"] = served
            out.append(data)
        return out

    def state_route(
        self, query: Query | None = None, reader: Reader | None = None
    ) -> tuple[str, bytes]:
        return "application/json", json.dumps(self.states(reader), default=str).encode()

    def launchers(self, reader: Reader | None = None) -> list[dict[str, Any]]:
        """The records of this node's launchers (``state/launcher.py``: what ``ddpmon run``
        tried, also on a node whose ranks never started) that ``reader`` may read, each with
        ``file_mtime_unix`` and ``served_unix`` as ``/state``'s files."""
        out, served = [], time.time()
        may_read = _may_read(reader)
        for path in self.files.launcher_paths():
            if not may_read(path):
                continue
            try:
                record, mtime = launcher.read(path)
            except StateFileError:
                continue
            if record.host != socket.gethostname():
                continue  # another node's, in a shared directory: its own daemon serves it
            data = launcher.to_json(record)
            data["file_mtime_unix"], data["served_unix"] = mtime, served
            out.append(data)
        return out

    def launchers_route(
        self, query: Query | None = None, reader: Reader | None = None
    ) -> tuple[str, bytes]:
        return _json(self.launchers(reader))

    def histories(self, reader: Reader | None = None) -> list[HistoryFile]:
        """The step histories of this node's ranks (for ``/history``): each local state file's
        ``rank-<R>.history.sqlite`` beside it, a regular file of the state file's owner (never
        a link: the files of one user are not served as another's) that ``reader`` may read;
        one per (job, rank), the one written last."""
        found: dict[tuple[str, int], HistoryFile] = {}
        may_read = _may_read(reader)
        for path, state, owner, _ in self.files.read_all():
            if not self._is_local(state):
                continue
            where = history.path_for(os.path.dirname(path), state.rank)
            if not may_read(where):
                continue
            try:
                info = os.lstat(where)
            except OSError:
                continue
            if not stat.S_ISREG(info.st_mode) or info.st_uid != owner:
                self.files.problem(
                    where,
                    f"history {where} is not a regular file of the state file's owner "
                    "(a link?); not served",
                )
                continue
            self.files.resolved(where, f"history {where} is served again")
            key = (state.job or "", state.rank)
            mtime = max(info.st_mtime, _mtime(where + "-wal"))
            if key not in found or found[key].mtime < mtime:
                found[key] = HistoryFile(key[0], state.rank, where, mtime)
        return sorted(found.values(), key=lambda h: (h.job, h.rank))

    def history_route(self, query: Query, reader: Reader | None = None) -> tuple[str, bytes]:
        """``/history``: this node's histories that ``reader`` may read, or a page of one
        (``history.page``: at most ``history.PAGE_ROWS`` steps and about ``history.PAGE_BYTES``
        per answer)."""
        try:
            ask = history.Ask.parse(query)
        except history.BadQuery as exc:
            raise BadRequest(str(exc)) from None
        found = [h for h in self.histories(reader) if ask.job is None or h.job == ask.job]
        if ask.rank is None:
            return _json(
                {
                    "format": history.PAGE_FORMAT,
                    "host": self.hostname,
                    "served_unix": time.time(),
                    "page_rows": history.PAGE_ROWS,
                    "page_bytes": history.PAGE_BYTES,
                    "histories": [self._listed(h) for h in found],
                }
            )
        mine = [h for h in found if h.rank == ask.rank]
        of_job = f" of job {ask.job!r}" if ask.job else ""
        if not mine:
            raise LookupError(
                f"no history of rank {ask.rank}{of_job} on this node: /history lists those there"
            )
        if len(mine) > 1:
            raise BadRequest(
                f"rank {ask.rank} has histories of jobs {', '.join(repr(h.job) for h in mine)} "
                "on this node: add job=JOB"
            )
        try:
            body = history.page(mine[0].path, ask.since, ask.limit, ask.buckets)
        except history.HistoryError as exc:
            raise LookupError(
                f"the history of rank {ask.rank}{of_job} cannot be served: {exc}"
            ) from None
        body.update(
            job=mine[0].job,
            rank=mine[0].rank,
            file_mtime_unix=mine[0].mtime,
            served_unix=time.time(),
        )
        return _json(body)

    def _listed(self, h: HistoryFile) -> dict[str, Any]:
        """A history as ``/history`` lists it: job, rank, rows, last step, when written."""
        entry: dict[str, Any] = {"job": h.job, "rank": h.rank, "file_mtime_unix": h.mtime}
        try:
            entry["rows"], entry["last_step"] = history.size(h.path)
        except history.HistoryError as exc:
            entry["problem"] = str(exc)
        return entry

    # -- ranks -----------------------------------------------------------------------------------

    def _is_local(self, state: schema.RankState) -> bool:
        return self.node_local or state.host == self.hostname

    def ranks(self) -> list[RankView]:
        """This node's ranks: state files written on this host (every file with
        ``node_local``), minus detached ones; one view per (job, rank), the freshest."""
        now = time.time()
        views: dict[tuple[str, int], RankView] = {}
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
            if not self._is_local(state):
                continue
            seen.add(path)
            # the writer's clock, but never past what the file system saw: a file stamped in
            # the future is fresh for at most stale_after past its last write (the slack is
            # for a network file system whose server's clock is behind this host's)
            beat = min(state.now_unix, written + self.stale_after)
            proc = self._process(
                path, state.pid, state.started_unix, state.host == self.hostname, state.rank, owner
            )
            alive = proc is not None and host.is_alive(proc)
            fresh = now - beat <= self.stale_after
            view = RankView(
                state.job or "",
                state.rank,
                up=alive and fresh,
                last_progress_unix=min(state.last_progress_unix or 0.0, beat),
                hang=state.hang is not None
                and alive,  # a killed job's last report is not a hang now
                heartbeat_unix=beat,
                proc=proc,
                activity=_activity(path, state, proc if alive else None, fresh),
                attempt=state.attempt,
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
                f"{self.state_dir}#pid#{owner}",
                f"state files of uid {owner} name processes of "
                "other users, which are not their ranks: such a rank counts as gone",
            )
            proc = None
        self._procs[path] = (key, proc)
        return proc

    @staticmethod
    def _rank_samples(ranks: list[RankView]) -> list[Sample]:
        out: list[Sample] = []
        for v in ranks:
            labels = {"job": v.job, "rank": str(v.rank)}
            out.append(("ddpmon_rank_up", labels, 1.0 if v.up else 0.0))
            out.append(
                ("ddpmon_rank_last_progress_timestamp_seconds", labels, v.last_progress_unix)
            )
            out.append(("ddpmon_rank_hang_suspected", labels, 1.0 if v.hang else 0.0))
            if v.activity is not None:
                out += state_set(
                    "ddpmon_rank_activity", labels, "activity", DAEMON_ACTIVITIES, v.activity
                )
            if v.attempt is not None:
                out.append(("ddpmon_rank_attempt", labels, float(v.attempt)))
        return out

    def _hang_abort_samples(self) -> list[Sample]:
        """``ddpmon_hang_aborts_total``: per (job, rank), the kept attempts (current one
        included) that ddpmon ended after a proven hang; a file is read again only when it
        changed."""
        counts: dict[tuple[str, int], int] = {}
        dirs = {os.path.dirname(found.path) for found in self.files.read_all()}
        seen: set[str] = set()
        for d in dirs:
            for path in [*attempts.attempt_files(d), *files.list_files(d)]:
                seen.add(path)
                try:
                    info = os.lstat(path)
                    cached = self._aborts.get(path)
                    if cached is None or cached[0] != info.st_mtime:
                        state = files.read(path)
                        cached = (
                            info.st_mtime,
                            state.job or "",
                            state.rank,
                            attempts.ended_by_hang_abort(state),
                        )
                        self._aborts[path] = cached
                except (OSError, StateFileError):
                    continue
                key = (owners.name_of(cached[1], info.st_uid, self.files.shared), cached[2])
                counts[key] = counts.get(key, 0) + (1 if cached[3] else 0)
        for path in [p for p in self._aborts if p not in seen]:
            del self._aborts[path]
        return [
            ("ddpmon_hang_aborts_total", {"job": job, "rank": str(rank)}, float(n))
            for (job, rank), n in sorted(counts.items())
        ]

    # -- GPUs ---------------------------------------------------------------------------------------

    def _gpu_samples(self, ranks: list[RankView]) -> list[Sample]:
        by_pid = {v.proc.pid: v for v in ranks if v.proc is not None}
        out: list[Sample] = []
        for reader in self._readers:
            gpu = reader.gpu
            if gpu.index in self._lost:
                continue
            try:
                if reader.slow_due():
                    reader.refresh_slow()
                pids = reader.processes()
                owners = sorted(
                    (by_pid[p] for p in pids if p in by_pid), key=lambda v: (v.job, v.rank)
                )
                owner = owners[0] if owners else None
                labels = {
                    "job": owner.job if owner else "",
                    "rank": str(owner.rank) if owner else "",
                    "gpu": str(gpu.index),
                    "gpu_uuid": gpu.uuid,
                }
                out.extend(reader.read(labels))
            except nvml.GpuLost as exc:
                self._lost.add(gpu.index)
                log.warning(
                    "ddpmon: daemon: GPU %d (%s): %s; its metrics are off until the daemon "
                    "restarts",
                    gpu.index,
                    gpu.uuid,
                    exc,
                )
                continue
            self._gpu_labels[gpu.index] = labels
            for pid in pids:
                v = by_pid.get(pid)
                out.append(
                    (
                        "ddpmon_gpu_process_info",
                        {
                            "gpu": str(gpu.index),
                            "gpu_uuid": gpu.uuid,
                            "pid": str(pid),
                            "job": v.job if v else "",
                            "rank": str(v.rank) if v else "",
                        },
                        1.0,
                    )
                )
        return out

    def _on_xid(self, gpu: nvml.Gpu, code: int, when: float) -> None:
        log.warning("ddpmon: daemon: GPU %d (%s): XID %d", gpu.index, gpu.uuid, code)
        with self._xid_lock:
            entry = self._xid.setdefault((gpu.index, code), [0.0, 0.0])
            entry[0] += 1
            entry[1] = when

    def _xid_samples(self) -> list[Sample]:
        with self._xid_lock:
            xids = sorted((k, list(v)) for k, v in self._xid.items())
        uuids = {g.index: g.uuid for g in self.gpus}
        out: list[Sample] = []
        for (index, code), (count, last) in xids:
            base = self._gpu_labels.get(index) or {
                "job": "",
                "rank": "",
                "gpu": str(index),
                "gpu_uuid": uuids.get(index, ""),
            }
            labels = {**base, "xid": str(code)}
            out.append(("ddpmon_gpu_xid_errors_total", labels, count))
            out.append(("ddpmon_gpu_last_xid_timestamp_seconds", labels, last))
        return out
