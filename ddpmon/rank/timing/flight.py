"""Bucket timing from torch's flight recorder: the timings c10d's completion hook hands over,
read back from the recorder instead (torch 2.6 deprecated that hook in its favour).

A thread of ddpmon's dumps the recorder every ``POLL_SECONDS`` and hands each all-reduce of
DDP's process group it has not seen yet, once it has a duration, to the clock the completion
hook feeds (``c10d.CompletionClock``): matched to DDP's buckets by order at step
boundaries, with the same self-check. Nothing runs on DDP's path to the all-reduce.

On NCCL the recorder keeps each collective's GPU time (``duration_ms``) once the group times
its collectives, which this source turns on. gloo's recorder (torch 2.13 to 2.15) keeps when
each collective was issued and never how long it ran, so there the self-check turns the
source off after its first steps and says why.
"""

from __future__ import annotations

import threading
from typing import Any

from ...fuses import Fuse
from .. import torch_api
from .c10d import CompletionClock

POLL_SECONDS = 5.0
"""A dump serialises the whole ring buffer holding the GIL: 20 ms for torch's default 2,000
entries on a CPU core of the test machine, 1.3 ms for 200 (docs/performance.md)."""
MAX_WINDOWS = 2048
"""Steps that wait for the next dump: every step of ``POLL_SECONDS`` down to 2.5 ms a step."""
PART = "bucket timing from the flight recorder"


class FlightRecorderFeed:
    """Reads the flight recorder into ``clock`` on a thread of its own, from ``start`` until
    ``close``."""

    def __init__(
        self, clock: CompletionClock, group_name: str | None, backend: str | None, fuse: Fuse
    ) -> None:
        self._clock, self._group, self._backend, self._fuse = clock, group_name, backend, fuse
        self._next_record = 0
        """Records below this id were handed over, or never will be."""
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(
            target=self._run, name="ddpmon-flight-recorder-timing", daemon=True
        ).start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while (
            not self._stop.wait(POLL_SECONDS) and self._fuse.ok and self._clock.off_reason is None
        ):
            try:
                dump = torch_api.flight_recorder_dump(self._backend, PART)
            except torch_api.Missing as missing:
                self._clock.off_reason = str(missing)
                return
            except Exception as exc:
                self._fuse.blow(exc)
                return
            self.read(dump.get("entries") or [])

    def read(self, entries: list[dict[str, Any]]) -> None:
        """Hand the new, finished all-reduces of DDP's group among ``entries`` to the clock;
        stop at the first one still running (read again at the next poll)."""
        clock = self._clock
        for e in sorted((e for e in entries if isinstance(e, dict)), key=_record_id):
            record = _record_id(e)
            if record < self._next_record:
                continue
            if e.get("is_p2p") or (
                self._group is not None and _group_name(e) not in (None, self._group)
            ):
                self._next_record = record + 1
                continue
            if not str(e.get("profiling_name", "")).endswith("all_reduce"):
                clock.reports += 1
                self._next_record = record + 1
                continue
            seconds = duration(e)
            if seconds is None and not finished(e):
                break
            clock.reports += 1
            if seconds is None:
                clock.undated += 1
            else:
                clock.add(
                    int(e.get("collective_seq_id") or 0),
                    float(e.get("time_created_ns") or 0) / 1e9,
                    seconds,
                )
            self._next_record = record + 1


def duration(e: dict[str, Any]) -> float | None:
    """Seconds the collective ran: the recorder's ``duration_ms`` (NCCL with collective timing
    on), else between when its start and its completion were seen; None when not known."""
    ms = e.get("duration_ms")
    if isinstance(ms, (int, float)) and ms >= 0:
        return float(ms) / 1000.0
    started, completed = (
        e.get("time_discovered_started_ns") or 0,
        e.get("time_discovered_completed_ns") or 0,
    )
    if started and completed and completed >= started:
        return (completed - started) / 1e9
    return None


def finished(e: dict[str, Any]) -> bool:
    """The collective is over: completed, or its work retired (gloo never says completed)."""
    return e.get("state") == "completed" or bool(e.get("retired"))


def _record_id(e: dict[str, Any]) -> int:
    try:
        return int(e.get("record_id", -1))
    except (TypeError, ValueError):
        return -1


def _group_name(e: dict[str, Any]) -> str | None:
    group = e.get("process_group")
    return str(group[0]) if isinstance(group, (list, tuple)) and group else None
