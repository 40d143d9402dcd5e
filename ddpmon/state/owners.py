"""Whose ranks: on one node, a job's name stands for one user's state files.

A state file's job and rank are its writer's word, and any local user can write a file that
claims any job and rank into a directory of their own. What no user can claim is another
user's uid: the file's owner. So when files of several owners claim one job, each owner's
files are read as a job of their own, ``<job>@uid<N>``: a forged file can neither pass for
another user's rank (keep a killed rank up, make a healthy job look desynchronised) nor hide
one, and two users who chose the same name see two jobs. The daemon and the doctor read
files through this one rule; the daemon also bounds what one user's files cost it.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the CLI reads the bound below when it builds its parser: kept light)
    from .schema import RankState

MAX_RANKS_PER_USER = 256
"""State files the daemon reads per user (the files' owner) at each pass: a node runs a few
dozen ranks, so a user who writes thousands of files costs the daemon, and Prometheus, this
many ranks' reads and series, not thousands (``ddpmon daemon --max-ranks-per-user``)."""


def separate(
    found: Sequence[tuple[str, RankState, int]],
) -> tuple[list[tuple[str, RankState]], dict[str, list[int]]]:
    """(path, state) of each (path, state, owner uid), a job claimed by several owners
    renamed for each owner; and those jobs with their owners, to be said."""
    owners: dict[str, set[int]] = {}
    for _, state, uid in found:
        owners.setdefault(state.job or "", set()).add(uid)
    shared = {job: sorted(uids) for job, uids in owners.items() if len(uids) > 1}
    out = []
    for path, state, uid in found:
        job = name_of(state.job or "", uid, shared)
        out.append(
            (path, state if job == (state.job or "") else dataclasses.replace(state, job=job))
        )
    return out, shared


def name_of(job: str, uid: int, shared: Mapping[str, Sequence[int]]) -> str:
    """The job a file of ``uid`` that claims ``job`` is read as: its own name, or
    ``owned_name`` when several owners claim it (``shared``, as ``separate`` found)."""
    return owned_name(job, uid) if job in shared else job


def owned_name(job: str, uid: int) -> str:
    """The name of one owner's files of a job that several owners claim."""
    return f"{job}@uid{uid}"


def readable_by(uid: int) -> Callable[[str], bool]:
    """Whether the user ``uid`` could read a path itself: the file readable, every directory
    above it searchable, for that user, by the mode bits (``os.access`` asks for this
    process's user; the daemon serves files to others). The user's groups are looked up
    once, for every path asked."""
    if uid == 0:
        return lambda path: True
    groups = _groups(uid)
    return lambda path: _readable(path, uid, groups)


def _readable(path: str, uid: int, groups: set[int]) -> bool:
    here = os.path.abspath(path)
    bit = stat.S_IROTH
    while True:
        try:
            info = os.stat(here)
        except OSError:
            return False
        if info.st_uid == uid:
            allowed = info.st_mode & (bit << 6)
        elif info.st_gid in groups:
            allowed = info.st_mode & (bit << 3)
        else:
            allowed = info.st_mode & bit
        if not allowed:
            return False
        above = os.path.dirname(here)
        if above == here:
            return True
        here, bit = above, stat.S_IXOTH


def _groups(uid: int) -> set[int]:
    """The groups of the user ``uid`` (none for a uid without a name here)."""
    import grp
    import pwd

    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return set()
    return {user.pw_gid, *(g.gr_gid for g in grp.getgrall() if user.pw_name in g.gr_mem)}
