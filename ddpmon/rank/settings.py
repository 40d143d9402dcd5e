"""``ddpmon set``: options of this rank changed while it runs, asked for through its state
directory (the protocol: ``state/settings.py``; the options and their values:
``config.LIVE_OPTIONS``).

The state writer's thread calls ``poll()`` after each write, as it does for captures: at
most once a second one ``lstat`` looks for ``set-<R>.request``. A request is taken (removed)
and checked as hostile input: the rank's own user's regular file (never a link), bound to
this process, not expired. Each change is checked (``config.live_value``) and handed to the
part that owns the option, which applies it or says why it cannot; the answer names both,
in ``set-<R>-<nonce>.status``. The training thread is never involved.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from ..config import live_value
from ..errors import ConfigError
from ..fuses import Fuse
from ..state import captures, schema, settings
from .recorder import Recorder

log = logging.getLogger("ddpmon")

LOOK_INTERVAL = 1.0
"""Seconds between two looks for a request file."""


class LiveSettings:
    """Requests to this rank whose state files go to ``state_dir``. ``apply`` maps each live
    option to the part's setter: it takes the checked value and returns None once applied,
    else why it cannot apply it here."""

    def __init__(
        self,
        state_dir: str,
        recorder: Recorder,
        apply: dict[str, Callable[[Any], str | None]],
        notify: Callable[[], None],
        fuse: Fuse,
    ) -> None:
        self._dir = state_dir
        self._rec = recorder
        self._rank = int(recorder.identity.rank)
        self._request = settings.request_path(state_dir, self._rank)
        self._apply = apply
        self._notify = notify
        self._fuse = fuse
        self._next_look = 0.0

    def poll(self) -> None:
        """At most once a second, look for a request and answer it."""
        if not self._fuse.ok:
            return
        try:
            now = time.monotonic()
            if now < self._next_look:
                return
            self._next_look = now + LOOK_INTERVAL
            if os.path.lexists(self._request):
                self._take()
        except Exception as exc:
            self._fuse.blow(exc)

    def _take(self) -> None:
        request, why = captures.take(
            self._request, lambda path: settings.read_request(path, owner=os.geteuid())
        )
        rec = self._rec
        if request is not None:
            why = captures.refusal(
                request, self._rank, rec.identity.job, os.getpid(), rec.started_unix, time.time()
            )
        if why is not None or request is None:
            log.info(
                "ddpmon: rank %d: ignored the settings request %s: %s",
                self._rank,
                self._request,
                why,
            )
            return
        status = settings.Status(
            nonce=request.nonce,
            rank=self._rank,
            step=rec.steps,
            job=rec.identity.job,
            written_unix=time.time(),
        )
        for name, text in request.changes.items():
            try:
                value = live_value(name, text)
                refused = self._apply[name](value)
            except ConfigError as exc:
                refused = str(exc)
            if refused is None:
                status.applied[name] = value
                log.warning("ddpmon: rank %d: %s is now %r (ddpmon set)", self._rank, name, value)
            else:
                status.refused[name] = refused
                log.warning("ddpmon: rank %d: refused %s=%r: %s", self._rank, name, text, refused)
        settings.prune(self._dir, self._rank, settings.KEEP - 1)
        settings.write_status(self._dir, status)
        rec.settings_answer = schema.SettingsAnswer(
            status.nonce, status.applied, status.refused, status.step, status.written_unix
        )  # in the state file too: what a node daemon's /state serves
        self._notify()
