"""Fuses: a part of ddpmon that fails is logged once and switches itself off."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("ddpmon")


class Fuse:
    """Guards one part (a hook, a thread, a collector). ``ok`` turns False at the first
    failure, which is logged once with its traceback and reported through ``on_blow``."""

    __slots__ = ("part", "ok", "_on_blow")

    def __init__(self, part: str, on_blow: Callable[[str, str], None] | None = None) -> None:
        self.part = part
        self.ok = True
        self._on_blow = on_blow

    def blow(self, exc: BaseException) -> None:
        if not self.ok:
            return
        self.ok = False
        log.warning(
            "ddpmon: %s failed and is now switched off; training goes on: %r",
            self.part, exc, exc_info=exc,
        )
        if self._on_blow is not None:
            try:
                self._on_blow(self.part, f"{type(exc).__name__}: {exc}")
            except Exception:  # the report itself must not fail the caller
                pass
