"""Every attempt of a restarted job kept apart: ``<state_dir>/attempt-<N>/``.

A launcher that restarts a job (torchrun ``--max-restarts``) starts every rank again with
the same job name, so the ranks of the next attempt write into the same state directory.
The current attempt writes ``rank-<R>.json`` and ``rank-<R>.history.sqlite`` where every
reader looks for them; at attach, a rank that finds its own files from an earlier attempt
of the same job (the file's ``job`` is this job's, its ``attempt`` lower than this one's)
first moves them into ``attempt-<N>/`` (N: the attempt that wrote them). Each rank moves
only its own files, so ranks never race, and it removes its own files from attempts older
than the last ``KEEP`` (an emptied directory goes with them).

``attempt`` is torchelastic's TORCHELASTIC_RESTART_COUNT (0 first). A rank ended by ddpmon
after a proven hang (``hang_action=abort``) exits with ``HANG_EXIT_CODE``. Nothing here
imports torch.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

from ..errors import StateFileError
from . import files, history, root, schema

log = logging.getLogger("ddpmon")

KEEP = 10
"""Earlier attempts kept per state directory (each rank prunes its own files)."""
HANG_EXIT_CODE = 87
"""The exit status of a rank that ddpmon ended after a proven hang (``hang_action=abort``):
not used by Python (0, 1, 2), shells (126, 127), signals (128 + N) or torchelastic."""
DIR_PATTERN = re.compile(r"^attempt-(\d{1,6})$")
_SUFFIXES = (".json", history.SUFFIX, history.SUFFIX + "-wal", history.SUFFIX + "-shm", ".fault")


def attempt_of(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's attempt (TORCHELASTIC_RESTART_COUNT), None outside torchelastic."""
    environ = os.environ if environ is None else environ
    try:
        return int(environ["TORCHELASTIC_RESTART_COUNT"])
    except (KeyError, ValueError):
        return None


def dir_for(state_dir: str, attempt: int) -> str:
    return os.path.join(state_dir, f"attempt-{attempt}")


def is_attempt_dir(name: str) -> bool:
    """Whether a directory name is an earlier attempt's (readers of the current attempt
    leave these out)."""
    return DIR_PATTERN.match(os.path.basename(name.rstrip("/"))) is not None


def earlier(state_dir: str) -> list[tuple[int, str]]:
    """The kept earlier attempts of ``state_dir``: (attempt, directory), oldest first."""
    try:
        names = os.listdir(state_dir)
    except OSError:
        return []
    found = []
    for name in names:
        m = DIR_PATTERN.match(name)
        path = os.path.join(state_dir, name)
        if m and os.path.isdir(path) and not os.path.islink(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def _rank_files(directory: str, rank: int) -> list[str]:
    return [os.path.join(directory, f"rank-{rank}{suffix}") for suffix in _SUFFIXES]


def keep_earlier(
    state_dir: str, rank: int, job: str, attempt: int | None, keep: int = KEEP
) -> int | None:
    """Before this rank writes: move its own files of an earlier attempt of ``job`` into
    ``attempt-<N>/`` and drop its files of attempts older than the last ``keep``. Returns
    the attempt moved, or None (nothing of an earlier attempt there, or no attempt known)."""
    if attempt is None or attempt <= 0:
        return None
    path = files.path_for(state_dir, rank)
    try:
        old = files.read(path)
    except (StateFileError, OSError):
        return None
    if old.job != job or old.pid == os.getpid():
        return None
    earlier_attempt = old.attempt if old.attempt is not None else 0
    if earlier_attempt >= attempt:
        return None
    target = dir_for(state_dir, earlier_attempt)
    try:  # never more open than the state directory; never a link or another user's directory
        root.make_subdir(target, os.stat(state_dir).st_mode)
    except root.UnsafeStateDir as exc:
        log.warning(
            "ddpmon: rank %d: the files of attempt %d stay where they are: %s",
            rank,
            earlier_attempt,
            exc,
        )
        return None
    for source in _rank_files(state_dir, rank):
        if os.path.lexists(source):
            os.replace(source, os.path.join(target, os.path.basename(source)))
    _prune(state_dir, rank, keep)
    return earlier_attempt


def _prune(state_dir: str, rank: int, keep: int) -> None:
    """Remove this rank's files from attempts older than the newest ``keep``."""
    kept = earlier(state_dir)
    for _, directory in kept[: max(0, len(kept) - keep)]:
        for path in _rank_files(directory, rank):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(directory)  # only once every rank has taken its files out
        except OSError:
            pass


def ended_by_hang_abort(state: schema.RankState) -> bool:
    """Whether a rank's file says ddpmon ended it after a proven hang."""
    return state.exit is not None and state.exit.how == "hang_abort"


def attempt_files(state_dir: str) -> list[str]:
    """The state files of every kept earlier attempt of ``state_dir``, oldest attempt first."""
    out: list[str] = []
    for _, directory in earlier(state_dir):
        try:
            out += files.list_files(directory)
        except OSError:
            continue
    return out
