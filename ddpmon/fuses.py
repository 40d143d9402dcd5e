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
            self.part,
            exc,
            exc_info=exc,
        )
        if self._on_blow is not None:
            try:
                self._on_blow(self.part, f"{type(exc).__name__}: {exc}")
            except Exception:  # the report itself must not fail the caller
                pass


def bounded(fn: Callable[[], object], seconds: float, what: str) -> object:
    """Run ``fn`` in a daemon thread and wait at most ``seconds`` for it: exit-time work
    (a last file write, destroying process groups) must never turn an exit into a hang.
    Returns what ``fn`` returned, or None when it raised or did not finish in time."""
    import threading

    box: list[object] = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception as exc:
            log.debug("ddpmon: %s failed: %r", what, exc)

    worker = threading.Thread(target=run, name="ddpmon-bounded", daemon=True)
    try:
        worker.start()
    except RuntimeError:  # no new threads at interpreter shutdown (Python >= 3.12)
        run()
        return box[0] if box else None
    worker.join(seconds)
    if worker.is_alive():
        log.warning("ddpmon: %s did not finish within %.0f s; not waiting for it", what, seconds)
        return None
    return box[0] if box else None
