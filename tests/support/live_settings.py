"""What the tests of ``ddpmon set`` share: waiting for a rank, its watchdog's hang timeout,
and a request bound to a rank's process as the command writes it."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ddpmon.state import settings
from tests.support import harness
from tests.support.harness import wait_until


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


@contextlib.contextmanager
def training(
    workdir: Path, env: dict[str, str] | None = None, timeout: float = 30
) -> Iterator[None]:
    """A 2-rank job of tests/distributed/capture_worker.py (it trains until told to stop) in
    ``workdir``, once both ranks train and their watchdogs have run; ended on leaving."""
    procs = harness.start_ranks(
        "-1", 2, workdir, env=env, module="tests.distributed.capture_worker"
    )
    try:
        wait_until(
            "both ranks to train",
            lambda: all(
                harness.states(workdir).get(r, {}).get("step", 0) >= 5
                and watchdog_timeout(workdir, r) is not None
                for r in (0, 1)
            ),
            timeout=timeout,
        )
        yield
    finally:
        harness.finish(procs, workdir)
