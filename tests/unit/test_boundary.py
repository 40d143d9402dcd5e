"""The step boundary (ddpmon/rank/boundary.py) on a real Recorder: one owner of a step's
end for the hooks, Monitor.step() and detach, and what it tells the other parts."""

from __future__ import annotations

import time
from typing import Any

from ddpmon.fuses import Fuse
from ddpmon.rank.boundary import StepBoundary
from ddpmon.rank.recorder import Recorder
from ddpmon.state.schema import Identity


class Part:
    """Stands for the unused-parameter watch and the advice checks: what they are told."""

    any_ready = False

    def __init__(self) -> None:
        self.told: list[Any] = []

    def step_ended(self, steps: int | None = None) -> None:
        self.told.append(steps)


def boundary() -> tuple[StepBoundary, Recorder, Part, Part, list[str]]:
    rec = Recorder(Identity(rank=0), world_size=2)
    notes: list[str] = []
    b = StepBoundary(rec, Fuse("step_hooks"), lambda: notes.append("notify"))
    unused, advice = Part(), Part()
    b.unused, b.advice = unused, advice
    return b, rec, unused, advice, notes


def a_synced_step(rec: Recorder) -> None:
    t = time.perf_counter()
    rec.forward_started(t)
    rec.forward_finished(t + 0.001)
    rec.backward_started(t + 0.001)
    rec.backward_done(t + 0.002)
    rec.gradients_synced()


def test_an_end_closes_the_step_and_tells_every_part_in_order() -> None:
    b, rec, unused, advice, notes = boundary()
    a_synced_step(rec)
    b.end(time.perf_counter())
    assert rec.steps == 1 and notes == ["notify"]  # the first step is news
    assert unused.told == [None] and advice.told == [1]
    a_synced_step(rec)
    b.end(time.perf_counter())
    assert rec.steps == 2 and notes == ["notify"] and advice.told == [1, 2]


def test_the_first_manual_step_right_after_an_optimizer_step_is_the_same_boundary() -> None:
    b, rec, _, advice, _ = boundary()
    a_synced_step(rec)
    b.end(time.perf_counter())  # the optimizer step ended it
    b.step_called()  # the loop's own call at the same place: not a second step
    assert (rec.steps, b.manual, advice.told) == (1, True, [1])
    a_synced_step(rec)
    b.step_called()
    assert rec.steps == 2


def test_detach_counts_a_synchronised_step_and_a_blown_fuse_counts_nothing() -> None:
    b, rec, _, _, _ = boundary()
    a_synced_step(rec)
    b.detach()
    assert rec.steps == 1
    b, rec, _, _, _ = boundary()
    rec.forward_started(time.perf_counter())  # a forward without a backward: no step
    b.detach()
    assert rec.steps == 0
    b, rec, _, _, _ = boundary()
    a_synced_step(rec)
    b._fuse.blow(RuntimeError("a hook failed"))
    b.step_called()
    b.detach()
    assert rec.steps == 0


def test_a_backward_is_seen_from_the_gradients_or_the_recorder() -> None:
    b, rec, unused, _, _ = boundary()
    assert not b.backward_seen()
    unused.any_ready = True
    assert b.backward_seen()
    unused.any_ready = False
    rec.backward_started(time.perf_counter())
    assert b.backward_seen()
