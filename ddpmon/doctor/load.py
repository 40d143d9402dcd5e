"""Reading the ranks' state files for the doctor: every ``rank-<R>.json`` of a directory,
bad files reported by name, files of different jobs kept apart.

Times inside a state file are on its writer's clock. ``offset`` maps them onto the clock of
the file system, so files written on hosts whose clocks differ still compare: through the
clock offset from rank 0's that the rank measured at start (``state.clock``) and one shift
for the whole job from rank 0's clock to the file system's (``align``); for a file without a
measurement, as the file's modification time minus the writer's ``now_unix`` at writing. A
modification time alone misleads once files are copied (every file then seems written at
the copy), a measured offset does not.
"""

from __future__ import annotations

import collections
import json
import os
import stat
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import StateFileError
from ..remote import daemons
from ..state import attempts, files, launcher, owners, schema
from ..state.records import SchemaError
from ..webconfig import HttpConfig


@dataclass(frozen=True)
class Daemon:
    """A node daemon asked (``--from``), and how: to ask it again for more (a rank's recent
    busy times, ``doctor/busy.py``)."""

    address: str
    client: HttpConfig


@dataclass
class StateFile:
    """One rank's state file as read (checked against the schema), with its modification
    time."""

    path: str
    state: schema.RankState
    mtime: float
    daemon: Daemon | None = None
    """The node daemon that served it (``--from``); None for a file read here."""
    reference: float | None = None
    """The file system's clock minus rank 0's, one for the job (``align``); None when no
    rank of the job measured its clock."""

    @property
    def rank(self) -> int:
        return self.state.rank

    @property
    def job(self) -> str:
        return self.state.job or "?"

    @property
    def offset(self) -> float:
        """Seconds to add to a time of this file's writer to get file-system time."""
        clock = self.state.clock
        if clock is not None and self.reference is not None:
            return self.reference - clock.offset_seconds
        now = self.state.now_unix
        return self.mtime - now if now is not None else 0.0

    @property
    def written(self) -> float:
        """When the file was last written, on the file system's clock."""
        now = self.state.now_unix
        return now + self.offset if now is not None else self.mtime

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


@dataclass
class Launcher:
    """One node's launcher record, with when it was written on the doctor's clock."""

    name: str
    record: launcher.LauncherState
    mtime: float


@dataclass
class Loaded:
    """The readable files of a state directory and, by name, the ones that are not."""

    state_dir: str
    files: list[StateFile] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)
    unreachable: list[Unreachable] = field(default_factory=list)
    """``--from`` daemons that did not answer."""
    launchers: list[Launcher] = field(default_factory=list)
    """What each node's launcher tried (``ddpmon run``), also where no rank started."""

    def jobs(self) -> dict[str, list[StateFile]]:
        """Files by job, each list ordered by rank."""
        out: dict[str, list[StateFile]] = collections.defaultdict(list)
        for f in self.files:
            out[f.job].append(f)
        return {job: sorted(files, key=lambda f: f.rank) for job, files in out.items()}


def load_dir(state_dir: str) -> Loaded:
    """Read every rank state file in ``state_dir``. A directory that is missing or cannot be
    listed raises StateFileError; a bad file is kept in ``bad`` with the reason."""
    try:
        info = os.stat(state_dir)
    except FileNotFoundError:
        raise StateFileError(
            state_dir,
            "no such directory; pass the directory of the ranks' state files "
            "(the job's DDPMON_STATE_DIR; by default <tmp>/ddpmon-<uid>/<job>)",
        ) from None
    except PermissionError as exc:
        raise StateFileError(
            state_dir,
            f"cannot be read by this user ({exc.strerror}): run the doctor as the job's "
            "user, or ask them to share the directory with your group (docs/security.md)",
        ) from None
    if not stat.S_ISDIR(info.st_mode):
        raise StateFileError(
            state_dir, "is not a directory; pass the directory that holds rank-<R>.json"
        )
    try:
        paths = files.list_files(state_dir)
    except OSError as exc:
        owner = f"owned by uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}"
        raise StateFileError(
            state_dir,
            f"cannot be listed ({exc.strerror or exc}; {owner}): run the "
            "doctor as the job's user, or ask them to share it with your group",
        ) from None
    loaded = Loaded(state_dir)
    read = []
    with files.cycle_collection_paused():
        for path in paths:
            try:
                state, info = files.read_stat(path)
            except StateFileError as exc:
                loaded.bad.append((path, exc.reason))
                continue
            read.append((path, state, info))
    separated, _ = owners.separate([(path, state, info.st_uid) for path, state, info in read])
    for (path, state), (_, _, info) in zip(separated, read):
        loaded.files.append(StateFile(path, state, files.written_unix(info)))
    for path in launcher.list_paths(state_dir):
        try:
            record, mtime = launcher.read(path)
        except StateFileError as exc:
            loaded.bad.append((path, exc.reason))
            continue
        loaded.launchers.append(Launcher(path, record, mtime))
    align(loaded.files)
    return loaded


def align(state_files: Sequence[StateFile]) -> None:
    """Set each job's ``reference``: the file system's clock minus rank 0's, the median over
    the files whose writer measured its clock (each file's modification time against its
    last write on rank 0's clock). One shift for the job keeps the order of the ranks'
    times as measured, whatever the modification times say."""
    by_job: dict[str, list[StateFile]] = collections.defaultdict(list)
    for f in state_files:
        by_job[f.job].append(f)
    for job_files in by_job.values():
        shifts = sorted(
            f.mtime - (f.state.now_unix - f.state.clock.offset_seconds)
            for f in job_files
            if f.state.clock is not None and f.state.now_unix is not None
        )
        reference = statistics.median(shifts) if shifts else None
        for f in job_files:
            f.reference = reference


REMOTE_MAX_BYTES = 256 * 1024 * 1024  # a daemon's /state: at most a few MiB per rank of its node
REMOTE_DEADLINE_SECONDS = 5.0
"""Every ``--from`` daemon is read at once; those that have not answered by then are named."""


@dataclass
class Unreachable:
    """A node daemon (``--from``) that did not answer: its ranks' state is not known here."""

    address: str
    """As given: ``HOST:PORT``."""
    reason: str
    ips: list[str] = field(default_factory=list)
    """The addresses its host name stands for (to match peers named in the ranks' errors)."""


def load_remote(
    addresses: Sequence[str],
    timeout: float = 3.0,
    deadline: float = REMOTE_DEADLINE_SECONDS,
    client: HttpConfig | None = None,
) -> Loaded:
    """Read the state files that ``ddpmon daemon --serve-state`` serves at ``HOST:PORT/state``,
    for jobs spread over nodes without a shared file system. Every daemon is read at once:
    ``timeout`` seconds to connect and between reads, ``deadline`` for all of them together,
    so dead nodes cost the doctor seconds, not seconds each; each answer is read as it comes,
    while the others are on their way, and its bytes let go. Each file's modification time
    is carried over to this host's clock through the daemon's own clock (``served_unix``)."""
    loaded = Loaded(", ".join(addresses))
    client = client or HttpConfig()
    urls = [daemons.base_url(a) + "/state" for a in addresses]
    launcher_urls = [daemons.base_url(a) + "/launchers" for a in addresses]
    read: dict[int, Loaded] = {}  # by index: a daemon's files or problems, its launchers
    for i, answer in daemons.fetch_each(
        urls + launcher_urls, timeout, deadline, REMOTE_MAX_BYTES, client
    ):
        if i < len(urls):
            read[i] = _states(Daemon(addresses[i], client), urls[i], answer, timeout)
        else:
            read[i] = Loaded("", launchers=_launchers(addresses[i - len(urls)], answer))
    for i, (address, url) in enumerate(zip(addresses, urls)):
        loaded.launchers += read[i + len(urls)].launchers if i + len(urls) in read else []
        if i in read:
            loaded.files += read[i].files
            loaded.bad += read[i].bad
            loaded.unreachable += read[i].unreachable
            continue
        reason = (
            f"did not answer within {deadline:.0f} s (the doctor waits that long for all "
            "daemons together)"
        )
        loaded.unreachable.append(Unreachable(address, reason))
        loaded.bad.append((url, _cannot_be_read(reason)))
    align(loaded.files)
    return loaded


def _cannot_be_read(reason: str) -> str:
    return (
        f"cannot be read ({reason}); is `ddpmon daemon --serve-state` running there, and is "
        "the port reachable?"
    )


def _states(daemon: Daemon, url: str, answer: daemons.Answer, timeout: float) -> Loaded:
    """A daemon's ``/state`` answer: its ranks' files, or why there are none."""
    address = daemon.address
    out = Loaded(address)
    ips, body, received = answer
    if isinstance(body, daemons.Unbounded):
        out.bad.append((f"{address}/state", f"{body}; is that address a ddpmon daemon?"))
        return out
    if isinstance(body, BaseException):
        reason = daemons.why(body, timeout)
        out.unreachable.append(Unreachable(address, reason, ips))
        out.bad.append((url, _cannot_be_read(reason)))
        return out
    try:
        entries = json.loads(body)
        if not isinstance(entries, list) or len(entries) > schema.MAX_RANKS:
            raise ValueError("not a JSON list of state files")
    except (ValueError, RecursionError) as exc:
        why = (
            "nests JSON too deeply"
            if isinstance(exc, RecursionError)
            else f"is not ddpmon's /state ({exc})"
        )
        out.bad.append((f"{address}/state", f"{why}; is that address a ddpmon daemon?"))
        return out
    for data in entries:
        rank = data.get("rank") if isinstance(data, dict) else None
        name = f"{address}/rank-{rank}.json"
        try:
            state = files.load(name, data)
        except StateFileError as exc:
            out.bad.append((name, exc.reason))
            continue
        served, mtime = state.served_unix, state.file_mtime_unix
        mtime = (
            received - (served - mtime) if served is not None and mtime is not None else received
        )
        out.files.append(StateFile(name, state, mtime, daemon))
    return out


def _launchers(address: str, answer: daemons.Answer) -> list[Launcher]:
    """A daemon's ``/launchers``; nothing from a daemon that does not serve it (older)."""
    _, body, received = answer
    if not isinstance(body, bytes):
        return []
    try:
        entries = json.loads(body)
    except (ValueError, RecursionError):
        return []
    out = []
    for data in entries if isinstance(entries, list) else []:
        try:
            record = launcher.parse(data)
        except (SchemaError, RecursionError):
            continue
        served, mtime = record.served_unix, record.file_mtime_unix
        when = received - (served - mtime) if served is not None and mtime is not None else received
        out.append(Launcher(f"{address}/launcher-{record.host}-{record.pid}.json", record, when))
    return out


def earlier_attempts(state_dir: str, job: str | None, diagnose: Any) -> list[dict[str, Any]]:
    """The kept earlier attempts of a restarted job (``<state_dir>/attempt-<N>/``), oldest
    first: each one's culprit and how it ended. ``diagnose(directory)`` is the doctor's own
    pass over that directory (a Diagnosis); the culprits that ddpmon's exit records name
    (``hang_action=abort``) come first."""
    out: list[dict[str, Any]] = []
    for number, directory in attempts.earlier(state_dir):
        loaded = load_dir(directory)
        ranks = [f.state for f in loaded.files if job is None or f.state.job == job]
        if not ranks:
            continue
        aborted = [s for s in ranks if attempts.ended_by_hang_abort(s)]
        culprits = sorted({c for s in aborted for c in (s.exit.culprits if s.exit else [])})
        try:
            found = diagnose(directory)
            verdict, suspects = found.verdict, list(found.suspect_ranks)
        except Exception:  # one bad directory never hides the current attempt
            verdict, suspects = "no_data", []
        ends = [s.exit.unix for s in ranks if s.exit is not None]
        if aborted:
            ended = (
                f"ended by ddpmon after a hang (hang_action=abort, exit {attempts.HANG_EXIT_CODE})"
            )
        else:
            ended = _how_ended(ranks, suspects)
        out.append(
            {
                "attempt": number,
                "state_dir": directory,
                "verdict": verdict,
                "culprit_ranks": culprits or suspects,
                "ended": ended,
                "steps": max(s.step for s in ranks),
                "started_unix": min(
                    (s.started_unix for s in ranks if s.started_unix), default=None
                ),
                "ended_unix": min(ends)
                if ends
                else max((s.now_unix or 0.0) for s in ranks) or None,
                "last_progress_unix": max((s.last_progress_unix or 0.0) for s in ranks) or None,
                "lost_seconds": None,
            }
        )
    following = out[1:] + [None]
    for entry, after in zip(out, following):
        start = after["started_unix"] if after else _current_start(state_dir, job)
        if start and entry["last_progress_unix"]:
            entry["lost_seconds"] = round(max(0.0, start - entry["last_progress_unix"]), 1)
    return out


def _how_ended(ranks: list[schema.RankState], suspects: list[int]) -> str:
    """How an attempt ended, from its first failed rank's exit record."""
    failed = sorted(
        (s for s in ranks if s.exit is not None and (s.exit.exception or s.exit.code)),
        key=lambda s: (s.rank not in suspects, s.exit.unix if s.exit else 0.0),
    )
    if failed:
        s = failed[0]
        assert s.exit is not None
        what = s.exit.exception or f"exit status {s.exit.code}"
        return f"rank {s.rank} failed: {what}" + (f" at {s.exit.where}" if s.exit.where else "")
    if any(s.exit is None for s in ranks):
        return "ended without an exit record (killed from outside, or by the launcher)"
    return "every rank ended cleanly"


def _current_start(state_dir: str, job: str | None) -> float | None:
    """When the current attempt attached (its earliest rank)."""
    starts = [
        f.state.started_unix
        for f in load_dir(state_dir).files
        if f.state.started_unix and (job is None or f.state.job == job)
    ]
    return min(starts) if starts else None
