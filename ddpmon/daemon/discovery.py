"""Which state files the node daemon reads: ``DIR/rank-*.json`` and ``DIR/*/rank-*.json``
under its state directory (or under each per-user root a pattern names), bounded per user,
a job that several users claim split by owner. Every problem is said once, and once more
when it is gone: nothing found here stops the daemon."""

from __future__ import annotations

import glob
import logging
import os
import re
import stat
import threading
from typing import NamedTuple

from ..errors import StateFileError
from ..state import attempts, files, launcher, owners, schema

log = logging.getLogger("ddpmon")


class Found(NamedTuple):
    """A state file as read: its rank's own word (``state``), whose file it is (``owner``,
    its uid) and when it was written, as its file system says (``files.written_unix``)."""

    path: str
    state: schema.RankState
    owner: int
    written: float


class StateFiles:
    """Reads a node's state files: ``DIR/rank-*.json`` and ``DIR/*/rank-*.json`` (ranks
    default to one directory per job under a common root). Every problem (the directory
    missing, a file corrupt) is logged once, and once more when it is gone."""

    def __init__(self, state_dir: str, max_per_user: int = owners.MAX_RANKS_PER_USER) -> None:
        self.state_dir = state_dir
        self.max_per_user = max_per_user
        self._problems: dict[str, str] = {}
        self._lock = threading.RLock()  # the sampler and /state requests read concurrently
        self.shared: dict[str, list[int]] = {}
        """The jobs that files of several owners claim (``state/owners.py``), at the last read."""

    def read_all(self) -> list[Found]:
        """Every readable state file, a job that several users' files claim renamed for each
        owner (``state/owners.py``)."""
        with self._lock:
            return self._read_all()

    def _read_all(self) -> list[Found]:
        paths = self._bounded(self._paths())
        read = []
        for path in paths:
            try:
                data, info = files.read_stat(path)
            except StateFileError as exc:
                if os.path.exists(path):  # (else it went away between listing and reading)
                    self.problem(path, f"state file {exc}; skipped until it is fixed")
                continue
            self.resolved(path, f"state file {path} is readable again")
            read.append((path, data, info))
        separated, self.shared = owners.separate(
            [(path, data, info.st_uid) for path, data, info in read]
        )
        for job, uids in self.shared.items():
            self.problem(
                f"{self.state_dir}#owners#{job}",
                (
                    f"state files of {len(uids)} users claim job {job!r} ({', '.join(f'uid {u}' for u in uids)}): "
                    "each user's are exported as a job of their own, "
                    f"{', '.join(repr(owners.owned_name(job, u)) for u in uids)}, since one of them may be "
                    "forged; give concurrent jobs distinct names"
                ),
            )
        out = [
            Found(path, state, info.st_uid, files.written_unix(info))
            for (path, state), (_, _, info) in zip(separated, read)
        ]
        for key in [
            k
            for k in self._problems
            if k.split("#")[0] != self.state_dir and not os.path.exists(k.split("#")[0])
        ]:
            del self._problems[key]  # the file is gone: a new one of that name is news again
        for key in [
            k
            for k in self._problems
            if "#owners#" in k and k.split("#owners#")[1] not in self.shared
        ]:
            del self._problems[key]
        return out

    def _bounded(self, paths: list[str]) -> list[str]:
        """At most ``max_per_user`` of each owner's files, those written last; the rest are
        skipped, said once per owner."""
        by_owner: dict[int, list[tuple[float, str]]] = {}
        for path in paths:
            try:
                info = os.lstat(path)
            except OSError:
                continue
            by_owner.setdefault(info.st_uid, []).append((files.written_unix(info), path))
        kept: set[str] = set()
        for uid, found in by_owner.items():
            key = f"{self.state_dir}#bound#{uid}"
            if len(found) > self.max_per_user:
                found = sorted(found, reverse=True)[: self.max_per_user]
                self.problem(
                    key,
                    f"uid {uid} has more than {self.max_per_user} state files here, the most the "
                    f"daemon reads per user (--max-ranks-per-user): the {self.max_per_user} "
                    "written last are read, the others skipped",
                )
            else:
                self.resolved(key, f"uid {uid}'s state files are within --max-ranks-per-user again")
            kept.update(path for _, path in found)
        return [path for path in paths if path in kept]

    def problem(self, key: str, message: str) -> None:
        with self._lock:
            if self._problems.get(key) == message:
                return
            self._problems[key] = message
        log.warning("ddpmon: daemon: %s", message)

    def resolved(self, key: str, message: str) -> None:
        with self._lock:
            if self._problems.pop(key, None) is None:
                return
        log.warning("ddpmon: daemon: %s", message)

    def launcher_paths(self) -> list[str]:
        """The launchers' records under the state roots (``launcher-*.json`` beside the rank
        files, and in each job's directory)."""
        roots = (
            [r for r in sorted(glob.glob(self.state_dir)) if not foreign_root(r)]
            if glob.has_magic(self.state_dir)
            else [self.state_dir]
        )
        out = []
        for root in roots:
            out += launcher.list_paths(root)
            try:
                subdirs = sorted(
                    e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False)
                )
            except OSError:
                continue
            for sub in subdirs:
                if not attempts.is_attempt_dir(sub):
                    out += launcher.list_paths(sub)
        return out

    def _paths(self) -> list[str]:
        if not glob.has_magic(self.state_dir):
            return self._paths_under(self.state_dir)
        paths: list[str] = []  # a pattern: the per-user roots <tmp>/ddpmon-<uid>
        for root in sorted(glob.glob(self.state_dir)):
            what = foreign_root(root)
            if what:
                self.problem(
                    root, f"state directory {root} {what}; skipped (planted by another user?)"
                )
                continue
            self.resolved(root, f"state directory {root} is fine now")
            paths.extend(self._paths_under(root))
        return paths

    def _paths_under(self, root: str) -> list[str]:
        if not os.path.isdir(root):
            if os.path.exists(root):
                self.problem(root, f"state directory {root} is not a directory; waiting for one")
            else:
                self.problem(root, f"state directory {root} does not exist yet; waiting for it")
            return []
        self.resolved(root, f"state directory {root} is there now")
        try:
            paths = files.list_files(root)
            subdirs = sorted(e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False))
        except OSError as exc:
            self.problem(
                root + "#list", f"state directory {root} cannot be listed ({exc.strerror or exc})"
            )
            return []
        self.resolved(root + "#list", f"state directory {root} can be listed again")
        for sub in subdirs:
            if attempts.is_attempt_dir(sub):
                continue  # an earlier attempt of a restarted job: counted, not a rank now
            try:
                paths.extend(files.list_files(sub))
            except OSError as exc:
                self.problem(
                    sub + "#list", f"state directory {sub} cannot be listed ({exc.strerror or exc})"
                )
                continue
            self.resolved(sub + "#list", f"state directory {sub} can be listed again")
        return paths


def foreign_root(path: str) -> str | None:
    """What is wrong with a per-user root ``ddpmon-<uid>``: it must be a real directory
    owned by that uid and writable by no one else, so another user cannot pass files off
    as that user's ranks. None when it is fine (or not named for a uid)."""
    m = re.fullmatch(r"ddpmon-(\d+)", os.path.basename(path))
    if m is None:
        return None
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"cannot be checked ({exc.strerror or exc})"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory (a symbolic link?)"
    if info.st_uid != int(m.group(1)):
        return f"is owned by uid {info.st_uid}, not by uid {m.group(1)} its name says"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None
