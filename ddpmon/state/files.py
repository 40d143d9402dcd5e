"""Per-rank state files, ``<state_dir>/rank-<R>.json``: written atomically, read as untrusted.

The rank's writer (``rank/writers.py``) rewrites the file with ``write_atomic``: readers
never see a half-written file, since it writes a temporary file in the same directory and
renames it over the old one.

A reader treats every file as untrusted input: it opens it without following a symlink,
refuses anything that is not a regular file (a FIFO would block, ``/dev/zero`` never
ends), reads at most ``MAX_BYTES`` and reports every failure as a StateFileError naming the
file and the reason. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from typing import Any

from ..errors import StateFileError
from . import schema
from .records import SchemaError

log = logging.getLogger("ddpmon")

NAME_PATTERN = re.compile(r"^rank-(\d{1,7})\.json$")
MAX_BYTES = 8 * 1024 * 1024
"""A state file holds at most a few hundred KiB (a hang report with 32 threads' stacks)."""
FINAL_WRITE_SECONDS = 2.0
"""The last write at detach or exit waits at most this long (a hung file system)."""
ROOM_BYTES = 1 << 20
"""A state directory whose file system has less free space than this (or no free inode) is
full: more than a state file (tens of KiB; a hang report, a few hundred) and a second of
step history need. A rank whose writes fail for want of space tries again as soon as there
is this much; the doctor takes it as why a live rank's file is stale."""


def path_for(state_dir: str, rank: int) -> str:
    return os.path.join(state_dir, f"rank-{rank}.json")


def file_mode(directory: str) -> int:
    """The mode of every file ddpmon writes in a state directory: 0600, or 0640 when the
    directory is group-readable (a shared directory whose group may run the doctor); never
    readable by others (stacks and paths are in them)."""
    return 0o640 if os.stat(directory).st_mode & stat.S_IRGRP else 0o600


def open_private(path: str) -> int:
    """A file descriptor of a new, empty file at ``path``, open for writing, with
    ``file_mode``: whatever was there (an earlier run's file, a link someone planted) is
    removed, never followed or truncated, and a file that appears meanwhile fails with
    FileExistsError."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    mode = file_mode(os.path.dirname(path) or ".")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    os.fchmod(fd, mode)  # (the umask may have taken bits)
    return fd


def inode_of(path_or_fd: str | int) -> tuple[int, int] | None:
    """(device, inode) of an open file, or of ``path`` itself (a link is not followed); None
    when it is gone."""
    try:
        info = os.fstat(path_or_fd) if isinstance(path_or_fd, int) else os.lstat(path_or_fd)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def own_private(path: str) -> int:
    """Give a file this process has just written (by name, through another library) the
    state files' mode, on the file itself: opened without following a link, and refused
    unless it is a regular file of this user's. Returns its size in bytes."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise OSError(
                errno.EPERM, f"{path} is not a regular file of yours (replaced by another user?)"
            )
        os.fchmod(fd, file_mode(os.path.dirname(path) or "."))
        return info.st_size
    finally:
        os.close(fd)


def encode(data: dict[str, Any]) -> bytes:
    """A state file's bytes."""
    return json.dumps(data, separators=(",", ":"), default=str).encode()


def write_atomic(path: str, data: dict[str, Any] | bytes) -> None:
    """Write ``data`` as JSON (or bytes ``encode`` made) so that readers see the old or the
    new file, never a mix, with ``file_mode``."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".rank-", suffix=".tmp", dir=directory)
    try:
        if file_mode(directory) != 0o600:
            os.fchmod(fd, file_mode(directory))
        with os.fdopen(fd, "wb") as f:
            f.write(data if isinstance(data, bytes) else encode(data))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def free_space(directory: str) -> tuple[int, int] | None:
    """(bytes, files) that an unprivileged writer can still create in ``directory``'s file
    system (``files`` -1 when it does not count them); None when it cannot be told."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, (st.f_favail if st.f_files > 0 else -1)


def full(directory: str) -> bool:
    """Whether ``directory``'s file system is full (``ROOM_BYTES``); False when it cannot
    be told."""
    free = free_space(directory)
    return free is not None and (free[0] < ROOM_BYTES or free[1] == 0)


def read_bytes(path: str, limit: int = MAX_BYTES) -> bytes:
    """The bytes of a regular file, at most ``limit``; StateFileError for anything else
    (a symlink, a FIFO, a device, a directory, a file too large, a read error)."""
    return _read_opened(path, limit)[0]


def read_bytes_stat(path: str, limit: int = MAX_BYTES) -> tuple[bytes, os.stat_result]:
    """``read_bytes``, and the open file's ``fstat``: whose the file read is (``st_uid``)."""
    return _read_opened(path, limit)


def _read_opened(path: str, limit: int) -> tuple[bytes, os.stat_result]:
    """``read_bytes``, and what the open file's ``fstat`` says of it (its owner, its times)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StateFileError(
                path, "is a symbolic link; state files are regular files, so it was not followed"
            ) from None
        raise StateFileError(path, f"cannot be read ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StateFileError(
                path,
                "is not a regular file (a FIFO, device or directory); "
                "state files are regular files",
            )
        if info.st_size > limit:
            raise StateFileError(
                path, f"is {info.st_size} bytes, more than a state file holds ({limit}); not read"
            )
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise StateFileError(path, f"holds more than {limit} bytes; not read")
        return b"".join(chunks), info
    except OSError as exc:
        raise StateFileError(path, f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def written_unix(info: os.stat_result) -> float:
    """When a file was last written, as its file system says: its modification time, but
    never later than its inode's change time, which no user can set (``touch -d`` moves the
    first, and the second to now): a file stamped in the future does not stay fresh."""
    return min(info.st_mtime, info.st_ctime)


def decode(path: str, raw: bytes) -> dict[str, Any]:
    """Parsed JSON of a state file's bytes: an object, or StateFileError."""
    if not raw.strip():
        raise StateFileError(path, "is empty")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise StateFileError(path, "is not UTF-8 text (not a ddpmon state file)") from None
    except RecursionError:
        raise StateFileError(path, "nests JSON too deeply (not a ddpmon state file)") from None
    except ValueError as exc:
        raise StateFileError(path, f"is not valid JSON (truncated or corrupt: {exc})") from None
    if not isinstance(data, dict):
        raise StateFileError(path, "is not a ddpmon state file (not a JSON object)")
    return data


def load(path: str, data: object) -> schema.RankState:
    """Parsed JSON as a RankState; StateFileError names the file and the bad field."""
    try:
        return schema.parse(data)
    except SchemaError as exc:
        raise StateFileError(path, str(exc)) from None
    except RecursionError:
        raise StateFileError(path, "nests JSON too deeply (not a ddpmon state file)") from None


def read(path: str) -> schema.RankState:
    """One state file, checked against the schema; StateFileError says what is wrong."""
    return read_stat(path)[0]


def read_stat(path: str) -> tuple[schema.RankState, os.stat_result]:
    """``read``, and the file's ``fstat``: whose it is (``st_uid``) and when it was written
    (``written_unix``), from the very file read."""
    raw, info = _read_opened(path, MAX_BYTES)
    state = load(path, decode(path, raw))
    named = rank_of(path)
    if named is not None and named != state.rank:
        raise StateFileError(
            path, f"is named for rank {named} but holds rank {state.rank} (not written by ddpmon)"
        )
    return state, info


@contextlib.contextmanager
def cycle_collection_paused() -> Iterator[None]:
    """Pause Python's cycle collector while many files are read: the records hold no cycles,
    and a collector that walks the growing heap again and again doubles the time to read a
    thousand ranks' files."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def list_files(state_dir: str, pattern: re.Pattern[str] = NAME_PATTERN) -> list[str]:
    """The files of ``state_dir`` whose names ``pattern`` matches (its group 1 the rank; by
    default the rank state files), ordered by rank."""
    found = []
    for name in os.listdir(state_dir):
        m = pattern.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(state_dir, name)))
    return [path for _, path in sorted(found)]


def rank_of(path: str) -> int | None:
    """The rank a state file's name says, or None."""
    m = NAME_PATTERN.match(os.path.basename(path))
    return int(m.group(1)) if m else None
