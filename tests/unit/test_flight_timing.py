"""Bucket timing from torch's flight recorder: entries shaped as torch 2.13 to 2.15 dump them
(NCCL's with ``duration_ms``, gloo's without any time but their creation) read into the
completion clock. Real gloo entries: tests/distributed/test_flight_recorder_timing.py; NCCL
itself: tests/gpu/test_cuda_timing.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from ddpmon.fuses import Fuse
from ddpmon.rank.timing import c10d as completion
from ddpmon.rank.timing.c10d import SELF_CHECK_STEPS, CompletionClock
from ddpmon.rank.timing.flight import FlightRecorderFeed, duration


@pytest.fixture(autouse=True)
def no_settle_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(completion, "SETTLE_MARGIN", 0.0)


def entry(
    record: int,
    seq: int,
    created: float,
    op: str = "nccl:all_reduce",
    group: str = "0",
    ms: float | None = None,
    state: str = "completed",
    **more: Any,
) -> dict[str, Any]:
    """One entry as ``_dump_fr_trace_json`` gives it (the fields ddpmon reads)."""
    e = {
        "record_id": record,
        "collective_seq_id": seq,
        "profiling_name": op,
        "process_group": [group, "default_pg"],
        "pg_id": 0,
        "is_p2p": False,
        "state": state,
        "retired": state == "completed",
        "time_created_ns": int(created * 1e9),
        "time_discovered_started_ns": 0,
        "time_discovered_completed_ns": 0,
    }
    if ms is not None:
        e["duration_ms"] = ms
    e.update(more)
    return e


def step(clock: CompletionClock, buckets: int) -> float:
    """One backward window; returns a moment inside it."""
    clock.backward_started(time.perf_counter() - 0.010)
    inside = time.time()
    time.sleep(0.002)
    clock.backward_done()
    clock.new_step(None, buckets)
    return inside


def fed() -> tuple[CompletionClock, FlightRecorderFeed]:
    clock = CompletionClock("cpu", False, Fuse("comm_hook"), source="flight_recorder")
    return clock, FlightRecorderFeed(clock, "0", "nccl", Fuse("flight"))


def test_nccl_entries_become_the_buckets_of_their_step() -> None:
    clock, feed = fed()
    t = step(clock, 3)
    first = [
        entry(10, 5, t, ms=1.0),
        entry(11, 6, t + 1e-4, op="nccl:broadcast", ms=0.5),
        entry(12, 7, t + 2e-4, group="1", ms=9.0),  # another group's
        entry(13, 8, t + 3e-4, ms=2.0),
        entry(14, 9, t + 4e-4, ms=None, state="started"),
    ]
    feed.read(first)
    assert clock.received == 2, "the all-reduce still running stops the read"
    t2 = step(clock, 3)
    feed.read(
        first[:4]
        + [entry(14, 9, t + 4e-4, ms=4.0)]
        + [entry(15 + i, 10 + i, t2 + i * 1e-4, ms=1.0) for i in range(3)]
    )
    assert clock.received == 6, "each record handed over once"
    resolved = clock.collect()
    assert [round(b.end - b.start, 6) for b in resolved[0].buckets] == [0.001, 0.002, 0.004]
    assert [b.index for b in resolved[0].buckets] == [0, 1, 2]
    assert all(0.009 < b.ready < 5 for b in resolved[0].buckets), "enqueued after the step began"
    assert clock.matched_steps >= 1 and clock.off_reason is None


def test_gloo_entries_have_no_duration_and_the_source_says_so() -> None:
    clock, feed = fed()
    for i in range(SELF_CHECK_STEPS):
        t = step(clock, 1)
        feed.read([entry(i, i + 1, t, op="gloo:all_reduce", state="scheduled", retired=True)])
    clock.collect()
    assert clock.received == 0 and clock.undated == SELF_CHECK_STEPS
    assert clock.off_reason == (
        f"torch's flight recorder recorded {SELF_CHECK_STEPS} all-reduce(s) of DDP's process group, none "
        "with its duration (this backend's recorder keeps when each was issued, not how long it ran)"
    )


def test_a_duration_where_the_recorder_has_one() -> None:
    assert duration(entry(0, 1, 0.0, ms=2.5)) == 0.0025
    seen = entry(
        0,
        1,
        0.0,
        time_discovered_started_ns=1_000_000_000,
        time_discovered_completed_ns=1_003_000_000,
    )
    assert duration(seen) == pytest.approx(0.003)
    assert duration(entry(0, 1, 0.0, op="gloo:all_reduce", state="scheduled")) is None
