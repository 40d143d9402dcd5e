"""An optimizer step that runs its closure (Lightning's automatic optimization, LBFGS):
forward and backward happen inside ``optimizer.step``. Its parts must still be where the time
went: Lightning's demo model with rank 1's optimizer 30 ms slower before its closure was
answered "98% of it in data wait: look at its data loader", and the optimizer's time held
the forward and backward as well."""

from __future__ import annotations

import pytest

from ddpmon.rank.recorder import Recorder
from ddpmon.state.schema import Identity
from ddpmon.steps import StepRow


def steps(rec: Recorder) -> list[StepRow]:
    return rec.history_since(0)


def test_an_optimizer_step_around_its_closure_keeps_each_part_in_its_place() -> None:
    rec = Recorder(Identity(rank=0), world_size=1)
    for t in (0.0, 10.0, 20.0):  # each step: starts at t, the next one at t + 10
        rec.optimizer_started(t + 1.0)  # 1 s of data wait before optimizer.step(closure)
        rec.forward_started(t + 1.3)  # 0.3 s in the optimizer before its closure
        rec.forward_finished(t + 2.3)
        rec.backward_started(t + 2.5)
        rec.backward_done(t + 4.5)
        rec.optimizer_finished(t + 5.0)  # 0.5 s of the optimizer's own after the closure
        rec.close_step(t + 10.0)
    last = steps(rec)[-1]
    assert last.data_wait_seconds == pytest.approx(1.0)
    assert last.forward_seconds == pytest.approx(1.0)
    assert last.backward_seconds == pytest.approx(2.0)
    assert last.optimizer_seconds == pytest.approx(0.3 + 0.5)


def test_a_plain_optimizer_step_is_unchanged() -> None:
    rec = Recorder(Identity(rank=0), world_size=1)
    for t in (0.0, 10.0):
        rec.forward_started(t + 1.0)
        rec.forward_finished(t + 2.0)
        rec.backward_started(t + 2.0)
        rec.backward_done(t + 4.0)
        rec.optimizer_started(t + 4.5)
        rec.optimizer_finished(t + 5.0)
        rec.close_step(t + 10.0)
    last = steps(rec)[-1]
    assert (last.data_wait_seconds, last.optimizer_seconds) == pytest.approx((1.0, 0.5))
