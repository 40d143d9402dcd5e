"""A step's wall times come from its marks' counter readings and the wall clock's offset to
the counter, read at each fold. A reader preempted between its two clock reads (a loaded
machine) must not move the steps it folds: each step starts where the one before it ended."""

from __future__ import annotations

import time
import types

import pytest

from ddpmon.rank import recorder
from ddpmon.rank.recorder import Recorder
from ddpmon.state.schema import Identity


def test_a_fold_preempted_between_its_clock_reads_keeps_the_steps_end_to_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    preempted = False

    def wall() -> float:  # the wall clock, then 5 ms lost before the next read
        now = time.time()
        if preempted:
            time.sleep(0.005)
        return now

    clocks = types.SimpleNamespace(time=wall, perf_counter=time.perf_counter, sleep=time.sleep)
    monkeypatch.setattr(recorder, "time", clocks)
    rec = Recorder(Identity(rank=0), world_size=1)
    for step in range(6):
        t = time.perf_counter()
        rec.forward_started(t)
        rec.forward_finished(t + 0.001)
        rec.backward_started(t + 0.001)
        rec.backward_done(t + 0.002)
        rec.close_step(t + 0.003)
        preempted = step % 2 == 0  # every other fold is preempted
        rec.fold()
        preempted = False
        time.sleep(0.002)
    rows = rec.history_since(0)
    assert len(rows) == 6
    for a, b in zip(rows, rows[1:]):
        assert b.start_unix == pytest.approx(a.end_unix, abs=1e-4), (a, b)
