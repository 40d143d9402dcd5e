"""Where state files may be written: a private per-user root, checked before every attach.

The temporary directory is shared by every user of a machine, so nothing found there is
trusted: the default root is ``<tmp>/ddpmon-<uid>`` (created 0700), and before a rank
writes, the root and the job directory must be real directories (not symlinks) owned by
this user and not writable by others. A directory set explicitly (``state_dir``, for
example a shared NFS directory of a multi-node job) must be owned by this user too, and
may be group-writable: the group is trusted by whoever made it so. When a check fails the
rank writes no state file and says which path, what is wrong and how to fix it; training
goes on either way.

Job names become directory names, so they are sanitised (no separators, no ``..``); the
default job name is unique per launch, so two concurrent jobs never share a directory
or a ``job`` label. Nothing here imports torch at module level.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import stat
import sys
import tempfile
import uuid
from collections.abc import Mapping

log = logging.getLogger("ddpmon")

ATTACH_FS_SECONDS = 5.0
"""Attach waits at most this long for the file system (creating and checking the state
directory); a hung mount turns state files off instead of stalling the training thread."""
_LAUNCH_KEY = "ddpmon/launch_id"


class UnsafeStateDir(Exception):
    """A state directory ddpmon will not write to; the message names the path, what is
    wrong and the fix."""


def temp_dir() -> str:
    """The machine's temporary directory as ``tempfile`` names it (``TMPDIR``, ``TEMP`` or
    ``TMP``, else ``/tmp``), without ``tempfile.gettempdir()``'s test write: the daemon
    reads the users' roots there from a read-only file system (the shipped systemd unit's
    ``ProtectSystem=strict``, the DaemonSet's ``readOnlyRootFilesystem``), where that test
    fails and would stop it at start."""
    if tempfile.tempdir:
        return tempfile.tempdir
    for var in ("TMPDIR", "TEMP", "TMP"):
        if os.environ.get(var):
            return os.path.abspath(os.environ[var])
    return "/tmp"


def default_root(uid: int | None = None) -> str:
    """The per-user root of default job directories: ``<tmp>/ddpmon-<uid>``. The same for
    every process of a user (the doctor, the daemon and other users can find it), never
    shared between users."""
    return os.path.join(temp_dir(), f"ddpmon-{os.geteuid() if uid is None else uid}")


def sanitize_job(job: str) -> str:
    """A job name safe as one directory name: no path separators, no leading dot (so
    never ``.`` or ``..``), at most 128 characters."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(job))[:128]
    if not safe or safe.startswith("."):
        safe = "_" + safe[1:] if safe else "_"
    return safe


def job_dir(job: str) -> str:
    """The default directory of a job's state files."""
    return os.path.join(default_root(), sanitize_job(job))


def default_job(environ: Mapping[str, str]) -> str:
    """The job name when none is given: TORCHELASTIC_RUN_ID (torchrun, unless ``none``),
    else ``ddp-<launch id>``, the same on every rank of one launch and different for two
    launches (a rendezvous address alone is not: two jobs on two nodes may both use
    localhost:29500)."""
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return run_id
    return f"ddp-{launch_id()}"


_launch_id: str | None = None


def launch_id() -> str:
    """Eight hex digits naming this launch: agreed through the job's c10d store (the first
    rank to ask sets it, never waiting on the others), else derived from the launcher
    process (the parent every rank of one torchrun or mp.spawn shares)."""
    global _launch_id
    if _launch_id is None:
        from ..fuses import bounded

        agreed = bounded(_launch_id_from_store, ATTACH_FS_SECONDS, "agreeing on a launch id")
        _launch_id = str(agreed) if agreed else _launch_id_from_parent()
    return _launch_id


def _launch_id_from_store() -> str | None:
    dist = sys.modules.get("torch.distributed")  # no process group without it: never import torch
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    default_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if default_store is None:  # a private API (see rank/torch_api.py): said once, in the same words
        log.warning(
            "ddpmon: rank %s: one job name through the job's store off (each node names the job "
            "from its launcher process; pass job= to name it): torch %s has no "
            "distributed_c10d._get_default_store; training goes on",
            dist.get_rank(),
            getattr(sys.modules.get("torch"), "__version__", "?"),
        )
        return None
    store = default_store()
    mine = uuid.uuid4().hex[:8]
    agreed = store.compare_set(_LAUNCH_KEY, "", mine)
    return agreed.decode() if isinstance(agreed, bytes) else str(agreed)


def _launch_id_from_parent() -> str:
    ppid = os.getppid()
    try:
        import psutil

        started = psutil.Process(ppid).create_time()
    except Exception:
        started = 0.0
    key = f"{socket.gethostname()}:{ppid}:{started}"
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def problem(path: str, *, group_writable_ok: bool) -> str | None:
    """What makes ``path`` unsafe to write state files into, or None (also when it does
    not exist yet). Checked with lstat: a symlink is never followed."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be checked ({exc.strerror or exc})"
    if stat.S_ISLNK(info.st_mode):
        return f"is a symbolic link (to {os.readlink(path)!r}), not a directory of yours"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    me = os.geteuid()
    if info.st_uid != me:
        return f"is owned by {_user(info.st_uid)}, not by you ({_user(me)})"
    if info.st_mode & stat.S_IWOTH:
        return f"is writable by every user (mode {stat.S_IMODE(info.st_mode):04o})"
    if info.st_mode & stat.S_IWGRP and not group_writable_ok:
        return f"is writable by its group (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def prepare(state_dir: str, explicit: bool) -> None:
    """Create ``state_dir`` (and, for a default one, its per-user root) and check both;
    UnsafeStateDir says why it must not be written to. Every directory ddpmon creates is
    0700: opening one to a group is its owner's choice (docs/security.md). A directory in
    the per-user root is a default one however it was given (``ddpmon run`` passes the
    default as ``DDPMON_STATE_DIR``)."""
    root = os.path.dirname(os.path.abspath(state_dir))
    if not explicit or root == os.path.abspath(default_root()):
        _make(root, group_writable_ok=False)
        _make(state_dir, group_writable_ok=False)
    else:
        _make(state_dir, group_writable_ok=True, parents=True)
    if not os.access(state_dir, os.W_OK | os.X_OK):
        raise UnsafeStateDir(
            f"{state_dir} is not writable by you (read-only file system or "
            "permissions). Fix: set DDPMON_STATE_DIR (or state_dir=) to a "
            "writable directory of yours"
        )


def _make(path: str, group_writable_ok: bool, parents: bool = False, mode: int = 0o700) -> None:
    """Create ``path`` with ``mode`` (and, with ``parents``, each missing directory above it,
    0700) unless it exists, then check it."""
    try:
        if parents:
            _make_private(os.path.dirname(os.path.abspath(path)))
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    except OSError as exc:
        if not os.path.lexists(path):
            raise UnsafeStateDir(
                f"{path} cannot be created ({exc.strerror or exc}). Fix: set "
                "DDPMON_STATE_DIR (or state_dir=) to a writable directory of yours"
            ) from None
    what = problem(path, group_writable_ok=group_writable_ok)
    if what is not None:
        raise UnsafeStateDir(f"{path} {what}. {_fix(path, what)}")


def make_subdir(path: str, mode: int = 0o700) -> None:
    """Create ``path``, a directory of ddpmon's own inside a state directory (``mode``, never
    group-writable), or check the one there: a link or a directory someone else planted,
    where a rank would then move or write its files, raises UnsafeStateDir."""
    _make(path, group_writable_ok=False, mode=mode & 0o750)


def _make_private(path: str) -> None:
    """``os.makedirs(path)`` with every directory it creates 0700 (makedirs gives the ones
    above the last the umask's mode)."""
    if os.path.lexists(path):
        return
    _make_private(os.path.dirname(path))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def _fix(path: str, what: str) -> str:
    if "writable by" in what and "owned" not in what:
        return f"Fix: chmod go-w {path} (or set DDPMON_STATE_DIR to a directory of yours)"
    if "symbolic link" in what:
        return (
            "A link there is never followed. Fix: if the link is yours, set DDPMON_STATE_DIR "
            "(or state_dir=) to its target; if not, remove it (ask an administrator) or set "
            "DDPMON_STATE_DIR to a directory you own"
        )
    return (
        "Another user may have planted it. Fix: remove it if it is not yours (ask the "
        "owner or an administrator), or set DDPMON_STATE_DIR (or state_dir=) to a "
        "directory you own"
    )


def _user(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def owner_elsewhere(path: str) -> str | None:
    """When ``path`` is the state file of a live process of another launch on this host
    (its pid runs, started when the file says): a description of it; else None."""
    from ..collectors import host
    from ..errors import StateFileError
    from . import files, schema

    try:
        state = files.read(path)
    except StateFileError:
        return None
    if state.pid is None or state.pid == os.getpid() or state.host != socket.gethostname():
        return None
    if state.stage == schema.Stage.DETACHED or state.exit is not None:
        return None
    proc = host.locate_process(state.pid, state.started_unix, True, state.rank)
    if proc is None or not host.is_alive(proc):
        return None
    return f"pid {state.pid} (job {state.job!r}, started {state.started_unix or 0:.0f})"


def claim(state_dir: str, rank: int, explicit: bool) -> str | None:
    """The directory this rank writes its state file into, prepared and checked: ``state_dir``,
    or ``<state_dir>-<launch id>`` when a live process of another launch owns this rank's
    file there. None (with one warning saying why and the fix) when state files must stay
    off. Bounded in time: a hung file system never stalls the caller."""
    from ..fuses import bounded
    from . import files

    def work() -> str:
        prepare(state_dir, explicit)
        other = owner_elsewhere(files.path_for(state_dir, rank))
        if other is None:
            return state_dir
        distinct = f"{state_dir}-{launch_id()}"
        log.warning(
            "ddpmon: rank %d: %s belongs to a running process of another launch, %s; this "
            "launch writes to %s instead. Give concurrent jobs distinct names (job=... or "
            "DDPMON_JOB) to keep their state files and metrics apart.",
            rank,
            files.path_for(state_dir, rank),
            other,
            distinct,
        )
        prepare(distinct, explicit)
        return distinct

    failure: list[str] = []

    def guarded() -> str | None:
        try:
            return work()
        except UnsafeStateDir as exc:
            failure.append(str(exc))
            return None

    chosen = bounded(guarded, ATTACH_FS_SECONDS, f"preparing the state directory {state_dir}")
    if chosen is not None:
        return str(chosen)
    reason = (
        failure[0]
        if failure
        else (
            f"{state_dir} did not answer within {ATTACH_FS_SECONDS:.0f} s (a hung file system?) or "
            "could not be prepared. Fix: set DDPMON_STATE_DIR (or state_dir=) to a local directory of yours"
        )
    )
    log.warning("ddpmon: rank %d: state files are off (training goes on): %s", rank, reason)
    return None
