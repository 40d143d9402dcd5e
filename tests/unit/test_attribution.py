"""Where a straggler's time goes, piece by piece without processes: the gaps between hooks as
the recorder measures them, the stack sampler's suspicion and its samples, the doctor's
place and frame, and the user's Python functions' self time in a capture's trace. The real
job: tests/distributed/test_attribution.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from ddpmon import profiles, steps
from ddpmon.doctor import where, words
from ddpmon.fuses import Fuse
from ddpmon.rank import stack_samples
from ddpmon.rank.recorder import Recorder
from ddpmon.state import schema
from ddpmon.state.schema import Identity, Stage, StepParts
from tests.support import traces

pytestmark = pytest.mark.timeout(30)


def test_the_gaps_between_hooks_are_measured_where_they_lie() -> None:
    """nanoGPT's loop: forward, the next batch fetched, backward, a gradient clip, the
    optimizer step: 40 ms between forward and backward, 3 ms before the optimizer."""
    rec = Recorder(Identity(rank=0), world_size=2)
    t = time.perf_counter() - 1.0
    rec.forward_started(t)
    rec.forward_finished(t + 0.010)
    rec.backward_started(t + 0.050)
    rec.backward_done(t + 0.060)
    rec.gradients_synced()  # now: after the backward
    synced = rec._open.synced_at
    assert synced is not None
    rec.optimizer_started(synced + 0.003)
    rec.optimizer_finished(synced + 0.004)
    rec.close_step(synced + 0.004)
    rows = rec.history_since(0)
    assert rows[0].gaps == pytest.approx((0.040, 0.0, 0.003, 0.0))
    assert rows[0].other_seconds == pytest.approx(0.043)  # the gaps are what other is made of
    parts = steps.step_parts(rows)
    assert parts is not None
    assert parts.gaps == pytest.approx(
        {
            "after_forward": 0.040,
            "between_micro_steps": 0.0,
            "before_optimizer": 0.003,
            "after_optimizer": 0.0,
        }
    )


def test_micro_steps_and_a_manual_step_end_put_their_gaps_apart() -> None:
    rec = Recorder(Identity(rank=0), world_size=2)
    t = time.perf_counter() - 1.0
    rec.forward_started(t)
    rec.forward_finished(t + 0.01)
    rec.backward_started(t + 0.01)
    rec.backward_done(t + 0.02)
    rec.forward_started(t + 0.027)  # the next micro-step, 7 ms later
    rec.forward_finished(t + 0.03)
    rec.backward_started(t + 0.03)
    rec.backward_done(t + 0.04)
    rec.gradients_synced()
    synced = rec._open.synced_at
    assert synced is not None
    rec.optimizer_started(synced)
    rec.optimizer_finished(synced + 0.001)
    rec.close_step(synced + 0.006)  # Monitor.step() 5 ms after the optimizer step
    (row,) = rec.history_since(0)
    assert row.gaps == pytest.approx((0.0, 0.007, 0.0, 0.005))


def state(
    rank: int, gaps: dict[str, float], by_stage: dict[str, dict[str, int]] | None = None
) -> Any:
    samples = schema.StackSamples(count=100, by_stage=by_stage) if by_stage is not None else None
    return SimpleNamespace(
        rank=rank,
        state=schema.RankState(
            rank=rank,
            timings=schema.Timings(parts=StepParts(steps=20, gaps=gaps)),
            stack_samples=samples,
        ),
    )


def slow_in_other(rank: int = 1, other: float = 0.040) -> steps.Score:
    return steps.Score(
        rank,
        1.5,
        0.070,
        0.030,
        0.001,
        steps=20,
        shares={p: (1.0 if p == "other" else 0.0) for p in steps.BUSY_PARTS},
        excess={p: (other if p == "other" else 0.0) for p in steps.BUSY_PARTS},
    )


FETCH = {
    "after_forward": {
        "train.py:120 in get_batch": 50,
        "train.py:121 in get_batch": 40,
        "train.py:88 in main": 5,
    },
    "forward": {"model.py:30 in forward": 200},
}


def test_the_doctor_names_the_gap_and_the_users_function_sampled_there() -> None:
    views = [
        state(0, {"after_forward": 0.001, "before_optimizer": 0.002}),
        state(1, {"after_forward": 0.041, "before_optimizer": 0.002}, FETCH),
        state(2, {"after_forward": 0.002, "before_optimizer": 0.002}),
    ]
    found = where.place(slow_in_other(), views)
    assert found is not None
    assert (found.part, found.gap, found.frame, found.samples) == (
        "other",
        "after_forward",
        "train.py:120 in get_batch",  # the function's lines count together; its hottest line
        95,
    )
    assert found.excess_seconds == pytest.approx(0.0395)  # over the median of 1 and 2 ms
    assert found.line(1) == (
        "rank 1: +39.5 ms/step between forward and backward, 95% of 95 stack samples there in "
        "train.py:120 in get_batch"
    )
    text = words.straggler_summary(1, 1.5, "other", 1.0, found.gap, found.frame)
    assert text == (
        "rank 1 is 150% slower than the others, 100% of it between forward and backward: look at "
        "train.py:120 in get_batch, where most of its stack samples there were"
    )
    assert words.straggler_summary(1, 1.5, "other", 1.0, "after_forward") == (
        "rank 1 is 150% slower than the others, 100% of it between forward and backward: look at "
        "the code that rank runs between forward and backward"
    )


def test_without_a_gap_that_explains_it_or_enough_samples_nothing_is_guessed() -> None:
    even = [state(r, {"after_forward": 0.002}) for r in range(3)]
    found = where.place(slow_in_other(), even)
    assert found is not None and (found.gap, found.frame) == (None, None)
    assert found.label == "in other work"
    few = {"after_forward": {"train.py:120 in get_batch": where.MIN_SAMPLES - 1}}
    assert where.hottest(few, ("after_forward",)) == (None, 0.0, where.MIN_SAMPLES - 1)
    text = words.straggler_summary(1, 1.5, "other", 1.0)
    assert "logging" not in text and ".item()" not in text and "between backward" not in text


def test_a_rank_suspects_itself_only_when_it_is_the_slowest_of_its_peers() -> None:
    def rank_state(rank: int, busy: float) -> schema.RankState:
        parts = StepParts(steps=20, busy_seconds=busy)
        return schema.RankState(rank=rank, timings=schema.Timings(parts=parts))

    slow = [rank_state(0, 0.010), rank_state(1, 0.030), rank_state(2, 0.011)]
    assert stack_samples.suspected(slow, 1)
    assert not stack_samples.suspected(slow, 2) and not stack_samples.suspected(slow, 0)
    even = [rank_state(0, 0.010), rank_state(1, 0.0102)]
    assert not stack_samples.suspected(even, 0) and not stack_samples.suspected(even, 1)
    assert not stack_samples.suspected([rank_state(1, 0.030)], 1)  # no peer read

    # A window starts once the rank is found slowest in readings in a row, not on one.
    rec = Recorder(Identity(rank=1), world_size=3)
    sampler = stack_samples.StackSampler(rec, Fuse("stack_samples", lambda *a: None))
    started: list[bool] = []
    sampler.start = lambda: started.append(True)  # type: ignore[method-assign]
    for states in (slow, even, slow, even, slow):
        sampler.peers_seen(states)
    assert started == []
    sampler.peers_seen(slow)
    assert started == [True]


def fetch_batch(seconds: float) -> None:
    time.sleep(seconds)


def test_the_sampler_counts_the_users_frame_by_stage_and_runs_only_when_suspected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stack_samples, "WINDOW_SECONDS", 0.4)
    rec = Recorder(Identity(rank=1), world_size=2)
    sampler = stack_samples.StackSampler(rec, Fuse("stack_samples", lambda *a: None))
    calm = [schema.RankState(rank=0), schema.RankState(rank=1)]
    sampler.peers_seen(calm)  # no step parts: not suspected, no thread
    assert not any(t.name == "ddpmon-stack-samples" for t in threading.enumerate())
    assert rec.stack_samples is None
    rec.stage = Stage.AFTER_FORWARD
    sampler.start()
    fetch_batch(0.6)
    sampler.stop()
    got = rec.stack_samples
    assert got is not None and got.count >= 10, got
    (frame,) = got.by_stage["after_forward"]
    assert frame.startswith("tests/unit/test_attribution.py:") and frame.endswith(" in fetch_batch")
    sampler.peers_seen(calm)  # stopped: never again


def test_a_python_functions_self_time_leaves_out_the_users_callees_and_collectives() -> None:
    def rank(fetch_us: float) -> profiles.Profile:
        events = [*traces.steps(2, 0, 10000), traces.frame("train.py(12): main", -50, 30000)]
        for s in range(2):
            t = s * 10000
            events += [
                traces.frame("train.py(40): get_batch", t + 10, 600 + fetch_us),
                traces.frame("<built-in function sleep>", t + 20, fetch_us),  # its own
                traces.frame("data.py(5): decode", t + 30 + fetch_us, 500),  # a function of yours
                traces.op("c10d::allreduce_", t + 6000, 3000),  # waiting for the others
            ]
        return profiles.parse(traces.trace(events))

    slow, healthy = rank(4000), rank(0)
    assert slow.function_ms_per_step("get_batch (train.py:40)") == pytest.approx(4.1)
    assert slow.function_ms_per_step("decode (data.py:5)") == pytest.approx(0.5)
    # main: 30 ms of the two steps' 20 less get_batch's, the collectives' (6 ms) ...
    assert slow.function_ms_per_step("main (train.py)") == pytest.approx(
        (30000 - 2 * 4600 - 6000) / 2 / 1000
    )
    first = profiles.compare_functions(slow, healthy)[0]
    assert (first.name, first.device, first.site) == ("get_batch", "python", "train.py:40")
    lines = profiles.summary(1, slow, 0, healthy)
    assert lines[1].startswith("your Python functions where rank 1 spends more than rank 0")
    assert lines[2] == "  rank 1: +4.0 ms/step in get_batch at train.py:40 (4.1 vs 0.10 on rank 0)"
    assert profiles.as_json(slow, healthy)[0]["name"] == "get_batch"
