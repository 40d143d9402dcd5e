"""The per-step history of one rank: an embedded SQLite database next to its state file.

Every rank keeps ``<state_dir>/rank-<R>.history.sqlite``: one row per step (phase times,
exposed communication, a bucket summary, memory and GPU utilisation when known), the rank's
identity, the findings it logged as they appeared, and how it ended. The rank's writer
(``rank/writers.py``) commits one batch per pass through ``HistoryStore`` (WAL journal, so
a job killed with SIGKILL keeps every committed batch and readers never block it). Nothing
here imports torch: ``ddpmon report`` and ``ddpmon compare`` read these files on any machine.

Bounded: all steps are kept up to ``max_rows``; past that the older half is thinned to every
other row until under the bound (old history gets sparser, recent history stays whole).
About 90 bytes per step without bucket timing, plus about 25 bytes per bucket (docs/report.md).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import files

log = logging.getLogger("ddpmon")

SCHEMA_VERSION = 1
MAX_ROWS = 200_000
SUFFIX = ".history.sqlite"
NAME_PATTERN = re.compile(r"^rank-(\d+)\.history\.sqlite$")

# Per-step columns, in table order; all seconds unless named otherwise.
STEP_COLUMNS = (
    "step",
    "start_unix",
    "end_unix",
    "step_seconds",
    "forward_seconds",
    "backward_seconds",
    "exposed_comm_seconds",
    "data_wait_seconds",
    "h2d_seconds",
    "optimizer_seconds",
    "other_seconds",
    "buckets",
    "gpu_utilization_ratio",
    "gpu_memory_used_bytes",
    "torch_memory_allocated_bytes",
    "process_resident_memory_bytes",
)
_FLOAT_COLUMNS = STEP_COLUMNS[1:11]
_BUCKETS = STEP_COLUMNS.index("buckets")
SAMPLE_KEYS = STEP_COLUMNS[12:]  # sampled by the writer, once per batch

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY,           -- steps completed on this rank when it ended (1, 2, ...)
    start_unix REAL NOT NULL,
    end_unix REAL NOT NULL,
    step_seconds REAL NOT NULL,         -- forward start to the next forward start
    forward_seconds REAL,
    backward_seconds REAL,              -- backward start to the last gradient ready
    exposed_comm_seconds REAL,          -- communication compute did not hide
    data_wait_seconds REAL,
    h2d_seconds REAL,
    optimizer_seconds REAL,
    other_seconds REAL,
    straggler_score REAL,               -- never written (who is slow needs every rank: readers
                                        -- compute it); kept so that an older ddpmon reads the file
    buckets TEXT,                       -- JSON [[index, seconds, bytes], ...] or NULL
    gpu_utilization_ratio REAL,         -- 0..1, sampled once per batch
    gpu_memory_used_bytes INTEGER,
    torch_memory_allocated_bytes INTEGER,
    process_resident_memory_bytes INTEGER
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS findings (
    unix REAL NOT NULL, step INTEGER, kind TEXT NOT NULL, key TEXT NOT NULL, text TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS exit (
    unix REAL NOT NULL, step INTEGER, how TEXT NOT NULL, record TEXT
);
"""


def path_for(state_dir: str, rank: int) -> str:
    return os.path.join(state_dir, f"rank-{rank}{SUFFIX}")


def list_files(state_dir: str) -> list[str]:
    """The history databases in ``state_dir``, ordered by rank."""
    from . import files

    return files.list_files(state_dir, NAME_PATTERN)


class HistoryError(Exception):
    """A history database that cannot be read; the message names the file and why."""


# -- writing ----------------------------------------------------------------------------------


class HistoryStore:
    """One rank's database, opened for writing. Used from one thread (the writer's)."""

    def __init__(self, path: str, identity: dict[str, Any], max_rows: int = MAX_ROWS) -> None:
        self.path = path
        self.max_rows = max(16, int(max_rows))
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        # SQLite opens (and creates) the database and its -wal and -shm by name, following any
        # link there: this rank makes all three itself, new, as private as the state file, and
        # lets SQLite open only what exists; a new run starts a new history anyway
        made = {}
        for p in (path, path + "-wal", path + "-shm"):
            fd = files.open_private(p)
            made[p] = files.inode_of(fd)
            os.close(fd)
        uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=rw"
        self._db = sqlite3.connect(
            uri, uri=True, timeout=5.0, isolation_level=None, check_same_thread=False
        )
        try:  # (a writer that fails here, a full disk, tries again later: no connection left open)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "PRAGMA synchronous=NORMAL"
            )  # WAL + NORMAL: a crash loses no committed batch
            self._db.executescript(_SCHEMA)
            for p, inode in made.items():
                if files.inode_of(p) != inode:
                    raise HistoryError(
                        f"{p} was replaced by another file while it was opened (another user "
                        "of the state directory?); not written. Fix: a state directory "
                        "others may write needs the sticky bit (chmod +t)"
                    )
            with self._db:
                self._db.execute("BEGIN")
                meta = {
                    "schema_version": SCHEMA_VERSION,
                    "created_unix": time.time(),
                    "identity": json.dumps(identity, default=str),
                    "max_rows": self.max_rows,
                }
                self._db.executemany(
                    "INSERT INTO meta VALUES (?, ?)", [(k, str(v)) for k, v in meta.items()]
                )
        except BaseException:
            self._db.close()
            raise
        self.rows = 0

    def add_steps(
        self,
        steps: list[dict[str, Any]],
        sample: dict[str, Any] | None = None,
        missing: tuple[int, int] | None = None,
    ) -> None:
        """Insert (or replace) a batch of per-step dicts in one transaction, with the steps
        (first, last) before them that the rank lost (``missing_steps``)."""
        if not steps:
            return
        sample = sample or {}
        rows = [_row(s, sample) for s in steps]
        marks = ",".join("?" * len(STEP_COLUMNS))
        with self._db:
            self._db.execute("BEGIN")  # columns named: a file of an older ddpmon has more
            self._db.executemany(
                f"INSERT OR REPLACE INTO steps ({', '.join(STEP_COLUMNS)}) VALUES ({marks})", rows
            )
            if missing is not None:
                found = self._db.execute(
                    "SELECT value FROM meta WHERE key = 'missing_steps'"
                ).fetchone()
                ranges = missing_steps({"missing_steps": found[0]} if found else {}) + [missing]
                self._db.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('missing_steps', ?)", (json.dumps(ranges),)
                )
        self.rows += len(rows)
        if self.rows > self.max_rows:
            self._thin()

    def add_finding(self, kind: str, key: str, text: str, step: int | None) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO findings VALUES (?, ?, ?, ?, ?)", (time.time(), step, kind, key, text)
            )

    def set_meta(self, key: str, value: Any) -> None:
        """Keep ``value`` (JSON) under ``key`` in ``meta``, replacing the one before."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value, default=str))
            )

    def set_exit(self, how: str, step: int | None, record: dict[str, Any] | None) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM exit")
            self._db.execute(
                "INSERT INTO exit VALUES (?, ?, ?, ?)",
                (time.time(), step, how, json.dumps(record, default=str) if record else None),
            )

    def close(self) -> None:
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            self._db.close()

    def _thin(self) -> None:
        """Keep every other row of the older half, until ``max_rows`` rows are left; recent
        steps stay whole."""
        (count,) = self._db.execute("SELECT count(*) FROM steps").fetchone()
        while count > self.max_rows:
            self._thin_once(count)
            (count,) = self._db.execute("SELECT count(*) FROM steps").fetchone()
        self.rows = count

    def _thin_once(self, count: int) -> None:
        half = count // 2
        (through,) = self._db.execute(
            "SELECT step FROM steps ORDER BY step LIMIT 1 OFFSET ?", (half - 1,)
        ).fetchone()
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "DELETE FROM steps WHERE step IN (SELECT step FROM (SELECT step, row_number() "
                "OVER (ORDER BY step) AS n FROM steps) WHERE n <= ? AND n % 2 = 0)",
                (half,),
            )
            self._db.execute(
                "INSERT OR REPLACE INTO meta VALUES ('thinned_through_step', ?)", (str(through),)
            )


TRAINING_KEYS = ("batch_size", "micro_batches", "global_batch_size")
"""The batch facts (``schema.DataInfo``) the history keeps in ``meta['training']``."""


def training_of(state: Mapping[str, Any]) -> dict[str, Any]:
    """What a run trained with, from a state file's body: the batch (``TRAINING_KEYS``), the
    world size, the optimizer and its learning rate.
    The rank's writer keeps it in ``meta['training']``, which ``compare`` reads."""
    data = state.get("data") or {}
    return {
        **{key: data.get(key) for key in TRAINING_KEYS},
        "world_size": state.get("ddp_world_size") or state.get("world_size"),
        "optimizer": state.get("optimizer"),
    }


def training(meta: Mapping[str, Any]) -> dict[str, Any]:
    """``meta['training']`` (``training_of``), empty when absent or unreadable."""
    try:
        value = json.loads(meta.get("training") or "{}")
    except (ValueError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}


def missing_steps(meta: Mapping[str, Any]) -> list[tuple[int, int]]:
    """The steps (first, last), oldest first, that a rank lost before they reached its
    history: not written while its writes failed (a full disk), and gone from its bounded
    ring of recent steps by the time writing worked again. Kept in ``meta`` as JSON; an
    unreadable value reads as none."""
    try:
        ranges = json.loads(meta.get("missing_steps") or "[]")
        return [(int(a), int(b)) for a, b in ranges]
    except (ValueError, TypeError):
        return []


def _row(s: dict[str, Any], sample: dict[str, Any]) -> tuple[Any, ...]:
    out: list[Any] = [int(s["step"])]
    for key in _FLOAT_COLUMNS:
        v = s.get(key)
        out.append(float(v) if isinstance(v, (int, float)) else None)
    buckets = s.get("buckets")
    out.append(
        json.dumps(
            [[b.get("index"), _round(b.get("seconds")), b.get("bytes")] for b in buckets],
            separators=(",", ":"),
        )
        if buckets
        else None
    )
    for key in SAMPLE_KEYS:
        v = s.get(key, sample.get(key))
        out.append(v if isinstance(v, (int, float)) else None)
    return tuple(out)


def _round(v: Any) -> Any:
    return float(f"{v:.6g}") if isinstance(v, float) else v


# -- reading ----------------------------------------------------------------------------------


def read(
    path: str,
    max_points: int | None = None,
    decode_buckets: bool = True,
    bin_stride: int | None = None,
) -> dict[str, Any]:
    """One rank's history: ``meta`` (with ``identity``), ``steps`` (column -> list, oldest
    first; ``buckets`` decoded unless ``decode_buckets=False``, then JSON text), ``findings``
    and ``exit`` (None when it never wrote one: killed, or still running), ``first`` and
    ``last`` (``(step, start_unix, end_unix)`` of its first and last rows, None when it has
    none). ``max_points`` keeps about that many evenly spaced rows; ``bin_stride`` adds
    ``binned`` (see ``read_binned``), read through the same connection."""
    db = _open(path)
    try:
        meta = _meta(db, path)
        identity = json.loads(meta.get("identity") or "{}")
        where = ""
        (count,) = db.execute("SELECT count(*) FROM steps").fetchone()
        if max_points and count > max_points:
            stride = -(-count // max_points)
            where = (
                f" WHERE step IN (SELECT step FROM (SELECT step, row_number() OVER (ORDER BY step) AS n "
                f"FROM steps) WHERE n % {stride} = 0 OR n = {count})"
            )
        rows = db.execute(
            f"SELECT {', '.join(STEP_COLUMNS)} FROM steps{where} ORDER BY step"
        ).fetchall()
        first, last = (
            db.execute(
                f"SELECT step, start_unix, end_unix FROM steps ORDER BY step {order} LIMIT 1"
            ).fetchone()
            for order in ("ASC", "DESC")
        )
        findings = _findings(db)
        ended = _exit(db)
        binned = _binned(db, bin_stride) if bin_stride else None
    except sqlite3.DatabaseError as exc:
        raise HistoryError(f"{path} is not a readable ddpmon history ({exc})") from None
    finally:
        db.close()
    columns: dict[str, list[Any]] = {c: [r[i] for r in rows] for i, c in enumerate(STEP_COLUMNS)}
    if decode_buckets:
        columns["buckets"] = [json.loads(b) if b else None for b in columns["buckets"]]
    return {
        "path": path,
        "meta": meta,
        "identity": identity,
        "rank": identity.get("rank"),
        "rows": count,
        "steps": columns,
        "findings": findings,
        "binned": binned,
        "exit": ended,
        "first": first,
        "last": last,
    }


def _open(path: str) -> sqlite3.Connection:
    """A read-only connection (autocommit: a reader's own BEGIN holds one snapshot)."""
    if not os.path.exists(path):
        raise HistoryError(f"{path}: no such file")
    try:
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0, isolation_level=None)
    except sqlite3.Error as exc:
        raise HistoryError(f"{path} cannot be opened ({exc})") from None


def _meta(db: sqlite3.Connection, path: str) -> dict[str, str]:
    """The ``meta`` table; HistoryError for a schema this ddpmon does not read."""
    meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
    version = int(meta.get("schema_version", 0))
    if version != SCHEMA_VERSION:
        raise HistoryError(
            f"{path} has history schema {version}; this ddpmon reads {SCHEMA_VERSION}"
        )
    return meta


def _findings(db: sqlite3.Connection, newest: int = -1) -> list[dict[str, Any]]:
    """The findings, oldest first (only the ``newest`` ones when not -1)."""
    rows = db.execute(
        "SELECT unix, step, kind, key, text FROM findings ORDER BY unix DESC, rowid DESC LIMIT ?",
        (newest,),
    ).fetchall()
    return [dict(zip(("unix", "step", "kind", "key", "text"), r)) for r in reversed(rows)]


def _exit(db: sqlite3.Connection) -> dict[str, Any] | None:
    ex = db.execute("SELECT unix, step, how, record FROM exit").fetchone()
    return (
        None
        if ex is None
        else {
            "unix": ex[0],
            "step": ex[1],
            "how": ex[2],
            "record": json.loads(ex[3]) if ex[3] else None,
        }
    )


def bytes_per_step(path: str) -> float | None:
    """The database's size on disk (with its WAL) over its rows."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        (count,) = db.execute("SELECT count(*) FROM steps").fetchone()
        db.close()
    except sqlite3.Error:
        return None
    size = sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.exists(p))
    return size / count if count else None


BINNED_MEANS = (
    "step_seconds",
    "forward_seconds",
    "backward_seconds",
    "exposed_comm_seconds",
    "data_wait_seconds",
    "h2d_seconds",
    "optimizer_seconds",
    "other_seconds",
    "gpu_utilization_ratio",
)
BINNED_MAXES = (
    "gpu_memory_used_bytes",
    "torch_memory_allocated_bytes",
    "process_resident_memory_bytes",
)
"""The memory readings, the most telling first (the GPU, torch's allocator, the process): a
bin keeps their largest."""


def read_binned(path: str, stride: int) -> dict[str, list[Any]]:
    """Steps grouped ``stride`` at a time (bin ``b`` holds steps ``b*stride+1 .. (b+1)*stride``):
    ``bin``, ``steps`` (rows in the bin), ``max_step_seconds``, the mean of each timing column
    and the largest memory reading. Aligned across ranks, since step numbers are."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
        try:
            return _binned(db, stride)
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise HistoryError(f"{path} is not a readable ddpmon history ({exc})") from None


def _binned(db: sqlite3.Connection, stride: int) -> dict[str, list[Any]]:
    stride = max(1, int(stride))
    cols = ", ".join([f"avg({c})" for c in BINNED_MEANS] + [f"max({c})" for c in BINNED_MAXES])
    rows = db.execute(
        f"SELECT (step - 1) / {stride} AS b, count(*), max(step_seconds), {cols} "
        f"FROM steps GROUP BY b ORDER BY b"
    ).fetchall()
    names = ("bin", "steps", "max_step_seconds") + BINNED_MEANS + BINNED_MAXES
    return {n: [r[i] for r in rows] for i, n in enumerate(names)}


def span(path: str) -> tuple[float, float] | None:
    """The first step's start and the last step's end (None: no steps yet)."""
    db = _open(path)
    try:
        first = db.execute("SELECT start_unix FROM steps ORDER BY step LIMIT 1").fetchone()
        last = db.execute("SELECT end_unix FROM steps ORDER BY step DESC LIMIT 1").fetchone()
    except sqlite3.DatabaseError as exc:
        raise HistoryError(f"{path} is not a readable ddpmon history ({exc})") from None
    finally:
        db.close()
    return (float(first[0]), float(last[0])) if first and last else None


def busy_since(
    path: str, seconds: float, at_least: int = 0, most: int | None = None
) -> dict[str, list[Any]]:
    """The steps that ended within ``seconds`` of the last one (at least its last
    ``at_least`` steps, at most its last ``most``): ``step``, ``end_unix`` and
    ``busy_seconds`` (the step less its exposed communication), oldest first; what the
    straggler rule reads to see whether a gap lasts (``steps.sustained``), here or through
    the node daemon's ``/history?busy=SECONDS``."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
        try:
            rows: list[
                tuple[Any, ...]
            ] = []  # newest first, read until one ended too early: no index on end_unix
            for row in db.execute(
                "SELECT step, end_unix, step_seconds - coalesce(exposed_comm_seconds, 0) "
                "FROM steps ORDER BY step DESC"
            ):
                if len(rows) >= at_least and rows and row[1] < rows[0][1] - seconds:
                    break
                if most is not None and len(rows) >= most:
                    break
                rows.append(row)
            rows.reverse()
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise HistoryError(f"{path} is not a readable ddpmon history ({exc})") from None
    return {
        "step": [r[0] for r in rows],
        "end_unix": [r[1] for r in rows],
        "busy_seconds": [max(0.0, r[2] or 0.0) for r in rows],
    }


def max_step(path: str) -> int:
    """The last step recorded (0 when none)."""
    return size(path)[1]


def size(path: str) -> tuple[int, int]:
    """The rows kept and the last step recorded (0 when none)."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
        try:
            rows, last = db.execute("SELECT count(*), coalesce(max(step), 0) FROM steps").fetchone()
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise HistoryError(f"{path} is not a readable ddpmon history ({exc})") from None
    return int(rows), int(last)


# -- served: the node daemon's /history, and a copy made of its pages -------------------------------
#
# ``ddpmon daemon --serve-state`` answers ``GET /history?rank=R&since=S`` with a page of one
# rank's steps (``page``), so that a report on another machine reads every rank of a job
# without a shared file system, a bounded answer at a time; the reader writes the pages into a
# file of this very format (``HistoryCopy``) and reads it as it reads a local one.

PAGE_FORMAT = 1
"""The version of ``/history``'s JSON; a reader refuses another one, saying so."""
PAGE_ROWS = 5_000
"""Steps per answer at most (``limit``, 1 to this)..."""
PAGE_BYTES = 2 * 2**20
"""...and this many bytes of rows (``page`` counts them): the page ends with the row that
reaches it (a row is never split; one with 256 buckets is about 8 KiB). Reading and
encoding a full page takes the daemon's worker tens of milliseconds, so a scrape never
waits long behind one."""
PAGE_FINDINGS = 1_000
"""The newest findings, on a history's last page."""
QUERY_KEYS = ("job", "rank", "since", "limit", "buckets", "busy", "at_least")
BUSY_SECONDS = 60
"""``busy=SECONDS`` asks for the busy times of the steps that ended within at most this of
the last one..."""
BUSY_ROWS = 5_000
"""...and at most this many steps (the newest; ``at_least`` 0 to this): an answer of
about 200 KiB at most."""


class BadQuery(ValueError):
    """A ``/history`` query that cannot be answered; the message says what was wrong and what
    is accepted."""


@dataclass(frozen=True)
class Ask:
    """What a ``/history`` request asks for: the node's histories (``rank`` None), or a page
    of the steps of ``rank`` (of ``job``) after step ``since``."""

    job: str | None = None
    rank: int | None = None
    since: int = 0
    limit: int | None = None
    """Steps at most in the page; None: the daemon's bound, ``PAGE_ROWS``."""
    buckets: bool = True
    busy: int | None = None
    """Seconds: the recent busy times (``busy_since``) instead of a page."""
    at_least: int = 0
    """With ``busy``: at least this many of the last steps, however long ago."""

    @classmethod
    def parse(cls, query: Mapping[str, Sequence[str]]) -> Ask:
        """The request of a parsed query string (``parse_qs``); BadQuery says what is wrong."""
        unknown = sorted(set(query) - set(QUERY_KEYS))
        if unknown:
            raise BadQuery(
                f"unknown parameter {unknown[0]!r}: /history takes {', '.join(QUERY_KEYS)}"
            )
        one: dict[str, str] = {}
        for key, values in query.items():
            if len(values) != 1:
                raise BadQuery(f"{key} is given {len(values)} times: give it once")
            one[key] = values[0]
        if "rank" not in one:
            extra = sorted(set(one) - {"job"})
            if extra:
                raise BadQuery(
                    f"{extra[0]} needs rank=R (without rank, /history lists this node's histories)"
                )
            return cls(job=one.get("job") or None)
        buckets = one.get("buckets", "1")
        if buckets not in ("0", "1"):
            raise BadQuery(
                f"buckets={buckets!r} is not valid: expected 1 (with each step's buckets) or 0"
            )
        return cls(
            job=one.get("job") or None,
            rank=_whole(one, "rank", "a rank number (0, 1, ...)", 0),
            since=_whole(one, "since", "a step number (0 for the first page)", 0)
            if "since" in one
            else 0,
            limit=_whole(one, "limit", f"1 to {PAGE_ROWS} steps per answer", 1, PAGE_ROWS)
            if "limit" in one
            else None,
            buckets=buckets == "1",
            busy=_whole(one, "busy", f"1 to {BUSY_SECONDS} seconds", 1, BUSY_SECONDS)
            if "busy" in one
            else None,
            at_least=_whole(one, "at_least", f"0 to {BUSY_ROWS} steps", 0, BUSY_ROWS)
            if "at_least" in one
            else 0,
        )

    def query(self) -> str:
        """The query string that asks for this (the reader's side of ``parse``)."""
        items: list[tuple[str, object]] = [("job", self.job)] if self.job is not None else []
        if self.rank is not None:
            items += [("rank", self.rank), ("since", self.since)]
            items += [("limit", self.limit)] if self.limit is not None else []
            items += [("buckets", 0)] if not self.buckets else []
            items += [("busy", self.busy), ("at_least", self.at_least)] if self.busy else []
        return urllib.parse.urlencode(items)


WHOLE_MAX = 2**63 - 1
"""The largest number a query takes: SQLite's largest integer (a larger one cannot be compared
with a step, and would fail the read)."""


def _whole(
    query: dict[str, str], key: str, expected: str, low: int, high: int | None = None
) -> int:
    """``query[key]`` as a number from ``low`` to ``high`` (at most ``WHOLE_MAX``), in decimal
    digits only: ``int()`` also takes '+5', ' 5' and '1_0'."""
    text = query[key]
    if not (text.isascii() and text.isdigit()):
        raise BadQuery(f"{key}={text!r} is not valid: expected {expected}")
    value = int(text) if len(text) <= 19 else WHOLE_MAX + 1  # (int() refuses 4,300 digits and more)
    if value < low or (high is not None and value > high):
        raise BadQuery(f"{key}={text!r} is not valid: expected {expected}")
    if value > WHOLE_MAX:
        raise BadQuery(f"{key}={text!r} is not valid: expected {expected}, at most {WHOLE_MAX}")
    return value


ROW_BYTES = 400
"""At most a row's JSON without its buckets (15 numbers, commas and brackets): with the
buckets' length, the bound a page's bytes are counted by."""


def page(
    path: str,
    since: int = 0,
    limit: int | None = None,
    buckets: bool = True,
    max_bytes: int | None = None,
) -> dict[str, Any]:
    """The steps after ``since`` of one history, oldest first, read in one snapshot: at most
    ``limit`` rows (default ``PAGE_ROWS``) and ``max_bytes`` (``PAGE_BYTES``) of them as JSON (counted as ``ROW_BYTES`` plus the
    buckets' text per row; the row that reaches it ends the page). ``columns`` names the
    values of each row as the file keeps them (``buckets``: its JSON text, or left out);
    ``next_since`` is the cursor of the next page, None on the last one, which also carries
    the findings (the newest ``PAGE_FINDINGS``) and how the rank ended."""
    columns = STEP_COLUMNS if buckets else tuple(c for c in STEP_COLUMNS if c != "buckets")
    limit = PAGE_ROWS if limit is None else limit
    max_bytes = PAGE_BYTES if max_bytes is None else max_bytes
    db = _open(path)
    try:
        db.execute("BEGIN")
        meta = _meta(db, path)
        total, last = db.execute("SELECT count(*), coalesce(max(step), 0) FROM steps").fetchone()
        found = db.execute(
            f"SELECT {', '.join(columns)} FROM steps WHERE step > ? ORDER BY step LIMIT ?",
            (since, limit),
        )
        rows: list[tuple[Any, ...]] = []
        size = 0
        for row in found:
            rows.append(row)
            size += ROW_BYTES + (
                len(row[_BUCKETS]) if buckets and isinstance(row[_BUCKETS], str) else 0
            )
            if size >= max_bytes:
                break
        more = bool(rows) and rows[-1][0] < last
        out: dict[str, Any] = {
            "format": PAGE_FORMAT,
            "meta": meta,
            "identity": json.loads(meta.get("identity") or "{}"),
            "rows_total": total,
            "last_step": last,
            "since": since,
            "columns": list(columns),
            "rows": rows,
            "next_since": rows[-1][0] if more else None,
        }
        if not more:
            out["findings"] = _findings(db, PAGE_FINDINGS)
            out["exit"] = _exit(db)
    except (sqlite3.DatabaseError, ValueError) as exc:
        raise HistoryError(f"{path} is not a readable ddpmon history ({exc})") from None
    finally:
        db.close()
    return out


class HistoryCopy:
    """A history written from the pages of ``page`` (read from a node daemon): a file of
    the rank's own format, so that the report and compare read it as they read a local one.
    ``add`` each page in order; a page that is not one of ``page``'s, or of another run of
    the rank (its history restarted while it was read), raises HistoryError."""

    def __init__(self, path: str, where: str) -> None:
        self.path = path
        self.where = where  # the page's source, for the messages
        self.created: str | None = None
        self.rows = 0
        self._db: sqlite3.Connection | None = None

    def add(self, answer: Any) -> None:
        try:
            meta, columns, rows = answer["meta"], answer["columns"], answer["rows"]
            if not (
                isinstance(meta, dict) and isinstance(columns, list) and isinstance(rows, list)
            ):
                raise TypeError("meta, columns or rows of the wrong type")
            index = [columns.index(c) if c in columns else None for c in STEP_COLUMNS]
            values = [
                tuple(
                    _stored(c, row[i] if i is not None else None)
                    for c, i in zip(STEP_COLUMNS, index)
                )
                for row in rows
            ]
            last = answer.get("next_since") is None
            findings = (
                [
                    tuple(f[k] for k in ("unix", "step", "kind", "key", "text"))
                    for f in answer["findings"]
                ]
                if last
                else []
            )
            ended = answer["exit"] if last else None
            if ended is not None:
                record = ended.get("record")
                ended = (
                    ended["unix"],
                    ended.get("step"),
                    ended["how"],
                    json.dumps(record, default=str) if record else None,
                )
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as exc:
            raise HistoryError(f"{self.where}: not a page of ddpmon's /history ({exc!r})") from None
        if self._db is None:
            self._start(meta)
        elif meta.get("created_unix") != self.created:
            raise HistoryError(
                f"{self.where}: the rank's history started anew while it was read (a new run "
                "in the same directory); read it again"
            )
        assert self._db is not None
        marks = ",".join("?" * len(STEP_COLUMNS))
        try:
            with self._db:
                self._db.execute("BEGIN")
                self._db.executemany(
                    f"INSERT OR REPLACE INTO steps ({', '.join(STEP_COLUMNS)}) VALUES ({marks})",
                    values,
                )
                self._db.executemany("INSERT INTO findings VALUES (?, ?, ?, ?, ?)", findings)
                if ended is not None:
                    self._db.execute("INSERT INTO exit VALUES (?, ?, ?, ?)", ended)
        except (
            sqlite3.Error
        ) as exc:  # a NULL where the file needs a value, a value sqlite cannot store
            raise HistoryError(f"{self.where}: not a page of ddpmon's /history ({exc})") from None
        self.rows += len(values)

    def _start(self, meta: dict[str, Any]) -> None:
        if str(meta.get("schema_version")) != str(SCHEMA_VERSION):
            raise HistoryError(
                f"{self.where} has history schema {meta.get('schema_version')}; this ddpmon "
                f"reads {SCHEMA_VERSION}: read it with the daemon's ddpmon version"
            )
        self.created = meta.get("created_unix")
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute("PRAGMA synchronous=OFF")  # a scratch copy: nothing to keep after a crash
        self._db.executescript(_SCHEMA)
        self._db.executemany(
            "INSERT OR REPLACE INTO meta VALUES (?, ?)", [(str(k), str(v)) for k, v in meta.items()]
        )

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def _stored(column: str, value: Any) -> Any:
    """A served value as the file keeps it: a step number, a number or NULL, buckets as JSON."""
    if column == "step":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"step {value!r} is not a step number")
        return value
    if column == "buckets":  # JSON text, checked: the reader decodes it
        try:
            return value if isinstance(value, str) and isinstance(json.loads(value), list) else None
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
