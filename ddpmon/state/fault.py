"""A rank's faulthandler file (``rank-<R>.fault``): the fatal signal that killed it and
every thread's Python stack at that moment, as an exit record (``Exit.signal``).

A backend that aborts says why on the rank's stderr, not in Python (gloo: "terminate called
after throwing an instance of 'gloo::EnforceNotMet' what(): ... Is there a distributed
collective mismatch in your code?"). When the rank's stderr is a regular file (a per-rank
log), the rank names it in the fault file's first line (``STDERR_LINE``) and the reader
adds the last such reason in that log to the record's ``exception``."""

from __future__ import annotations

import os
import re
import stat

from ..frames import is_library_anywhere
from .schema import Exit, Frame, RankState, Thread

SIGNALS = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
MAX_BYTES = 1 << 20
STDERR_LINE = "ddpmon: stderr "
"""The fault file's first line, written by the rank at attach: ``ddpmon: stderr PATH``."""
LOG_TAIL_BYTES = 64 << 10
_STDERR = re.compile("^" + re.escape(STDERR_LINE) + "(.+)$", re.MULTILINE)
_TERMINATE = re.compile(
    r"terminate called after throwing an instance of '([^']+)'\n\s*what\(\):\s*(.+)"
)
_HEADER = re.compile(r"^Fatal Python error: (.+)$", re.MULTILINE)
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*)$')


def path_for(state_file: str) -> str:
    """The faulthandler file of the rank whose state file is ``state_file``."""
    base = state_file[:-5] if state_file.endswith(".json") else state_file
    return base + ".fault"


def read(state_file: str, since: float | None = None) -> Exit | None:
    """The fault record beside ``state_file``; None when there is none (or it is older than
    ``since``, an earlier run's, or it is not a regular file of the state file's owner)."""
    try:  # a regular file of the state file's owner, never through a link (the daemon reads as root)
        owner = os.lstat(state_file).st_uid
    except OSError:
        return None
    found = _read_owned(path_for(state_file), owner, MAX_BYTES)
    if found is None or not found[0] or (since is not None and found[1] < since):
        return None
    text, mtime = found
    record = parse(text, mtime)
    log = _STDERR.search(text)
    if record is not None and log is not None and (reason := abort_reason(log.group(1), owner)):
        record.exception = f"{record.exception}, after {reason}"
    return record


def abort_reason(log: str, owner: int) -> str | None:
    """``Type: what()`` of the last C++ exception that ended a process through
    ``std::terminate`` in the tail of ``log`` (a regular file of ``owner``): the backend's
    own words for an abort."""
    found = _read_owned(log, owner, LOG_TAIL_BYTES, last=True)
    matches = list(_TERMINATE.finditer(found[0])) if found else []
    return f"{matches[-1].group(1)}: {matches[-1].group(2).strip()}" if matches else None


def _read_owned(path: str, owner: int, limit: int, last: bool = False) -> tuple[str, float] | None:
    """Up to ``limit`` bytes of ``path`` (its last ones with ``last``) and its mtime, when it
    is a regular file of ``owner``, opened without following a link; else None."""
    try:
        fd = os.open(
            path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        )
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != owner:
                return None
            if last:
                f.seek(max(0, st.st_size - limit))
            return f.read(limit).decode("utf-8", "replace"), st.st_mtime
        except OSError:
            return None


def of_run(state_file: str, state: RankState, offset: float) -> Exit | None:
    """The fatal signal that ended this run of the rank, when its state file records no
    other end (a signal leaves none; an ``os._exit`` record is superseded): None without a
    fault file, or with an earlier run's. ``offset`` maps the writer's clock onto the file
    system's (the state file's mtime less its ``now_unix``)."""
    if state.exit is not None and state.exit.how != "os._exit":
        return None
    return read(state_file, state.started_unix + offset - 1.0 if state.started_unix else None)


def parse(text: str, unix: float) -> Exit | None:
    m = _HEADER.search(text)
    if m is None:
        return None
    what = m.group(1).strip()
    signal = SIGNALS.get(what, what)
    threads: list[Thread] = []
    for line in text.splitlines():
        t = _THREAD.match(line)
        if t:
            threads.append(
                Thread(
                    name=("current thread " if t.group(1) == "Current thread" else "thread ")
                    + t.group(2),
                    main=t.group(1) == "Current thread",
                )
            )
            continue
        fr = _FRAME.match(line)
        if fr and threads:
            lineno = int(fr.group(2)) if fr.group(2).isdigit() else None
            threads[-1].frames.append(Frame(fr.group(1), lineno, fr.group(3)))
    for thread in threads:
        thread.frames.reverse()  # innermost last, as everywhere else
    if not any(t.main for t in threads):
        # the signal came from a thread without Python (a backend's own thread): the thread
        # that runs the script is the one that matters
        script = next(
            (t for t in threads if any(f.function == "<module>" for f in t.frames[:3])), None
        )
        if script is not None:
            script.main = True
    threads.sort(key=lambda t: not t.main)  # the thread that took the signal first
    record = Exit(
        unix=unix, how="signal", signal=signal, threads=threads, exception=f"{signal} ({what})"
    )
    top = next(
        (
            f
            for t in threads[:1]
            for f in reversed(t.frames)
            if not is_library_anywhere(f.file or "")
        ),
        None,
    )
    if top is None and threads and threads[0].frames:
        top = threads[0].frames[-1]
    if top is not None:
        record.where = f"{top.file}:{top.line} in {top.function}"
    return record
