"""A process's clock against a reference process's, measured through a c10d store.

Times written on different hosts compare only on one clock. The reference (rank 0 of a job,
node 0 of ``ddpmon preflight``) answers each ask with its own time; the asker brackets the
answer between its send and its receipt, and of a few round trips trusts the one with the
least delay: the offset is its midpoint minus the answer, true within half that delay
(NTP's reasoning). Used by every rank at start (``rank/clock.py``) and by preflight's nodes.

Only quick, non-blocking store calls are made (``set``, ``get`` of a key known to exist,
``check``, ``add``): a blocking ``wait`` would hold the store client that the job's own
threads share. Askers queue (``add`` a counter), so the reference polls one key, and each
asker is answered in turn: ``TRIPS`` round trips of a millisecond or two each. An asker far
back in the queue checks the reference's progress about when its turn may come (the askers
ahead of it times ``TURN_SECONDS``), one near its turn every ``NEAR_POLL_SECONDS``, so the
store's load grows with the log of the askers, and the reference never waits on a slow one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

TRIPS = 5
"""Round trips per asker; the one with the least delay gives the offset."""
POLL_SECONDS = 0.0005
POLL_MAX_SECONDS = 0.1
FAR_POLL_MAX_SECONDS = 5.0
"""The longest pause between two checks of an asker far back in the queue."""
TURN_SECONDS = 0.01
"""About what answering one asker takes the reference (``TRIPS`` round trips)."""
NEAR_POLL_SECONDS = 0.002
"""How often an asker checks once its turn is near, and for its answers."""
WINDOW = 8
"""Askers this near their turn check often, so that the reference never waits on them."""
TRIP_TIMEOUT_SECONDS = 2.0
"""The reference gives an asker that long for each round trip before moving on."""


class Store(Protocol):
    """What of a c10d store (``torch.distributed.Store``) is used."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def add(self, key: str, value: int) -> int: ...


@dataclass(frozen=True)
class Measured:
    """This clock minus the reference's, from the round trip with the least delay."""

    offset_seconds: float
    delay_seconds: float


def measure(
    store: Store,
    who: int,
    deadline: float,
    clock: Any = time.time,
    stop: threading.Event | None = None,
) -> Measured | None:
    """Ask the reference (``serve``) for its time ``TRIPS`` times; None when it does not
    answer by ``deadline`` (``time.monotonic``) or ``stop`` is set first."""
    turn = store.add("queue", 1)
    store.set(f"queue/{turn}", str(who))
    if not _wait_turn(store, turn, deadline, stop):
        return None
    best: Measured | None = None
    for trip in range(TRIPS):
        answer = f"{who}/{trip}/answer"
        sent = clock()
        store.set(f"{who}/{trip}/ask", "1")
        limit = min(deadline, time.monotonic() + TRIP_TIMEOUT_SECONDS + 1.0)
        if not _poll(store, answer, limit, stop, NEAR_POLL_SECONDS):
            return best  # the reference moved on (this process was too slow to ask)
        theirs = float(store.get(answer))
        back = clock()
        delay = back - sent
        if best is None or delay < best.delay_seconds:
            best = Measured((sent + back) / 2 - theirs, delay)
    return best


def serve(
    store: Store,
    askers: int,
    deadline: float,
    clock: Any = time.time,
    stop: threading.Event | None = None,
) -> int:
    """Answer ``askers`` in the order they queue, until ``deadline`` (``time.monotonic``) or
    ``stop``; the number answered."""
    served = 0
    for turn in range(1, askers + 1):
        if not _poll(store, f"queue/{turn}", deadline, stop):
            break
        who = store.get(f"queue/{turn}").decode()
        for trip in range(TRIPS):
            limit = min(deadline, time.monotonic() + TRIP_TIMEOUT_SECONDS)
            if not _poll(store, f"{who}/{trip}/ask", limit, stop, POLL_SECONDS):
                break
            store.set(f"{who}/{trip}/answer", repr(clock()))
        else:
            served += 1
        store.set("served", str(turn))
    return served


def _wait_turn(store: Store, turn: int, deadline: float, stop: threading.Event | None) -> bool:
    """Wait until the reference has done with the askers queued before ``turn``: checked
    about when the askers ahead will have been answered (``TURN_SECONDS`` each, at most
    ``FAR_POLL_MAX_SECONDS`` apart), often once ``WINDOW`` away. The k-th asker from the front
    checks 1/(k x TURN_SECONDS) times a second, so the whole queue costs the store about
    ln(askers)/TURN_SECONDS requests a second (about 1,000 for 10,000 askers), not one
    request per asker every few milliseconds."""
    while True:
        done = int(store.get("served")) if store.check(["served"]) else 0
        if done >= turn - 1:
            return True
        ahead = turn - 1 - done
        pause = (
            NEAR_POLL_SECONDS if ahead < WINDOW else min(FAR_POLL_MAX_SECONDS, ahead * TURN_SECONDS)
        )
        if time.monotonic() >= deadline or _pause(pause, stop):
            return False


def _poll(
    store: Store,
    key: str,
    deadline: float,
    stop: threading.Event | None,
    most: float = POLL_MAX_SECONDS,
) -> bool:
    """Whether ``key`` exists by ``deadline`` (and before ``stop``): checked at once, then
    after growing pauses."""
    pause = POLL_SECONDS
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return False
        if _pause(pause, stop):
            return False
        pause = min(most, pause * 2)
    return True


def _pause(seconds: float, stop: threading.Event | None) -> bool:
    """Sleep; whether ``stop`` was set meanwhile."""
    if stop is None:
        time.sleep(seconds)
        return False
    return stop.wait(seconds)
