"""Goodput's arithmetic (ddpmon/goodput.py) and compare's note on batch and learning rate
(report/compare.scaling), on hand-made attempts and training facts."""

from __future__ import annotations

import time

import pytest

from ddpmon import goodput
from ddpmon.goodput import Attempt
from ddpmon.report.compare import scaling
from ddpmon.state.schema import Optimizer


def test_a_hung_attempt_and_its_restart_add_up_to_the_wall_time() -> None:
    first = Attempt(
        0, 0, "a", process_start=100.0, first_step=110.0, last_step_end=130.0, end=140.0,
        paused=4.0, hang=(3.0, 5.0),
    )  # fmt: skip
    second = Attempt(
        1, 0, "a", process_start=141.5, first_step=150.0, last_step_end=200.0, end=201.0,
        paused=6.0,
    )  # fmt: skip
    g = goodput.goodput([first, second])
    assert g is not None
    assert g["lost_seconds"] == {
        "startup": 10.0 + 8.5,
        "pauses": 4.0 + 6.0,
        "hang_until_detected": 3.0,
        "hang_until_ended": 5.0,
        "after_last_step": 2.0 + 1.0,
        "restarts": 1.5,
    }
    assert g["productive_seconds"] == pytest.approx(16.0 + 44.0)
    assert g["wall_seconds"] == pytest.approx(201.0 - 100.0)
    assert g["ratio"] == pytest.approx(60.0 / 101.0)
    assert g["attempts"] == 2 and g["notes"] == []
    assert goodput.text(g).startswith("goodput 59% (60.0 s of 101.0 s in steps over 2 attempts)")


def test_a_hang_longer_than_the_tail_is_cut_to_it_and_hosts_that_differ_are_said() -> None:
    """A hang reported on another clock never makes the parts exceed the wall time."""
    a = Attempt(0, 0, "a", 0.0, 5.0, 15.0, 20.0, 0.0, hang=(4.0, 30.0))
    b = Attempt(1, 0, "b", 21.0, None, None, 25.0, 0.0)  # never stepped: all start-up
    g = goodput.goodput([a, b])
    assert g is not None
    lost = g["lost_seconds"]
    assert (lost["hang_until_detected"], lost["hang_until_ended"]) == (4.0, 1.0)
    assert lost["after_last_step"] == 0.0 and lost["startup"] == 5.0 + 4.0
    assert g["productive_seconds"] + sum(lost.values()) == pytest.approx(25.0)
    assert g["notes"] == [
        "attempt 0 ended on a and attempt 1 started on b: the restart between them is read "
        "on two clocks"
    ]


def test_an_attempt_without_history_is_read_from_its_state_file(tmp_path) -> None:
    """DDPMON_HISTORY=0: the steps run from the rank's attach to its last progress."""
    from ddpmon.state import files, schema

    state = schema.RankState(
        rank=0, host="h", job="j", process_started_unix=10.0, started_unix=14.0, step=50,
        last_progress_unix=40.0, now_unix=41.0, paused_seconds=2.0,
    )  # fmt: skip
    files.write_atomic(files.path_for(str(tmp_path), 0), schema.to_json(state))
    (found,) = goodput.attempts_of([str(tmp_path)], job="j")
    assert (found.process_start, found.first_step, found.last_step_end, found.end) == (
        10.0, 14.0, 40.0, 41.0,
    )  # fmt: skip
    g = goodput.goodput([found])
    assert g is not None and g["productive_seconds"] == 24.0 and g["wall_seconds"] == 31.0
    assert g["notes"] == [
        "attempt 0 has no step history (DDPMON_HISTORY=0?): its steps are counted from its "
        "attach to its last progress"
    ]
    assert goodput.attempts_of([str(tmp_path)], job="other") == []


def test_no_attempt_no_goodput() -> None:
    assert goodput.goodput([]) is None and goodput.text(None) is None


def training(world: int, lr: float, name: str = "SGD", peak_step: int = 1) -> dict:
    return {
        "batch_size": 8,
        "micro_batches": 1,
        "global_batch_size": 8 * world,
        "world_size": world,
        "optimizer": {"name": name, "peak_learning_rate": lr, "peak_step": peak_step},
    }


def test_the_learning_rate_that_followed_the_linear_rule_and_its_warm_up() -> None:
    note = scaling(training(1, 0.1), training(8, 0.8, peak_step=101))
    assert note == [
        "global batch differs: B takes 64 samples per optimizer step, A 8 (x8.00; 8 x 1 "
        "micro-batch x 8 ranks against 8 x 1 micro-batch x 1 rank)",
        "  peak learning rate 0.8 in B against 0.1 in A (x8.00): it followed the linear scaling "
        "rule for SGD (x8.00)",
        "  B reached that rate at step 101, after a warm-up of 100 steps",
    ]
    no_warmup = scaling(training(1, 0.1), training(8, 0.8))
    assert "no warm-up" in no_warmup[-1]


def test_the_learning_rate_that_did_not_follow_and_the_square_root_rule() -> None:
    kept = scaling(training(1, 0.1), training(2, 0.1))
    assert kept[1] == (
        "  peak learning rate 0.1 in B against 0.1 in A (x1.00): the linear scaling rule for "
        "SGD gives x2.00 (0.2); B's did not follow it"
    )
    adam = scaling(training(1, 1e-3, "AdamW"), training(4, 2e-3, "AdamW"))
    assert "it followed the square-root scaling rule for AdamW (x2.00)" in adam[1]
    linear_adam = scaling(training(1, 1e-3, "AdamW"), training(4, 4e-3, "AdamW"))
    assert "B's did not follow it (it follows the linear rule)" in linear_adam[1]


def test_nothing_to_say_or_no_rule_to_apply() -> None:
    assert scaling(training(2, 0.1), training(2, 0.2)) == []  # the same batch
    assert scaling({}, training(2, 0.1)) == []  # an older run: no batch recorded
    other = scaling(training(1, 0.1), training(2, 1e-3, "AdamW"))
    assert "the optimizers differ (SGD against AdamW)" in other[1]
    unknown = scaling(training(1, 0.1, "Lion"), training(4, 0.2, "Lion"))
    assert "Lion has no usual rule here: the linear rule gives x4.00" in unknown[1]


def test_a_rank_counts_its_pauses_between_steps_and_its_learning_rate() -> None:
    """An evaluation's forwards without grad start a pause that the next training forward
    ends; a silence the watchdog saw between steps starts one too; evaluation before the
    first step is not a pause."""
    from ddpmon.rank.recorder import Recorder
    from ddpmon.state.schema import Identity

    rec = Recorder(Identity(rank=0), world_size=1)

    def step(t: float) -> None:
        rec.forward_started(t)
        rec.forward_finished(t + 0.1)
        rec.optimizer_started(t + 0.2)
        rec.optimizer_finished(t + 0.3)
        rec.learning_rate_seen("SGD", 0.1 * rec.steps + 0.1)  # warming up
        rec.close_step(t + 0.3)

    rec.evaluating(0.0)
    step(1.0)
    rec.evaluating(2.0)  # evaluation: 2.0 to the next forward at 5.0
    rec.evaluating(4.0)
    step(5.0)
    step(6.0)
    rec.fold()  # (what the hooks marked: a reader folds it in)
    assert rec.paused_seconds == pytest.approx(3.0)
    rec.pause_seen = (rec.steps, time.time() - 2.0)  # the watchdog: silent for 2 s
    step(time.perf_counter())  # the next forward, now: the pause began 2 s before it
    rec.fold()
    assert rec.paused_seconds == pytest.approx(3.0 + 2.0, abs=0.05)
    rec.learning_rate_seen("SGD", 0.2)  # decaying
    state = rec.state()
    assert state.paused_seconds == pytest.approx(5.0, abs=0.05)
    assert state.optimizer == Optimizer("SGD", 0.2, pytest.approx(0.4), 4)
