"""The node daemon's read-only routes, ``/state`` and ``/history``: the state files and
step histories of this node's ranks, for ``doctor --from`` and ``report --from`` elsewhere
(``remote/daemons.py`` reads them). Each answer holds only what the asker may read
(``may_read``): the files of one user are never served to another."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..collectors import host
from ..errors import StateFileError
from ..httpd import BadRequest, Query, Reader
from ..state import fault, history, launcher, owners, records, schema
from .discovery import StateFiles


@dataclass
class HistoryFile:
    """One rank's step history on this node, as ``/history`` serves it."""

    job: str
    rank: int
    path: str
    mtime: float
    """When it was last written (its write-ahead log included)."""


def may_read(reader: Reader | None) -> Callable[[str], bool]:
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


class Routes:
    """The routes over ``files``, serving the ranks whose state ``is_local`` says ran here."""

    def __init__(
        self, files: StateFiles, is_local: Callable[[schema.RankState], bool], hostname: str
    ) -> None:
        self.files = files
        self._is_local = is_local
        self.hostname = hostname

    def states(self, reader: Reader | None = None) -> list[dict[str, Any]]:
        """The state files of this node's ranks that ``reader`` may read (``may_read``),
        read now (for ``/state``). Each carries ``file_mtime_unix`` and ``served_unix`` (this
        host's clock), so a reader elsewhere can tell how old each file is whatever the
        clocks say."""
        out, served = [], time.time()
        readable = may_read(reader)
        for path, state, _, mtime in self.files.read_all():
            if not self._is_local(state) or not readable(path):
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
        readable = may_read(reader)
        for path in self.files.launcher_paths():
            if not readable(path):
                continue
            try:
                record, mtime = launcher.read(path)
            except StateFileError:
                continue
            if record.host != self.hostname:
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
        readable = may_read(reader)
        for path, state, owner, _ in self.files.read_all():
            if not self._is_local(state):
                continue
            where = history.path_for(os.path.dirname(path), state.rank)
            if not readable(where):
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
        per answer), or with ``busy=SECONDS`` one's recent busy times (``history.busy_since``,
        at most ``history.BUSY_ROWS`` steps: the straggler rule's sustain check)."""
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
        body: dict[str, Any]
        try:
            if ask.busy is not None:  # what the straggler rule's sustain check reads
                body = {
                    "busy": history.busy_since(
                        mine[0].path,
                        ask.busy,
                        min(ask.at_least, history.BUSY_ROWS),
                        history.BUSY_ROWS,
                    )
                }
            else:
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
