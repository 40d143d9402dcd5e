"""The per-step history of one rank: an embedded SQLite database next to its state file.

Every rank keeps ``<state_dir>/rank-<R>.history.sqlite``: one row per step (phase times,
exposed communication, a bucket summary, memory and GPU utilisation when known), the rank's
identity, the findings it logged as they appeared, and how it ended. The writer is a
background thread that drains ``recorder.history_since(step)`` about once a second and commits
one batch per pass (WAL journal, so a job killed with SIGKILL keeps every committed batch and
readers never block it). Nothing here runs on the training thread, and nothing imports torch:
``ddpmon report`` and ``ddpmon compare`` read these files on any machine.

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
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import files

log = logging.getLogger("ddpmon")

SCHEMA_VERSION = 1
MAX_ROWS = 200_000
SUFFIX = ".history.sqlite"
NAME_PATTERN = re.compile(r"^rank-(\d+)\.history\.sqlite$")

# Per-step columns, in table order; all seconds unless named otherwise.
STEP_COLUMNS = (
    "step", "start_unix", "end_unix", "step_seconds", "forward_seconds", "backward_seconds",
    "exposed_comm_seconds", "data_wait_seconds", "h2d_seconds", "optimizer_seconds",
    "other_seconds", "straggler_score", "buckets", "gpu_utilization_ratio",
    "gpu_memory_used_bytes", "torch_memory_allocated_bytes", "process_resident_memory_bytes",
)
_FLOAT_COLUMNS = STEP_COLUMNS[1:12]
SAMPLE_KEYS = STEP_COLUMNS[13:]  # sampled by the writer, once per batch

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
    straggler_score REAL,
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
        if not os.path.exists(path):  # as private as the state file; SQLite gives its WAL the same mode
            os.close(files.open_private(path))
        self._db = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a crash loses no committed batch
        self._db.executescript(_SCHEMA)
        found = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if found and int(found[0]) != SCHEMA_VERSION:
            raise HistoryError(f"{path} has history schema {found[0]}, this ddpmon writes {SCHEMA_VERSION}: "
                               "move the old file away or use another state directory")
        with self._db:
            self._db.execute("BEGIN")
            # A new run in the same directory starts a new history.
            for table in ("steps", "findings", "exit"):
                self._db.execute(f"DELETE FROM {table}")
            self._db.execute("DELETE FROM meta")
            meta = {"schema_version": SCHEMA_VERSION, "created_unix": time.time(),
                    "identity": json.dumps(identity, default=str), "max_rows": self.max_rows}
            self._db.executemany("INSERT INTO meta VALUES (?, ?)", [(k, str(v)) for k, v in meta.items()])
        self.rows = 0

    def add_steps(self, steps: list[dict[str, Any]], sample: dict[str, Any] | None = None) -> None:
        """Insert (or replace) a batch of per-step dicts in one transaction."""
        if not steps:
            return
        sample = sample or {}
        rows = [_row(s, sample) for s in steps]
        marks = ",".join("?" * len(STEP_COLUMNS))
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(f"INSERT OR REPLACE INTO steps VALUES ({marks})", rows)
        self.rows += len(rows)
        if self.rows > self.max_rows:
            self._thin()

    def add_finding(self, kind: str, key: str, text: str, step: int | None) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("INSERT INTO findings VALUES (?, ?, ?, ?, ?)", (time.time(), step, kind, key, text))

    def set_exit(self, how: str, step: int | None, record: dict[str, Any] | None) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM exit")
            self._db.execute("INSERT INTO exit VALUES (?, ?, ?, ?)",
                             (time.time(), step, how, json.dumps(record, default=str) if record else None))

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
        (through,) = self._db.execute("SELECT step FROM steps ORDER BY step LIMIT 1 OFFSET ?", (half - 1,)).fetchone()
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "DELETE FROM steps WHERE step IN (SELECT step FROM (SELECT step, row_number() "
                "OVER (ORDER BY step) AS n FROM steps) WHERE n <= ? AND n % 2 = 0)", (half,))
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('thinned_through_step', ?)", (str(through),))


def _row(s: dict[str, Any], sample: dict[str, Any]) -> tuple[Any, ...]:
    out: list[Any] = [int(s["step"])]
    for key in _FLOAT_COLUMNS:
        v = s.get(key)
        out.append(float(v) if isinstance(v, (int, float)) else None)
    buckets = s.get("buckets")
    out.append(json.dumps([[b.get("index"), _round(b.get("seconds")), b.get("bytes")] for b in buckets],
                          separators=(",", ":")) if buckets else None)
    for key in SAMPLE_KEYS:
        v = s.get(key, sample.get(key))
        out.append(v if isinstance(v, (int, float)) else None)
    return tuple(out)


def _round(v: Any) -> Any:
    return float(f"{v:.6g}") if isinstance(v, float) else v


class HistoryWriter:
    """The thread that drains ``history_since`` into a ``HistoryStore`` every ``interval``.

    ``snapshot`` (the state file's body) supplies the notes, errors and hang report that
    become findings, and the exit record; ``sample`` returns the memory and GPU columns for
    the batch. A failure is logged once and switches history off; the training never sees it.
    """

    def __init__(self, path: str, history_since: Callable[[int], list[dict[str, Any]]],
                 snapshot: Callable[[], dict[str, Any]], identity: dict[str, Any], *,
                 interval: float = 1.0, sample: Callable[[], dict[str, Any]] | None = None,
                 hold_back: int = 2, max_rows: int = MAX_ROWS) -> None:
        self.path = path
        self._history_since = history_since
        self._snapshot = snapshot
        self._sample = sample or process_sample()
        self._identity = identity
        self._interval = interval
        self._hold_back = hold_back  # the newest steps may still get their bucket timings
        self._max_rows = max_rows
        self._store: HistoryStore | None = None
        self._written = 0
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.failed = False
        self._thread = threading.Thread(target=self._run, name="ddpmon-history", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush(final=False)

    def flush(self, final: bool) -> None:
        """One batch: new steps (all of them when ``final``), new findings."""
        if self.failed:
            return
        with self._lock:
            try:
                if self._store is None:
                    self._store = HistoryStore(self.path, self._identity, self._max_rows)
                steps = self._history_since(self._written)
                if not final and self._hold_back and steps:
                    # The newest steps may still get their bucket timings (resolved a step
                    # or two later on a GPU); once training pauses they are final.
                    recent = time.time() - 2 * self._interval
                    held = sum(1 for s in steps[-self._hold_back:] if s["end_unix"] > recent)
                    steps = steps[: len(steps) - held]
                if not final:  # on a GPU, steps whose parts the GPU has not given yet (gpu_steps.py)
                    pending = next((i for i, s in enumerate(steps) if s.get("gpu_pending")), None)
                    steps = steps if pending is None else steps[:pending]
                if steps:
                    self._store.add_steps(steps, self._sample())
                    self._written = int(steps[-1]["step"])
                snap = self._snapshot()
                for kind, key, text in events(snap):
                    if key not in self._seen:
                        self._seen.add(key)
                        self._store.add_finding(kind, key, text, snap.get("step"))
                if final:
                    exit_record = snap.get("exit")
                    how = ("crashed" if exit_record.get("exception") else "exited") if exit_record else "detached"
                    self._store.set_exit(how, snap.get("step"), exit_record)
            except Exception as exc:
                self.failed = True
                log.warning("ddpmon: the step history (%s) is off after a failure: %r", self.path, exc)

    def stop(self, timeout: float = 3.0) -> None:
        """Write the last batch and the exit record, within ``timeout`` seconds."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._lock.acquire(timeout=timeout):
            self._lock.release()
            self.flush(final=True)
        with self._lock:
            if self._store is not None:
                try:
                    self._store.close()
                except Exception:
                    pass
                self._store = None


def events(snap: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(kind, key, text) of what a rank noticed, from its state file's body: its notes
    (advice), parts of ddpmon that switched off, and a hang report."""
    for key, text in sorted((snap.get("notes") or {}).items()):
        yield "note", f"note:{key}:{text}", f"{key}: {text}"
    for key, text in sorted((snap.get("errors") or {}).items()):
        yield "ddpmon_part_off", f"error:{key}", f"{key} switched off: {text}"
    hang = snap.get("hang")
    if isinstance(hang, dict):
        text = (f"hang suspected: no progress for {hang.get('silent_seconds', '?')} s at step "
                f"{hang.get('step', '?')}, phase {hang.get('phase', '?')}")
        waits = [e for e in hang.get("in_flight") or [] if isinstance(e, dict)]
        if waits:
            text += f", waiting in {waits[0].get('op')} #{waits[0].get('seq')}"
        yield "hang", f"hang:{hang.get('detected_unix', '')}", text


def process_sample() -> Callable[[], dict[str, Any]]:
    """The resident memory of this process (psutil), once per batch."""
    try:
        import psutil

        proc = psutil.Process()
    except Exception:
        return dict
    def sample() -> dict[str, Any]:
        try:
            return {"process_resident_memory_bytes": proc.memory_info().rss}
        except Exception:
            return {}
    return sample


# -- reading ----------------------------------------------------------------------------------


def read(path: str, max_points: int | None = None, decode_buckets: bool = True,
         bin_stride: int | None = None) -> dict[str, Any]:
    """One rank's history: ``meta`` (with ``identity``), ``steps`` (column -> list, oldest
    first; ``buckets`` decoded unless ``decode_buckets=False``, then JSON text), ``findings``
    and ``exit`` (None when it never wrote one: killed, or still running). ``max_points``
    keeps about that many evenly spaced rows; ``bin_stride`` adds ``binned`` (see
    ``read_binned``), read through the same connection."""
    if not os.path.exists(path):
        raise HistoryError(f"{path}: no such file")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    except sqlite3.Error as exc:
        raise HistoryError(f"{path} cannot be opened ({exc})") from None
    try:
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        version = int(meta.get("schema_version", 0))
        if version != SCHEMA_VERSION:
            raise HistoryError(f"{path} has history schema {version}; this ddpmon reads {SCHEMA_VERSION}")
        identity = json.loads(meta.get("identity") or "{}")
        where = ""
        (count,) = db.execute("SELECT count(*) FROM steps").fetchone()
        if max_points and count > max_points:
            stride = -(-count // max_points)
            where = (f" WHERE step IN (SELECT step FROM (SELECT step, row_number() OVER (ORDER BY step) AS n "
                     f"FROM steps) WHERE n % {stride} = 0 OR n = {count})")
        rows = db.execute(f"SELECT {', '.join(STEP_COLUMNS)} FROM steps{where} ORDER BY step").fetchall()
        findings = [dict(zip(("unix", "step", "kind", "key", "text"), r))
                    for r in db.execute("SELECT unix, step, kind, key, text FROM findings ORDER BY unix")]
        ex = db.execute("SELECT unix, step, how, record FROM exit").fetchone()
        binned = _binned(db, bin_stride) if bin_stride else None
    except sqlite3.DatabaseError as exc:
        raise HistoryError(f"{path} is not a readable ddpmon history ({exc})") from None
    finally:
        db.close()
    columns: dict[str, list[Any]] = {c: [r[i] for r in rows] for i, c in enumerate(STEP_COLUMNS)}
    if decode_buckets:
        columns["buckets"] = [json.loads(b) if b else None for b in columns["buckets"]]
    return {
        "path": path, "meta": meta, "identity": identity, "rank": identity.get("rank"),
        "rows": count, "steps": columns, "findings": findings, "binned": binned,
        "exit": None if ex is None else {"unix": ex[0], "step": ex[1], "how": ex[2],
                                         "record": json.loads(ex[3]) if ex[3] else None},
    }


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


BINNED_MEANS = ("step_seconds", "forward_seconds", "backward_seconds", "exposed_comm_seconds",
                "data_wait_seconds", "h2d_seconds", "optimizer_seconds", "other_seconds",
                "straggler_score", "gpu_utilization_ratio")
BINNED_MAXES = ("gpu_memory_used_bytes", "torch_memory_allocated_bytes", "process_resident_memory_bytes")


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
    rows = db.execute(f"SELECT (step - 1) / {stride} AS b, count(*), max(step_seconds), {cols} "
                      f"FROM steps GROUP BY b ORDER BY b").fetchall()
    names = ("bin", "steps", "max_step_seconds") + BINNED_MEANS + BINNED_MAXES
    return {n: [r[i] for r in rows] for i, n in enumerate(names)}


def max_step(path: str) -> int:
    """The last step recorded (0 when none)."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
        try:
            (last,) = db.execute("SELECT coalesce(max(step), 0) FROM steps").fetchone()
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise HistoryError(f"{path} is not a readable ddpmon history ({exc})") from None
    return int(last)


class RunHistory:
    """The history of one monitored rank: a writer started at attach, stopped (its last
    batch bounded in time) at detach or at exit, after which rank 0 logs the run's summary."""

    def __init__(self, state_file: str, rank: int, recorder: Any,
                 sample: Callable[[], dict[str, Any]] | None = None) -> None:
        import atexit

        self._rank = rank
        self._writer: HistoryWriter | None = HistoryWriter(
            path_for(os.path.dirname(state_file), rank), recorder.history_since, recorder.snapshot,
            recorder.identity, sample=sample or process_sample(),
        )
        self._writer.start()
        atexit.register(self.stop)  # registered before the watchdog's: its exit record comes first

    def stop(self) -> None:
        import atexit

        writer, self._writer = self._writer, None
        if writer is None:
            return
        atexit.unregister(self.stop)
        writer.stop()
        if self._rank == 0 and not writer.failed:
            try:
                from ..report.summary import end_of_run

                log.warning("%s", end_of_run(os.path.dirname(writer.path)))
            except Exception as exc:
                log.info("ddpmon: no end-of-run summary: %r", exc)


def start(state_file: str | None, rank: int, recorder: Any, device: str) -> RunHistory | None:
    """The history of a rank whose state file is ``state_file`` (None: no state files, so no
    history), with GPU columns on a CUDA device; None, with one warning, when it cannot start."""
    if not state_file:
        return None
    sample = process_sample()
    if device.startswith("cuda"):  # only a training rank gets here: torch is loaded there
        import functools

        import torch

        from ..collectors.torch_memory import history_sample

        sample = functools.partial(history_sample, torch.device(device), sample)
    try:
        return RunHistory(state_file, rank, recorder, sample)  # before the watchdog's exit hook
    except Exception as exc:  # the run goes on without its history
        log.warning("ddpmon: rank %d: no step history: %r", rank, exc)
        return None
