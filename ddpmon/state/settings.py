"""Live settings: options of a running rank changed on request (``ddpmon set``; docs/configuration.md).

The same path as a capture (``state/captures.py``): no port is opened; the command writes
``set-<R>.request`` into the job's state directory (atomically), and the rank's state-writer
thread looks for it at most once a second, takes it (removes it) when it is the rank's own
user's regular file, bound to this very process (job, pid, the time the rank attached) and not
expired, and ignores any other. The rank checks every value itself (``config.live_value``),
applies what is valid and safe to change live, and answers in ``set-<R>-<nonce>.status``:
what it applied, and what it refused with the reason and the values accepted.

Nothing here imports torch: the command and the rank use it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import StateFileError
from . import captures, files

MAX_FILE_BYTES = 16 * 1024
"""A request or status file holds a few hundred bytes."""
MAX_CHANGES = 16
MAX_TIMEOUT_SECONDS = 120.0
"""The longest a request sent through a node daemon waits to be taken (``ddpmon set
--timeout``): the daemon refuses a longer one."""
KEEP = 4
"""Answers kept per rank: each new one removes the oldest beyond this."""
REQUEST_KIND = "ddpmon-set-request"
STATUS_KIND = "ddpmon-set-status"
_NONCE = re.compile(r"^[0-9a-f]{8,32}$")
_NAME = re.compile(r"^[a-z_]{1,64}$")


def request_path(state_dir: str, rank: int) -> str:
    return os.path.join(state_dir, f"set-{rank}.request")


def status_path(state_dir: str, rank: int, nonce: str) -> str:
    return os.path.join(state_dir, f"set-{rank}-{nonce}.status")


@dataclass(frozen=True)
class Request:
    """What ``ddpmon set`` asks of one rank: ``changes`` maps option names to their new
    values as typed. ``job``, ``pid`` and ``started_unix`` bind it to one live process."""

    nonce: str
    rank: int
    job: str | None
    pid: int
    started_unix: float
    changes: dict[str, str]
    requested_unix: float
    expires_unix: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": REQUEST_KIND, **dataclasses.asdict(self)}

    def binds(self, job: str | None, pid: int, started_unix: float | None) -> str | None:
        return captures.binds(self, job, pid, started_unix)


@dataclass(frozen=True)
class Status:
    """A rank's answer: ``applied`` (option: the value now in use, JSON: null for a learned
    hang timeout) and ``refused`` (option: why, and what is accepted)."""

    nonce: str
    rank: int
    applied: dict[str, Any] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    step: int = 0
    job: str | None = None
    written_unix: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"kind": STATUS_KIND, **dataclasses.asdict(self)}


def write_request(state_dir: str, request: Request) -> str:
    path = request_path(state_dir, request.rank)
    files.write_atomic(path, request.to_json())
    return path


def write_status(state_dir: str, status: Status) -> str:
    path = status_path(state_dir, status.rank, status.nonce)
    files.write_atomic(path, status.to_json())
    return path


def prune(state_dir: str, rank: int, keep: int = KEEP) -> None:
    """Remove ``rank``'s answers but the newest ``keep`` (a link is removed, never followed)."""
    pattern = re.compile(rf"^set-{rank}-[0-9a-f]{{8,32}}\.status$")
    found = []
    for name in os.listdir(state_dir):
        if pattern.match(name):
            path = os.path.join(state_dir, name)
            try:
                found.append((os.lstat(path).st_mtime, path))
            except OSError:
                pass
    for _, path in sorted(found)[: max(0, len(found) - keep)]:
        try:
            os.unlink(path)
        except OSError:
            pass


def _read(path: str, kind: str, owner: int | None) -> dict[str, Any]:
    """A settings file: a regular file (never a link) of ``owner``'s (when given), at most
    ``MAX_FILE_BYTES``, with the ``kind`` asked for."""
    data, info = files.read_bytes_stat(path, MAX_FILE_BYTES)
    if owner is not None and info.st_uid != owner:
        raise StateFileError(
            path, f"belongs to uid {info.st_uid}, not to the rank's user (uid {owner})"
        )
    decoded = files.decode(path, data)
    if decoded.get("kind") != kind:
        raise StateFileError(path, f'is not a ddpmon settings file (no "kind": {kind!r})')
    return decoded


def _field(path: str, data: dict[str, Any], name: str, types: tuple[type, ...]) -> Any:
    value = data.get(name)
    if value is None and type(None) in types:
        return None
    if isinstance(value, bool) or not isinstance(value, types):
        expected = " or ".join(t.__name__ for t in types if t is not type(None))
        raise StateFileError(path, f"has {name}={value!r}; expected {expected}")
    return value


def read_request(path: str, owner: int | None = None) -> Request:
    """A request file, checked (its owner too, when ``owner`` is given); StateFileError says
    what is wrong."""
    data = _read(path, REQUEST_KIND, owner)
    nonce = _field(path, data, "nonce", (str,))
    if not _NONCE.match(nonce):
        raise StateFileError(path, f"has nonce={nonce!r}; expected 8 to 32 hex digits")
    changes = _field(path, data, "changes", (dict,))
    if not changes or len(changes) > MAX_CHANGES:
        raise StateFileError(path, f"has {len(changes)} changes; expected 1 to {MAX_CHANGES}")
    for name, value in changes.items():
        if not _NAME.match(name) or not isinstance(value, str) or len(value) > 256:
            raise StateFileError(
                path, f"has the change {name!r}={value!r}; expected option=text pairs"
            )
    return Request(
        nonce=nonce,
        rank=_field(path, data, "rank", (int,)),
        job=_field(path, data, "job", (str, type(None))),
        pid=_field(path, data, "pid", (int,)),
        started_unix=float(_field(path, data, "started_unix", (int, float))),
        changes=dict(changes),
        requested_unix=float(_field(path, data, "requested_unix", (int, float))),
        expires_unix=float(_field(path, data, "expires_unix", (int, float))),
    )


def read_status(path: str) -> Status:
    """A status file, checked; StateFileError says what is wrong."""
    data = _read(path, STATUS_KIND, None)
    applied = _field(path, data, "applied", (dict,))
    refused = _field(path, data, "refused", (dict,))
    if not all(isinstance(v, str) for v in refused.values()):
        raise StateFileError(path, "has a refusal that is not text")
    return Status(
        nonce=_field(path, data, "nonce", (str,)),
        rank=_field(path, data, "rank", (int,)),
        applied=dict(applied),
        refused=dict(refused),
        step=_field(path, data, "step", (int,)),
        job=_field(path, data, "job", (str, type(None))),
        written_unix=float(_field(path, data, "written_unix", (int, float))),
    )
