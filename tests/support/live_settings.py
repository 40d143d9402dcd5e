"""What the tests of ``ddpmon set`` share: waiting for a rank, its watchdog's hang timeout,
and a request bound to a rank's process as the command writes it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

from ddpmon.state import settings
from tests.support import harness


def wait_until(what: str, check: Callable[[], object], timeout: float = 15.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def watchdog_timeout(workdir: Path, rank: int) -> float | None:
    """The hang timeout the rank's watchdog used in its last pass (its state file)."""
    state = harness.states(workdir).get(rank) or {}
    return ((state.get("activity") or {}) or {}).get("hang_timeout_seconds")


def request(workdir: Path, rank: int, **changes: str) -> settings.Request:
    """A request bound to the rank's process, as the command writes it."""
    state = harness.states(workdir)[rank]
    now = time.time()
    return settings.Request(
        nonce=uuid.uuid4().hex[:16],
        rank=rank,
        job=state["job"],
        pid=state["pid"],
        started_unix=state["started_unix"],
        changes=changes,
        requested_unix=now,
        expires_unix=now + 20,
    )
