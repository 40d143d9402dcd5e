"""The node daemon's one route that acts, ``POST /set`` (``ddpmon set --from``): a request to
change live options, placed as a request file for each rank of the job this node serves,
which each rank then takes as it takes ``ddpmon set STATE_DIR``'s (``state/settings.py``).

Off unless the daemon runs with ``--allow-requests``, and even then taken only from a client
that proved who it is (the web config's ``basic_auth_users``, or a verified client
certificate) and, without TLS, only on this host: a password sent in the clear over the
network could be replayed. Every refusal is a 403 that says why and what to change.

The body is hostile input: a bounded JSON object, the live options only, each value checked
by the rank's own code (``config.live_value``). The daemon, never the asker, chooses the
ranks (those of the job whose live processes it serves), the nonces and the file names, and
binds each request to the rank's process from its state file. A request file is written in
a directory opened without following links, that belongs to the state file's owner and that
not every user may write (a team's group-writable directory is one: the rank refuses a
member's request by its owner); it is created exclusively (never through a link) under a temporary
name, given to that owner (a daemon running as root), and renamed into place, so that the
rank's own checks (its user's regular file) accept it unchanged. Torch-free.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable
from typing import Any

from ..config import live_value
from ..errors import ConfigError
from ..httpd import BadRequest, Forbidden, Query, Reader
from ..state import files, schema, settings
from ..webconfig import WebConfig
from .discovery import StateFiles

log = logging.getLogger("ddpmon")

MAX_BODY_BYTES = settings.MAX_FILE_BYTES
"""A request's body holds a few hundred bytes."""
MAX_TIMEOUT_SECONDS = settings.MAX_TIMEOUT_SECONDS
FIELDS = ("job", "rank", "changes", "timeout")


class Refused(Exception):
    """One rank's request cannot be placed: why, and the fix."""


def loopback(peer: tuple[Any, ...]) -> bool:
    """Whether a client's address is this host's loopback."""
    import ipaddress

    try:
        address = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
    except (ValueError, IndexError):
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool((mapped or address).is_loopback)


def permission(allowed: bool, web: WebConfig | None, reader: Reader) -> str | None:
    """Why ``reader`` may not act on this daemon (a 403's text, with the fix), or None."""
    if not allowed:
        return (
            "this daemon takes no requests that change a job: start it with --allow-requests "
            "(and credentials in --web-config-file; docs/daemon.md)"
        )
    if web is None or not web.guarded:
        return (
            "this daemon's web config sets no credentials, and requests that change a job need "
            "them: add basic_auth_users (bcrypt hashes) to --web-config-file (docs/security.md)"
        )
    if not reader.authenticated:
        return "the request did not prove who sent it: give the web config's credentials"
    if not reader.encrypted and not loopback(reader.peer):
        return (
            "without TLS this daemon takes requests from this host only (credentials would "
            "cross the network in the clear): add tls_server_config to --web-config-file, or "
            "send the request from this host"
        )
    return None


def parse(body: bytes) -> tuple[str | None, int | None, dict[str, str], float]:
    """(job, rank, changes, timeout) of a request's body; BadRequest says what is wrong."""
    if len(body) > MAX_BODY_BYTES:
        raise BadRequest(f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BadRequest(
            'the body is not a JSON object such as {"changes": {"hang_timeout": "600"}}'
        ) from None
    if not isinstance(data, dict):
        raise BadRequest('the body is not a JSON object such as {"changes": {...}}')
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}; expected {', '.join(FIELDS)}")
    job, rank, changes = data.get("job"), data.get("rank"), data.get("changes")
    timeout = data.get("timeout", 10.0)
    if job is not None and (not isinstance(job, str) or not 0 < len(job) <= 256):
        raise BadRequest(f"job={job!r} is not a job's name")
    if rank is not None and (
        isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < schema.MAX_RANKS
    ):
        raise BadRequest(f"rank={rank!r} is not a rank")
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout <= MAX_TIMEOUT_SECONDS
    ):
        raise BadRequest(
            f"timeout={timeout!r} is not valid: expected 0 to {MAX_TIMEOUT_SECONDS:g} s"
        )
    if not isinstance(changes, dict) or not 0 < len(changes) <= settings.MAX_CHANGES:
        raise BadRequest(f"changes must map 1 to {settings.MAX_CHANGES} options to their values")
    checked = {}
    for name, text in changes.items():
        if not isinstance(text, str) or len(text) > 256:
            raise BadRequest(f"the value of {name!r} is not text")
        try:
            live_value(name, text)  # the rank's own check: a bad value is never placed
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
        checked[name] = text
    return job, rank, checked, float(timeout)


def place(
    state_dir: str, state: schema.RankState, owner: int, changes: dict[str, str], timeout: float
) -> str:
    """Write ``state``'s rank a request for ``changes`` in ``state_dir``, as its owner's
    file; the request's nonce. Refused says why it cannot be placed there."""
    try:
        directory = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise Refused(f"its directory {state_dir} cannot be opened ({exc.strerror})") from None
    try:
        info = os.fstat(directory)
        if info.st_uid != owner:
            raise Refused(
                f"its directory {state_dir} belongs to uid {info.st_uid}, not to the job's "
                f"user (uid {owner})"
            )
        if info.st_mode & stat.S_IWOTH:
            raise Refused(
                f"its directory {state_dir} may be written by any user "
                f"(mode {stat.S_IMODE(info.st_mode):o}), who could swap a request placed "
                "there: make it 0700 (or 2770, a team's)"
            )
        euid = os.geteuid()
        if euid not in (0, owner):
            raise Refused(
                f"this daemon runs as uid {euid} and the rank as uid {owner}, which takes only "
                "its own user's requests: run the daemon as root or as the job's user"
            )
        try:
            named = os.stat(f"rank-{state.rank}.json", dir_fd=directory, follow_symlinks=False)
        except OSError:
            named = None
        if named is None or named.st_uid != owner or not stat.S_ISREG(named.st_mode):
            raise Refused(f"rank {state.rank}'s state file left {state_dir} meanwhile")
        now = time.time()
        request = settings.Request(
            nonce=secrets.token_hex(8),
            rank=state.rank,
            job=state.job,
            pid=state.pid or 0,
            started_unix=state.started_unix or 0.0,
            changes=changes,
            requested_unix=now,
            expires_unix=now + timeout,
        )
        name = os.path.basename(settings.request_path(state_dir, state.rank))
        temporary = f".{name}.{request.nonce}.tmp"
        mode = 0o640 if info.st_mode & stat.S_IRGRP else 0o600
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(temporary, flags, mode, dir_fd=directory)
        try:
            try:
                if euid != owner:
                    os.fchown(fd, owner, info.st_gid)
                os.fchmod(fd, mode)
                os.write(fd, files.encode(request.to_json()))
            finally:
                os.close(fd)
            # a link or file already at the name is replaced, never followed
            os.rename(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
        except OSError as exc:
            try:
                os.unlink(temporary, dir_fd=directory)
            except OSError:
                pass
            raise Refused(
                f"the request cannot be written in {state_dir} ({exc.strerror})"
            ) from None
        return request.nonce
    finally:
        os.close(directory)


class Requests:
    """``POST /set`` over the state files ``files`` of the ranks ``is_local`` says run here."""

    def __init__(
        self,
        files: StateFiles,
        is_local: Callable[[schema.RankState], bool],
        hostname: str,
        allowed: bool,
        web: WebConfig | None,
        stale_after: float,
    ) -> None:
        self._stale_after = stale_after
        self._files = files
        self._is_local = is_local
        self._hostname = hostname
        self._allowed = allowed
        self._web = web

    def set_route(self, query: Query, reader: Reader, body: bytes) -> tuple[str, bytes]:
        """Place the request for every live rank of the job here (its state file still
        rewritten; a rank ended or detached is left alone), or the one asked for:
        ``{"host", "job", "placed": {rank: nonce}, "refused": {rank: why}}``; each rank's
        answer then shows in its state file's ``settings_answer`` (``/state``)."""
        why = permission(self._allowed, self._web, reader)
        if why is not None:
            raise Forbidden(why)
        job, rank, changes, timeout = parse(body)
        now = time.time()
        live = [  # (its process: the rank checks the request is for it)
            (path, state, owner)
            for path, state, owner, written in self._files.read_all()
            if self._is_local(state)
            and state.exit is None
            and state.stage != schema.Stage.DETACHED
            and now - written <= self._stale_after
        ]
        if job is None:
            jobs = sorted({s.job or "" for _, s, _ in live})
            if len(jobs) > 1:
                raise BadRequest(
                    f"ranks of several jobs run here ({', '.join(map(repr, jobs))}): name one "
                    "(ddpmon set --job JOB)"
                )
            job = jobs[0] if jobs else None
        placed: dict[str, str] = {}
        refused: dict[str, str] = {}
        for path, state, owner in live:
            if (state.job or "") != (job or "") or rank not in (None, state.rank):
                continue
            try:
                placed[str(state.rank)] = place(
                    os.path.dirname(path), state, owner, changes, timeout
                )
                log.warning(
                    "ddpmon: daemon: asked rank %d of job %r to set %s (from %s)",
                    state.rank,
                    job,
                    ", ".join(f"{k}={v}" for k, v in changes.items()),
                    reader.peer[0] if reader.peer else "?",
                )
            except Refused as exc:
                refused[str(state.rank)] = str(exc)
        answer = {"host": self._hostname, "job": job, "placed": placed, "refused": refused}
        return "application/json", json.dumps(answer).encode()
