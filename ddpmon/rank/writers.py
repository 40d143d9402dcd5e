"""The threads that write a rank's files: its state file (``rank-<R>.json``, rewritten about
once a second and at every notable event) and its step history (``rank-<R>.history.sqlite``,
drained from ``recorder.history_since`` about once a second). The formats and their readers
are in ``state/``; these run only inside the training process, never on the training thread.
A write that fails (a full disk, a read-only directory) is counted in the rank's
``write_failures`` (its state file and its metrics), logged once, and tried again with
backoff (``WriteFailures``); the history keeps the steps it could not write in the recorder's
ring meanwhile, and records the ones it lost.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import AttachError
from ..fuses import bounded
from ..state import files, history, records, schema
from ..steps import StepRow
from .books import HISTORY_STEPS

log = logging.getLogger("ddpmon")

# -- failed writes ------------------------------------------------------------------------------

RETRY_MAX_SECONDS = 8.0
"""A failing write is tried again after the writer's interval, doubled after each failure up
to this; at once when a full file system has room again (``files.full``)."""
LOG_QUIET_SECONDS = 300.0
"""A spell of failures that starts within this long of the last one logged is only counted:
a disk that fills and empties every few seconds gives a line every few minutes."""


class WriteFailures:
    """The failing writes of one of the rank's files (``what``: ``state`` or ``history``):
    each spell recorded whole in ``records`` (the recorder's ``write_failures``, which the
    state file and ``ddpmon_state_write_failures_total`` read), logged once when it starts
    and once when it ends, and its retries spaced out (``due``). Used from one writer
    thread at a time."""

    def __init__(
        self, what: str, path: str, records: dict[str, schema.WriteFailure], interval: float
    ) -> None:
        self.what = what
        self.path = path
        self._records = records
        self._interval = max(0.01, interval)
        self._delay = self._interval
        self._next_try = 0.0
        self._logged_unix = -LOG_QUIET_SECONDS
        self._spell_logged = False

    @property
    def record(self) -> schema.WriteFailure | None:
        return self._records.get(self.what)

    @property
    def failing(self) -> bool:
        """The last write failed."""
        last = self._records.get(self.what)
        return last is not None and last.ended_unix is None

    def due(self) -> bool:
        """Whether to try a write now: none is failing, its backoff has passed, or the file
        system that had no space has room again."""
        if not self.failing or time.monotonic() >= self._next_try:
            return True
        last = self._records[self.what]
        return last.errno == "ENOSPC" and not files.full(os.path.dirname(self.path) or ".")

    def failed(self, exc: BaseException) -> None:
        now = time.time()
        text, name = describe(exc)
        last = self._records.get(self.what)
        ongoing = last is not None and last.ended_unix is None
        if not ongoing:
            self._delay = self._interval
            self._spell_logged = now - self._logged_unix >= LOG_QUIET_SECONDS
            if self._spell_logged:
                self._logged_unix = now
                log.warning(
                    "ddpmon: cannot write %s (%s); training goes on, ddpmon tries again with backoff "
                    "(the rank's write_failures and ddpmon_state_write_failures_total count the tries)",
                    self.path,
                    text,
                )
        else:
            self._delay = min(RETRY_MAX_SECONDS, self._delay * 2)
        self._next_try = time.monotonic() + self._delay
        self._records[self.what] = schema.WriteFailure(
            error=text,
            errno=name,
            since_unix=last.since_unix if last and ongoing else now,
            last_unix=now,
            count=last.count + 1 if last and ongoing else 1,
            total=(last.total if last else 0) + 1,
        )

    def succeeded(self) -> None:
        last = self._records.get(self.what)
        if last is None or last.ended_unix is not None:
            return
        now = time.time()
        self._records[self.what] = dataclasses.replace(last, ended_unix=now)
        if self._spell_logged:
            log.warning(
                "ddpmon: writing %s works again, after %d failed tries over %.0f s (%s)",
                self.path,
                last.count,
                now - last.since_unix,
                last.error,
            )


_SQLITE_ERRNO = {"SQLITE_FULL": errno.ENOSPC}
"""SQLite's result codes that stand for a system error (its own words for it differ)."""


def describe(exc: BaseException) -> tuple[str, str | None]:
    """A failed write as (the system's words, the errno's name): ``("No space left on
    device", "ENOSPC")``; without a system error, ``("Type: message", None)``."""
    number = (
        exc.errno
        if isinstance(exc, OSError)
        else _SQLITE_ERRNO.get(getattr(exc, "sqlite_errorname", ""))
    )
    if number:
        return os.strerror(number), errno.errorcode.get(number)
    return f"{type(exc).__name__}: {exc}", None


# -- the state file -----------------------------------------------------------------------------

RESERVE_BYTES = 64 * 1024
"""Space set aside for a state file's last word: at least this, or twice the largest file
written so far."""


class Reserve:
    """Space set aside beside the state file (``.rank-<R>.reserve``, as private as the state
    file) while there is room, for the last word on a full disk: the exit record or a hang
    report goes into these blocks and the file is renamed over the state file, so that a
    clean end still reads as one. Made anew after the next write that gets through."""

    def __init__(self, state_file: str) -> None:
        directory, name = os.path.split(state_file)
        self.path = os.path.join(directory, "." + name.removesuffix(".json") + ".reserve")
        self._inode: tuple[int, int] | None = None
        self._size = 0

    def keep(self, need: int) -> None:
        """Have room for ``need`` bytes set aside (a no-op while there is)."""
        if self._inode is not None and self._size >= need:
            return
        size = max(RESERVE_BYTES, 2 * need)
        self._inode = None
        fd = files.open_private(self.path)
        try:
            os.posix_fallocate(fd, 0, size)
            self._inode, self._size = files.inode_of(fd), size
        except OSError:
            self.drop()
        finally:
            os.close(fd)

    def write(self, target: str, payload: bytes) -> bool:
        """``payload`` into the reserved blocks, renamed over ``target``; False when there is
        no reserve for it."""
        if self._inode is None or len(payload) > self._size:
            return False
        fd = os.open(self.path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            if files.inode_of(fd) != self._inode:
                return False
            view = memoryview(payload)
            while view:
                view = view[os.pwrite(fd, view, len(payload) - len(view)) :]
            os.ftruncate(fd, len(payload))
        finally:
            os.close(fd)
        if files.inode_of(self.path) != self._inode:  # replaced meanwhile: not ours to rename
            return False
        os.replace(self.path, target)
        self._inode = None
        return True

    def drop(self) -> None:
        if files.inode_of(self.path) == self._inode or self._inode is None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self._inode = None


class StateWriter:
    """Rewrites one rank's state file from ``snapshot()`` every ``interval`` seconds (while
    its writes fail, as ``failures`` spaces them) and at once on ``notify``; after each pass
    it calls ``on_pass`` when set (the capture's look for a request, which guards itself).
    ``failures`` is where the failed writes are recorded (the recorder's
    ``write_failures``); a last word that fails goes into the ``Reserve``."""

    def __init__(
        self,
        path: str,
        snapshot: Callable[[], dict[str, Any]],
        interval: float = 1.0,
        failures: dict[str, schema.WriteFailure] | None = None,
    ) -> None:
        self.path = path
        self._snapshot = snapshot
        self._interval = interval
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._write_lock = threading.Lock()  # one writer at a time: the thread, exit, detach
        self.failures = WriteFailures("state", path, {} if failures is None else failures, interval)
        self._reserve = Reserve(path)
        self.on_pass: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="ddpmon-state-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()  # its first pass writes the file at once, off the caller's thread

    def notify(self) -> None:
        """Ask for a rewrite soon (cheap, never blocks)."""
        self._wake.set()

    def write_now(self, last_word: bool = False) -> bool:
        """Rewrite the file; with ``last_word`` (the exit record, a hang report), into the
        reserve when the write fails."""
        with self._write_lock:
            data: dict[str, Any] = {}
            try:
                data = self._snapshot()
                data["format"] = schema.FORMAT
                own = (data.get("write_failures") or {}).get("state")
                if (
                    own is not None and own.get("ended_unix") is None
                ):  # a file written says its writes work
                    own["ended_unix"] = data.get("now_unix") or time.time()
                payload = files.encode(data)
                files.write_atomic(self.path, payload)
            except Exception as exc:
                self.failures.failed(exc)
                return last_word and bool(data) and self._last_word(data)
            self.failures.succeeded()
            try:
                self._reserve.keep(len(payload))
            except OSError:
                pass
            return True

    def _last_word(self, data: dict[str, Any]) -> bool:
        """``data``, with the spell of failures that goes on, through the reserve."""
        data.setdefault("write_failures", {})["state"] = records.dump(self.failures.record)
        try:
            return self._reserve.write(self.path, files.encode(data))
        except OSError:
            return False

    def write_final(self, timeout: float = files.FINAL_WRITE_SECONDS) -> bool:
        """One last write from the calling thread's point of view, waited for at most
        ``timeout`` seconds: a hung file system never holds up detach or exit; on a full
        disk it goes into the reserve."""
        return bool(
            bounded(
                lambda: self.write_now(last_word=True), timeout, f"the last write of {self.path}"
            )
        )

    def _run(self) -> None:
        notified = True  # the first pass writes at once
        while not self._stop.is_set():
            if not notified:
                notified = self._wake.wait(self._interval)
                self._wake.clear()
                if self._stop.is_set():
                    break
            if notified or self.failures.due():  # a notable event is tried at once
                self.write_now()
            notified = False
            on_pass = self.on_pass
            if on_pass is not None:
                on_pass()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread (joined with a bound) and write one last time (bounded too)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.write_final()
        try:
            self._reserve.drop()
        except OSError:
            pass
        _CLAIMED.discard(self.path)


_CLAIMED: set[str] = set()  # state files written by a writer of this process


def check_unclaimed(path: str) -> None:
    """AttachError when a writer of this process writes ``path`` already (two monitored
    models in one process must not share a state file)."""
    if path in _CLAIMED:
        raise AttachError(
            f"another model of this process is monitored already, and both would write {path}: "
            "give this one a state directory of its own (ddpmon.attach(model, state_dir=...), or "
            "with the default directory a job=... of its own)"
        )


def start_writer(
    state_dir: str,
    rank: int,
    snapshot: Callable[[], dict[str, Any]],
    interval: float,
    failures: dict[str, schema.WriteFailure] | None = None,
) -> StateWriter:
    """A running writer of ``<state_dir>/rank-<rank>.json``, in a directory that
    ``state.root.claim`` has prepared and checked (within its time bound, off the training
    thread's way); the writer's own thread makes the first write."""
    writer = StateWriter(files.path_for(state_dir, rank), snapshot, interval, failures)
    writer.start()
    _CLAIMED.add(writer.path)
    return writer


# -- the step history ---------------------------------------------------------------------------


class HistoryWriter:
    """The thread that drains ``history_since`` into a ``HistoryStore`` every ``interval``.

    ``snapshot`` (the state file's body, or its part that ``Recorder.noticed`` gives)
    supplies the notes, errors and hang report that
    become findings, and the exit record; ``sample`` returns the memory and GPU columns for
    the batch; ``identity`` is read when the file is created, at the first pass (after the
    parts installed at attach have said what they know). A batch that fails is recorded in
    ``failures`` and tried again with backoff, its steps still in ``history_since``'s ring;
    steps the ring no longer holds when writing works again are recorded as missing
    (``history.missing_steps``). The training never sees any of it.
    """

    def __init__(
        self,
        path: str,
        history_since: Callable[[int], list[StepRow]],
        snapshot: Callable[[], dict[str, Any]],
        identity: Callable[[], dict[str, Any]],
        *,
        interval: float = 1.0,
        sample: Callable[[], dict[str, Any]] | None = None,
        hold_back: int = 2,
        max_rows: int = history.MAX_ROWS,
        failures: dict[str, schema.WriteFailure] | None = None,
    ) -> None:
        self.path = path
        self._history_since = history_since
        self._snapshot = snapshot
        self._sample = sample or process_sample()
        self._identity = identity
        self._interval = interval
        self._hold_back = hold_back  # the newest steps may still get their bucket timings
        self._max_rows = max_rows
        self._store: history.HistoryStore | None = None
        self._written = 0
        self._seen: set[str] = set()
        self._training: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.failures = WriteFailures(
            "history", path, {} if failures is None else failures, interval
        )
        self._thread = threading.Thread(target=self._run, name="ddpmon-history", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush(final=False)

    def flush(self, final: bool) -> None:
        """One batch: new steps (all of them when ``final``), new findings; while writes
        fail, only when the next try is due (always when ``final``)."""
        with self._lock:
            if not final and not self.failures.due():
                return
            try:
                self._write(final)
            except Exception as exc:
                self.failures.failed(exc)
            else:
                self.failures.succeeded()

    def _write(self, final: bool) -> None:
        if self._store is None:
            self._store = history.HistoryStore(self.path, self._identity(), self._max_rows)
        steps = self._history_since(self._written)
        if not final and self._hold_back and steps:
            # The newest steps may still get their bucket timings (resolved a step
            # or two later on a GPU); once training pauses they are final.
            recent = time.time() - 2 * self._interval
            held = sum(1 for s in steps[-self._hold_back :] if s.end_unix > recent)
            steps = steps[: len(steps) - held]
        if not final:  # on a GPU, steps whose parts the GPU has not given yet (gpu_steps.py)
            pending = next((i for i, s in enumerate(steps) if s.gpu_pending), None)
            steps = steps if pending is None else steps[:pending]
        if steps:
            lost = (
                (self._written + 1, steps[0].step - 1)
                if steps[0].step > self._written + 1
                else None
            )
            self._store.add_steps([s.history() for s in steps], self._sample(), missing=lost)
            self._written = steps[-1].step
            if lost:
                log.warning(
                    "ddpmon: the step history %s lacks steps %d-%d: they could not be written in "
                    "time, and a rank keeps only its last %d steps in memory",
                    self.path,
                    *lost,
                    HISTORY_STEPS,
                )
        snap = self._snapshot()
        for kind, key, text in events(snap):
            if key not in self._seen:
                self._store.add_finding(kind, key, text, snap.get("step"))
                self._seen.add(key)
        trained = history.training_of(snap)
        if trained != self._training:
            self._store.set_meta("training", trained)
            self._training = trained
        if final:
            exit_record = snap.get("exit")
            how = (
                ("crashed" if exit_record.get("exception") else "exited")
                if exit_record
                else "detached"
            )
            if exit_record and exit_record.get("how") == "hang_abort":
                how = "hang_abort"
            self._store.set_exit(how, snap.get("step"), exit_record)

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
    (advice), parts of ddpmon that switched off, spells of failed writes once they ended,
    and a hang report."""
    for key, text in sorted((snap.get("notes") or {}).items()):
        yield "note", f"note:{key}:{text}", f"{key}: {text}"
    for key, text in sorted((snap.get("errors") or {}).items()):
        yield "ddpmon_part_off", f"error:{key}", f"{key} switched off: {text}"
    for what, f in sorted((snap.get("write_failures") or {}).items()):
        if isinstance(f, dict) and f.get("ended_unix") is not None:
            yield (
                "write_failed",
                f"write:{what}:{f.get('since_unix')}",
                (
                    f"the {what} file could not be written for {f['ended_unix'] - f.get('since_unix', 0):.0f} s "
                    f"({f.get('count')} failed tries): {f.get('error')}"
                ),
            )
    hang = snap.get("hang")
    if isinstance(hang, dict):
        text = (
            f"hang suspected: no progress for {hang.get('silent_seconds', '?')} s at step "
            f"{hang.get('step', '?')}, stage {hang.get('stage', '?')}"
        )
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


class RunHistory:
    """The history of one monitored rank: a writer started at attach, stopped (its last
    batch bounded in time) at detach or at exit, after which rank 0 logs the run's summary."""

    def __init__(
        self,
        state_file: str,
        rank: int,
        recorder: Any,
        sample: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        import atexit

        self._rank = rank
        self._writer: HistoryWriter | None = HistoryWriter(
            history.path_for(os.path.dirname(state_file), rank),
            recorder.history_since,
            recorder.noticed,
            lambda: dataclasses.asdict(recorder.identity),
            sample=sample or process_sample(),
            failures=recorder.write_failures,
        )
        self._writer.start()
        atexit.register(self.stop)  # registered before the watchdog's: its exit record comes first

    def stop(self, summary: bool = True) -> None:
        """The last batch and the exit; then, on rank 0 unless ``summary`` is False (a rank
        ending itself after a hang), the end-of-run summary."""
        import atexit

        writer, self._writer = self._writer, None
        if writer is None:
            return
        atexit.unregister(self.stop)
        writer.stop()
        if summary and self._rank == 0 and not writer.failures.failing:
            try:
                _wait_for_peers(os.path.dirname(writer.path))
                from ..report.summary import end_of_run

                log.warning("%s", end_of_run(os.path.dirname(writer.path)))
            except Exception as exc:
                log.info("ddpmon: no end-of-run summary: %r", exc)


def start_history(
    state_file: str | None, rank: int, recorder: Any, device: str
) -> RunHistory | None:
    """The history of a rank whose state file is ``state_file`` (None: no state files, so no
    history), with GPU columns on a CUDA device; None, with one warning, when it cannot start."""
    if not state_file:
        return None
    sample = process_sample()
    if device.startswith("cuda"):  # only a training rank gets here: torch is loaded there
        import functools

        import torch

        from .torch_memory import history_sample

        sample = functools.partial(history_sample, torch.device(device), sample)
    try:
        return RunHistory(state_file, rank, recorder, sample)  # before the watchdog's exit hook
    except Exception as exc:  # the run goes on without its history
        log.warning("ddpmon: rank %d: no step history: %r", rank, exc)
        return None


PEERS_WAIT_SECONDS = 2.0
"""At most this long, at the end of the run, rank 0 waits for the other ranks' last state
files before it sums up the run (their last fingerprints and how they ended)."""


def _wait_for_peers(state_dir: str, timeout: float = PEERS_WAIT_SECONDS) -> None:
    """Until the state file of every rank in ``state_dir`` says it ended (detached, or an
    exit record), bounded: a rank that died or still works is summed up as its file last
    said. Only the files there count (other nodes' ranks write elsewhere), and a file is
    read again only once it has changed."""
    deadline = time.monotonic() + timeout
    waiting = {path: -1.0 for path in files.list_files(state_dir)}
    while waiting and time.monotonic() < deadline:
        for path, seen in list(waiting.items()):
            try:
                mtime = os.stat(path).st_mtime
                if mtime == seen:
                    continue
                waiting[path] = mtime
                state = files.read(path)
            except Exception:
                continue
            if state.stage == schema.Stage.DETACHED or state.exit is not None:
                del waiting[path]
        if waiting:
            time.sleep(0.05)
