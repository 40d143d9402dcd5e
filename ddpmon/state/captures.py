"""Captures: a profile of a live rank's next steps, asked for through files in its state
directory (``ddpmon capture``; docs/capture.md).

No port is opened for it: whoever may write the job's state directory may ask. The command
writes ``capture-<R>.request`` (atomically); the rank's state-writer thread looks for it at
most once a second, takes it (removes it) when it is bound to this very process (job, pid,
the time the rank attached) and not expired, and ignores and removes any other. From then on
the rank answers in ``capture-<R>-<nonce>.status`` (``accepted``, ``recording``, ``writing``,
then ``ok`` or ``error`` with the reason), and writes the trace beside it as
``capture-<R>-<nonce>.pt.trace.json`` (Chrome/Perfetto JSON, ``traceEvents``). Every file
is written atomically, with the state files' mode, and read as untrusted input.

Nothing here imports torch: the command, the doctor and the report use it, and so does the
rank.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..errors import StateFileError
from . import files

DEFAULT_STEPS = 5
MAX_STEPS = 50
"""A capture records 1 to 50 steps: the profiler keeps every event in memory until the end."""
WARMUP_STEPS = 1
"""Steps run under the profiler before it records: starting it (the first time in a process,
torch initialises its profiler then, which can take a second) lands in none of the steps
recorded, nor does the other ranks' wait for this one."""
MAX_TRACE_BYTES = 256 * 1024 * 1024
"""A trace larger than this is deleted once written, and the capture fails with its size."""
KEEP = 4
"""Captures kept per rank in the state directory: a new one removes the oldest beyond this."""
MAX_FILE_BYTES = 64 * 1024
"""A request or status file holds a few hundred bytes."""

REQUEST_PATTERN = re.compile(r"^capture-(\d{1,7})\.request$")
STATUS_PATTERN = re.compile(r"^capture-(\d{1,7})-([0-9a-f]{8,32})\.status$")
TRACE_SUFFIX = ".pt.trace.json"
STATES = ("accepted", "recording", "writing", "ok", "error")
DONE = ("ok", "error")


def request_path(state_dir: str, rank: int) -> str:
    return os.path.join(state_dir, f"capture-{rank}.request")


def status_path(state_dir: str, rank: int, nonce: str) -> str:
    return os.path.join(state_dir, f"capture-{rank}-{nonce}.status")


def trace_name(rank: int, nonce: str) -> str:
    """The trace's file name in the state directory (TensorBoard's and Perfetto's suffix)."""
    return f"capture-{rank}-{nonce}{TRACE_SUFFIX}"


@dataclass(frozen=True)
class Request:
    """What ``ddpmon capture`` asks of one rank. ``job``, ``pid`` and ``started_unix`` (when
    the rank attached, from its state file) bind it to one live process: a request left by a
    run that has ended names another process, and is ignored."""

    nonce: str
    rank: int
    job: str | None
    pid: int
    started_unix: float
    steps: int
    at_step: int | None
    """Start where the rank's step count reaches this (None: at its next step boundary)."""
    requested_unix: float
    expires_unix: float
    """The command has given up by then: a request still waiting for a step boundary is dropped."""

    def to_json(self) -> dict[str, Any]:
        return {"kind": "ddpmon-capture-request", **dataclasses.asdict(self)}

    def binds(self, job: str | None, pid: int, started_unix: float | None) -> str | None:
        return binds(self, job, pid, started_unix)


class Bound(Protocol):
    """A request bound to one live process (a capture's, a setting's)."""

    @property
    def job(self) -> str | None: ...
    @property
    def pid(self) -> int: ...
    @property
    def started_unix(self) -> float: ...
    @property
    def rank(self) -> int: ...
    @property
    def expires_unix(self) -> float: ...


def binds(request: Bound, job: str | None, pid: int, started_unix: float | None) -> str | None:
    """None when ``request`` is for the process (job, pid, attach time) given; else why not:
    a request left by a run that has ended names another process, and is ignored."""
    if request.pid != pid:
        return f"it is for pid {request.pid}, not this process ({pid})"
    if started_unix is None or abs(request.started_unix - started_unix) > 1e-3:
        return f"it is for a rank that attached at {request.started_unix:.3f}, not at {started_unix or 0:.3f}"
    if request.job != job:
        return f"it is for job {request.job!r}, not {job!r}"
    return None


def refusal(
    request: Bound, rank: int, job: str | None, pid: int, started_unix: float | None, now: float
) -> str | None:
    """None when ``request`` is for this rank's process and still wanted; else why it is
    ignored (another process, another rank, or the command that wrote it gave up)."""
    why = binds(request, job, pid, started_unix)
    if why is None and request.rank != rank:
        why = f"it is for rank {request.rank}"
    if why is None and now > request.expires_unix:
        why = "it expired (the command that wrote it has given up)"
    return why


R = TypeVar("R")


def take(path: str, read: Callable[[str], R]) -> tuple[R | None, str | None]:
    """The request at ``path`` read with ``read``, and the file removed whatever it held (a
    request is answered once): (request, None), or (None, why it could not be read)."""
    try:
        return read(path), None
    except StateFileError as exc:
        return None, exc.reason
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


@dataclass(frozen=True)
class Status:
    """How one capture goes, as the rank last wrote it."""

    nonce: str
    rank: int
    state: str
    """accepted, recording, writing, ok or error."""
    steps: int
    step: int = 0
    """The rank's step count when this was written."""
    first_step: int | None = None
    """The first step recorded (steps are counted from 1: step S ends at count S)."""
    last_step: int | None = None
    trace: str | None = None
    """The trace's file name, in the same directory (``ok`` only)."""
    trace_bytes: int | None = None
    reason: str | None = None
    """``error``: what went wrong, and what to do."""
    job: str | None = None
    written_unix: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"kind": "ddpmon-capture-status", **dataclasses.asdict(self)}


def write_request(state_dir: str, request: Request) -> str:
    path = request_path(state_dir, request.rank)
    files.write_atomic(path, request.to_json())
    return path


def write_status(state_dir: str, status: Status) -> str:
    path = status_path(state_dir, status.rank, status.nonce)
    files.write_atomic(path, status.to_json())
    return path


def _read(path: str, kind: str) -> dict[str, Any]:
    data = files.decode(path, files.read_bytes(path, MAX_FILE_BYTES))
    if data.get("kind") != kind:
        raise StateFileError(path, f'is not a ddpmon capture file (no "kind": {kind!r})')
    return data


_NONCE = re.compile(r"^[0-9a-f]{8,32}$")


def _field(
    path: str, data: dict[str, Any], name: str, types: tuple[type, ...], optional: bool = False
) -> Any:
    value = data.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, types):
        expected = " or ".join(t.__name__ for t in types)
        raise StateFileError(path, f"has {name}={value!r}; expected {expected}")
    return value


def read_request(path: str) -> Request:
    """A request file, checked; StateFileError says what is wrong."""
    data = _read(path, "ddpmon-capture-request")
    nonce = _field(path, data, "nonce", (str,))
    if not _NONCE.match(nonce):
        raise StateFileError(path, f"has nonce={nonce!r}; expected 8 to 32 hex digits")
    steps = _field(path, data, "steps", (int,))
    if not 1 <= steps <= MAX_STEPS:
        raise StateFileError(path, f"has steps={steps}; expected 1 to {MAX_STEPS}")
    return Request(
        nonce=nonce,
        rank=_field(path, data, "rank", (int,)),
        job=_field(path, data, "job", (str,), True),
        pid=_field(path, data, "pid", (int,)),
        started_unix=float(_field(path, data, "started_unix", (int, float))),
        steps=steps,
        at_step=_field(path, data, "at_step", (int,), True),
        requested_unix=float(_field(path, data, "requested_unix", (int, float))),
        expires_unix=float(_field(path, data, "expires_unix", (int, float))),
    )


def read_status(path: str) -> Status:
    """A status file, checked; StateFileError says what is wrong."""
    data = _read(path, "ddpmon-capture-status")
    state = _field(path, data, "state", (str,))
    if state not in STATES:
        raise StateFileError(path, f"has state={state!r}; expected one of {', '.join(STATES)}")
    trace = _field(path, data, "trace", (str,), True)
    if trace is not None and (os.path.basename(trace) != trace or not trace.endswith(TRACE_SUFFIX)):
        raise StateFileError(
            path, f"names the trace {trace!r}; expected a file name ending in {TRACE_SUFFIX}"
        )
    return Status(
        nonce=_field(path, data, "nonce", (str,)),
        rank=_field(path, data, "rank", (int,)),
        state=state,
        steps=_field(path, data, "steps", (int,)),
        step=_field(path, data, "step", (int,), True) or 0,
        first_step=_field(path, data, "first_step", (int,), True),
        last_step=_field(path, data, "last_step", (int,), True),
        trace=trace,
        trace_bytes=_field(path, data, "trace_bytes", (int,), True),
        reason=_field(path, data, "reason", (str,), True),
        job=_field(path, data, "job", (str,), True),
        written_unix=float(_field(path, data, "written_unix", (int, float), True) or 0.0),
    )


# -- what a state directory holds: for the report, and the rank's own clean-up --------------


@dataclass(frozen=True)
class Capture:
    """One capture found in a state directory: its status file and, once ``ok``, its trace."""

    rank: int
    nonce: str
    status: Status | None
    """None when the status file cannot be read (``problem`` says why)."""
    status_path: str
    trace_path: str | None
    """The trace, when the status is ``ok`` and the file is there."""
    problem: str | None = None

    @property
    def written_unix(self) -> float:
        if self.status is not None and self.status.written_unix:
            return self.status.written_unix
        try:
            return os.stat(self.status_path).st_mtime
        except OSError:
            return 0.0


def listing(state_dir: str) -> list[Capture]:
    """Every capture of ``state_dir`` (done, failed or under way), by rank, oldest first.
    A status file that cannot be read is listed with ``problem`` saying why."""
    found = []
    for name in sorted(os.listdir(state_dir)):
        m = STATUS_PATTERN.match(name)
        if not m:
            continue
        rank, nonce, path = int(m.group(1)), m.group(2), os.path.join(state_dir, name)
        try:
            status: Status | None = read_status(path)
            problem = None
        except StateFileError as exc:
            status, problem = None, exc.reason
        trace = None
        if status is not None and status.state == "ok" and status.trace:
            candidate = os.path.join(state_dir, status.trace)
            trace = (
                candidate if os.path.isfile(candidate) and not os.path.islink(candidate) else None
            )
        found.append(Capture(rank, nonce, status, path, trace, problem))
    return sorted(found, key=lambda c: (c.rank, c.written_unix, c.nonce))


def prune(state_dir: str, rank: int, keep: int = KEEP) -> list[str]:
    """Remove the oldest captures of ``rank`` beyond ``keep`` (status file and trace); the
    paths removed."""
    mine = [c for c in listing(state_dir) if c.rank == rank]
    removed = []
    for capture in mine[: max(0, len(mine) - keep)]:
        for path in (capture.status_path, os.path.join(state_dir, trace_name(rank, capture.nonce))):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def command(state_dir: str, rank: int, peer: int | None = None, steps: int | None = None) -> str:
    """The command line that captures ``rank`` (and, with ``peer``, compares it with that
    healthy rank over the same steps): what the doctor prints for a slow rank."""
    words = ["ddpmon", "capture", shlex.quote(state_dir), "--rank", str(rank)]
    if steps is not None and steps != DEFAULT_STEPS:
        words += ["--steps", str(steps)]
    if peer is not None:
        words += ["--compare", str(peer)]
    return " ".join(words)
