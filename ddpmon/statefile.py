"""Per-rank state files: ``<state_dir>/rank-<R>.json``, rewritten atomically.

The writer is a daemon thread that rewrites the file about once a second and at once when
``notify()`` is called (a notable event). Its loop cannot die: each pass is guarded, a
failure is logged once and retried quietly. Readers never see a half-written file: the
writer writes a temporary file in the same directory and renames it over the old one.
This module never imports torch, so the doctor and the daemon can use ``read``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from .errors import StateFileError

log = logging.getLogger("ddpmon")

FORMAT_VERSION = 1
NAME_PATTERN = re.compile(r"^rank-(\d+)\.json$")


def path_for(state_dir: str, rank: int) -> str:
    return os.path.join(state_dir, f"rank-{rank}.json")


def write_atomic(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON so that readers see the old or the new file, never a mix."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".rank-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, separators=(",", ":"), default=str)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read(path: str) -> dict[str, Any]:
    """One state file's contents; StateFileError says what is wrong with a bad one."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise StateFileError(path, f"cannot be read ({exc.strerror or exc})") from None
    if not text.strip():
        raise StateFileError(path, "is empty")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise StateFileError(path, f"is not valid JSON (truncated or corrupt: {exc})") from None
    if not isinstance(data, dict):
        raise StateFileError(path, "is not a ddpmon state file (not a JSON object)")
    reason = problem(data)
    if reason:
        raise StateFileError(path, reason)
    return data


_NUMBERS = ("now_unix", "last_progress_unix", "started_unix")
_TYPES: dict[str, tuple[type, ...]] = {
    "step": (int,), "world_size": (int,), "pid": (int,), "phase": (str,), "job": (str,),
    "host": (str,), "in_flight": (list,), "unused_parameters": (list,), "buckets": (list,),
    "collective_log": (list,), "timings": (dict,), "notes": (dict,), "errors": (dict,),
    "collectives": (dict,), "collective_seq": (dict,), "collective_sites": (dict,),
    "ddp": (dict,), "hang": (dict, type(None)), "exit": (dict, type(None)),
    "last_collective": (dict, type(None)),
}


def problem(data: dict[str, Any]) -> str | None:
    """What makes a parsed state file unusable for its readers (doctor, top, daemon), or None.
    Keys may be missing (older writers); present ones must have their type."""
    if "rank" not in data:
        return "is not a ddpmon state file (no 'rank' key)"
    rank = data["rank"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        return f"has an invalid rank {rank!r} (expected an integer >= 0)"
    for key in _NUMBERS:
        if key in data and (not isinstance(data[key], (int, float)) or isinstance(data[key], bool)):
            return f"has an invalid {key} {data[key]!r} (expected seconds since the epoch)"
    for key, types in _TYPES.items():
        if key in data and (not isinstance(data[key], types) or isinstance(data[key], bool)):
            expected = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            return f"has an invalid {key} {repr(data[key])[:40]} (expected {expected})"
    for key in ("in_flight", "buckets", "collective_log"):
        if not all(isinstance(item, dict) for item in data.get(key) or ()):
            return f"has an invalid {key} (expected a list of objects)"
    if not all(v is None or isinstance(v, dict) for v in (data.get("timings") or {}).values()
               if not isinstance(v, int)):
        return "has an invalid timings entry (expected objects)"
    return None


def list_files(state_dir: str) -> list[str]:
    """The rank state files in ``state_dir``, ordered by rank."""
    found = []
    for name in os.listdir(state_dir):
        m = NAME_PATTERN.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(state_dir, name)))
    return [path for _, path in sorted(found)]


class StateWriter:
    """Rewrites one rank's state file from ``snapshot()`` every ``interval`` seconds."""

    def __init__(self, path: str, snapshot: Callable[[], dict[str, Any]], interval: float = 1.0) -> None:
        self.path = path
        self._snapshot = snapshot
        self._interval = interval
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="ddpmon-state-writer", daemon=True)

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.write_now()
        self._thread.start()

    def notify(self) -> None:
        """Ask for a rewrite soon (cheap, never blocks)."""
        self._wake.set()

    def write_now(self) -> bool:
        try:
            data = self._snapshot()
            data["format"] = FORMAT_VERSION
            write_atomic(self.path, data)
            if self._failed:
                log.warning("ddpmon: writing %s works again", self.path)
                self._failed = False
            return True
        except Exception as exc:
            if not self._failed:
                log.warning("ddpmon: cannot write the state file %s (%s); retrying quietly", self.path, exc)
                self._failed = True
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            self.write_now()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread (joined with a bound) and write one last time."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.write_now()
