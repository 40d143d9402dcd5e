"""The c10d clock against whole sequences as a job produces them: backward windows, the
all-reduces c10d reports (WorkInfo-shaped, as in test_completion.py) and the collectives
around them. Each case says exactly which steps are matched to DDP's buckets and which are
left untimed; then the self-check that turns a source off when nothing ever matches."""

from __future__ import annotations

import logging
import time

import pytest

from ddpmon.fuses import Fuse
from ddpmon.rank.recorder import StepTimings
from ddpmon.rank.timing import c10d as completion
from ddpmon.rank.timing.c10d import CompletionClock
from tests.support.c10d import info

GAP = 0.0005  # seconds between two moments of the sequence


@pytest.fixture(autouse=True)
def no_settle_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step settles once a later completion is in (the last one of a sequence waits)."""
    monkeypatch.setattr(completion, "SETTLE_MARGIN", 0.0)


class Job:
    """Drives clocks as the step hooks and c10d's completion hook do. Every clock listens
    to the one process group (two DDP models on one group hear each other's collectives);
    a collective is enqueued at the moment it is named, its WorkInfo arrives at the step's
    end, as c10d's watchdog thread reports it a little after it completes."""

    def __init__(self, *clocks: CompletionClock) -> None:
        self.clocks = clocks
        self.seq = 0
        self.reported: list[object] = []
        self.steps = 0

    def collectives(self, *ops_ms: tuple[str, float]) -> None:
        for op, ms in ops_ms:
            time.sleep(GAP)
            self.seq += 1
            self.reported.append(info(op, self.seq, time.time(), ms))
        time.sleep(GAP)

    def backward(self, clock: CompletionClock, *ops_ms: tuple[str, float]) -> None:
        """One backward of ``clock``'s model that enqueues ``ops_ms`` (nothing: no_sync)."""
        clock.backward_started(time.perf_counter() - 0.010)
        self.collectives(*ops_ms)
        clock.backward_done()
        clock.sync_done()
        time.sleep(GAP)

    def end_step(self, clock: CompletionClock, buckets: int, generation: int = 0) -> None:
        self.steps += 1
        clock.new_step(self.steps, buckets, generation)

    def report(self) -> None:
        for record in self.reported:
            for clock in self.clocks:
                clock.on_completion(record)
        self.reported.clear()

    def collect(self, clock: CompletionClock) -> list[StepTimings]:
        self.report()
        time.sleep(GAP)
        return clock.collect()


def allreduces(*ms: float) -> list[tuple[str, float]]:
    return [("ALLREDUCE", m) for m in ms]


def durations(step: StepTimings) -> list[tuple[int, float]]:
    return [(t.index, round(t.end - t.start, 6)) for t in step.buckets]


def fresh(find_unused: bool = False) -> CompletionClock:
    return CompletionClock("cpu", find_unused, Fuse("bucket_timing"))


# -- sequences ------------------------------------------------------------------------------


def test_ddp_rebuilds_its_buckets_after_iteration_0() -> None:
    """Iteration 0 runs DDP's first layout (3 buckets in parameter order); DDP rebuilds it
    (to 3 buckets of other sizes, in gradient order) for iteration 1, and its logging data
    shows the new layout a step late. Iteration 0, whose count is the new layout's too, is
    not taken for it: the first step under an older layout is dropped; iteration 1 (old
    layout known at its end, new one ran) is matched with the new one."""
    clock = fresh()
    job = Job(clock)
    job.backward(clock, *allreduces(1.0, 2.0, 3.0))  # iteration 0, first layout
    job.end_step(clock, 3, generation=1)
    job.backward(clock, *allreduces(4.0, 5.0, 6.0))  # iteration 1, rebuilt, not shown yet
    job.end_step(clock, 3, generation=1)
    job.report()  # both settle only once the rebuilt layout is known
    job.backward(clock, *allreduces(7.0, 8.0, 9.0))
    job.end_step(clock, 3, generation=2)
    steps = job.collect(clock)
    assert [durations(s) for s in steps] == [[(0, 0.004), (1, 0.005), (2, 0.006)]]
    assert [s.step for s in steps] == [2]
    assert clock.unmatched_steps == 0, "a dropped layout is not a mismatch"
    job.backward(clock, *allreduces(1.0, 1.0, 1.0))
    job.end_step(clock, 3, generation=2)
    assert [durations(s) for s in job.collect(clock)] == [[(0, 0.007), (1, 0.008), (2, 0.009)]]


def test_iteration_0_is_kept_when_it_settles_before_the_rebuild_shows() -> None:
    clock = fresh()
    job = Job(clock)
    job.backward(clock, *allreduces(1.0, 2.0))
    job.end_step(clock, 2, generation=1)
    job.backward(clock, *allreduces(3.0, 4.0))
    job.end_step(clock, 2, generation=1)
    steps = job.collect(clock)
    assert [durations(s) for s in steps] == [[(0, 0.001), (1, 0.002)]], (
        "iteration 0, its own layout"
    )


def test_a_users_collectives_outside_backward_are_ignored() -> None:
    """A loss all-reduce after backward, a broadcast in forward, a metric all-reduce between
    steps: none is in a backward window, every step is matched."""
    clock = fresh()
    job = Job(clock)
    for _ in range(3):
        job.collectives(("BROADCAST", 9.0))  # forward: buffers
        job.backward(clock, *allreduces(1.0, 2.0))
        job.collectives(("ALLREDUCE", 50.0))  # the user's loss average
        job.end_step(clock, 2)
        job.collectives(("ALLREDUCE", 60.0), ("ALLGATHER", 1.0))  # logging between steps
    steps = job.collect(clock)
    assert [(s.step, durations(s)) for s in steps] == [
        (n, [(0, 0.001), (1, 0.002)]) for n in (1, 2, 3)
    ]
    assert clock.unmatched_steps == 0


def test_a_users_allreduce_during_backward_leaves_the_step_untimed() -> None:
    """An all-reduce of the user's between DDP's buckets (from a tensor hook, SyncBatchNorm
    in backward): 3 for 2 buckets. Which one is not DDP's cannot be told, so the step is
    refused, never guessed; other kinds of collective in the window do not count."""
    clock = fresh()
    job = Job(clock)
    job.backward(clock, ("ALLREDUCE", 1.0), ("ALLREDUCE", 70.0), ("ALLREDUCE", 2.0))
    job.end_step(clock, 2)
    job.backward(clock, ("ALLREDUCE", 1.0), ("ALLGATHER", 70.0), ("ALLREDUCE", 2.0))
    job.end_step(clock, 2)
    job.backward(clock, *allreduces(3.0, 4.0))
    job.end_step(clock, 2)
    steps = job.collect(clock)
    assert [(s.step, durations(s)) for s in steps] == [(2, [(0, 0.001), (1, 0.002)])]
    assert clock.unmatched_steps == 1
    assert (
        clock.last_mismatch
        == "3 all-reduce(s) on DDP's process group during backward for 2 bucket(s)"
    )


def test_two_ddp_models_on_one_group_one_after_the_other() -> None:
    """A generator and a discriminator, each a DDP model with its own monitor, on the one
    default group: each clock hears both models' all-reduces and keeps those of its own
    backward."""
    gen, disc = fresh(), fresh()
    job = Job(gen, disc)
    for _ in range(3):
        job.backward(disc, *allreduces(5.0))  # D's step: 1 bucket
        job.end_step(disc, 1)
        job.backward(gen, *allreduces(1.0, 2.0, 3.0))  # G's step: 3 buckets
        job.end_step(gen, 3)
    g, d = job.collect(gen), job.collect(disc)
    assert [durations(s) for s in g] == [[(0, 0.001), (1, 0.002), (2, 0.003)]] * 2  # the 3rd waits
    assert [durations(s) for s in d] == [[(0, 0.005)]] * 3
    assert gen.unmatched_steps == disc.unmatched_steps == 0


def test_two_ddp_models_in_one_backward_are_left_untimed() -> None:
    """One backward through both models (D(G(z)) with both wrapped): both backward windows
    span the whole backward, in which D's buckets and then G's go out on the group; neither
    count fits, neither model's step is guessed."""
    gen, disc = fresh(), fresh()
    job = Job(gen, disc)
    for _ in range(2):
        for clock in (gen, disc):
            clock.backward_started(time.perf_counter())
        job.collectives(*allreduces(5.0, 6.0), *allreduces(1.0, 2.0, 3.0))
        for clock in (gen, disc):
            clock.backward_done()
        job.end_step(disc, 2)
        job.end_step(gen, 3)
    job.collect(gen), job.collect(disc)
    assert (
        gen.matched_steps == 0 and gen.unmatched_steps == 1
    )  # the 2nd has no later collective yet
    assert (
        gen.last_mismatch
        == "5 all-reduce(s) on DDP's process group during backward for 3 bucket(s)"
    )
    assert disc.matched_steps == 0 and disc.unmatched_steps == 1
    assert (
        disc.last_mismatch
        == "5 all-reduce(s) on DDP's process group during backward for 2 bucket(s)"
    )


@pytest.mark.parametrize("find_unused", [False, True])
def test_gradient_accumulation_with_no_sync_microbatches(find_unused: bool) -> None:
    """Three microbatches, the first two under ``no_sync``: one step, whose window spans
    every microbatch's backward, and whose buckets are the last microbatch's (plus DDP's
    used-parameter map with find_unused_parameters). A collective of the user's in a
    later microbatch's forward falls inside that window and leaves the step untimed."""
    clock = fresh(find_unused)
    job = Job(clock)
    extra = [("ALLREDUCE", 0.1)] if find_unused else []
    for forward_collective in (False, False, True, False):
        job.backward(clock)  # microbatch 0, no_sync: nothing enqueued
        if forward_collective:
            job.collectives(("ALLREDUCE", 40.0))
        job.backward(clock)  # microbatch 1, no_sync
        job.backward(clock, *allreduces(1.0, 2.0), *extra)  # microbatch 2 synchronises
        job.end_step(clock, 2)
    steps = job.collect(clock)
    assert [(s.step, durations(s)) for s in steps] == [
        (n, [(0, 0.001), (1, 0.002)]) for n in (1, 2)
    ]
    assert clock.unmatched_steps == 1 and clock.last_mismatch.startswith(
        f"{3 + len(extra)} all-reduce(s)"
    )
    assert all(0.009 < t.ready < 0.5 for s in steps for t in s.buckets), (
        "ready: from the step's start"
    )


# -- the self-check ---------------------------------------------------------------------------


@pytest.fixture
def settle_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(completion, "SETTLE_SECONDS", 0.0)


def run_steps(
    job: Job, clock: CompletionClock, n: int, *ops_ms: tuple[str, float], buckets: int = 2
) -> None:
    """``n`` steps, each settled at its own boundary (SETTLE_SECONDS = 0)."""
    for _ in range(n):
        job.backward(clock, *ops_ms)
        job.end_step(clock, buckets)
        job.collect(clock)


def test_no_workinfo_in_the_first_steps_turns_the_source_off(
    settle_at_once: None, caplog: pytest.LogCaptureFixture
) -> None:
    clock = fresh()
    job = Job(clock)
    run_steps(job, clock, completion.SELF_CHECK_STEPS - 1)
    assert clock.off_reason is None
    run_steps(job, clock, 1)
    assert clock.off_reason == "c10d's completion hook gave no WorkInfo in the first 20 steps"
    assert not caplog.records, "the clock says nothing itself: the monitor logs the one line"
    run_steps(job, clock, 5, *allreduces(1.0, 2.0))
    assert not clock._windows and clock.matched_steps == 0, "off: nothing is recorded any more"


def test_workinfo_of_other_collectives_only(
    settle_at_once: None, caplog: pytest.LogCaptureFixture
) -> None:
    clock = fresh()
    job = Job(clock)
    run_steps(job, clock, completion.SELF_CHECK_STEPS, ("REDUCE_SCATTER", 1.0), ("ALLGATHER", 1.0))
    assert (
        clock.off_reason == "c10d reported 40 collective(s) but no all-reduce in the first 20 steps"
    )


def test_workinfo_that_never_fits_the_buckets_turns_the_source_off(
    settle_at_once: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Two all-reduces per bucket (a comm hook that splits each bucket), every step."""
    clock = fresh()
    job = Job(clock)
    run_steps(job, clock, completion.SELF_CHECK_STEPS, *allreduces(1.0, 1.0, 1.0, 1.0))
    assert clock.off_reason == (
        "none of the first 20 steps could be matched to DDP's buckets (4 all-reduce(s) on DDP's "
        "process group during backward for 2 bucket(s))"
    )
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_one_matched_step_keeps_the_source_on(settle_at_once: None) -> None:
    clock = fresh()
    job = Job(clock)
    run_steps(job, clock, 1, *allreduces(1.0, 1.0))
    run_steps(job, clock, 3 * completion.SELF_CHECK_STEPS, *allreduces(1.0))
    assert clock.matched_steps == 1 and clock.off_reason is None
    assert clock.warning, "a source that stops matching warns instead"


def test_steps_whose_completions_never_come_count_for_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fast steps and c10d silent: windows pile up to MAX_WINDOWS and the oldest are given
    up on before any settles; the check counts those."""
    monkeypatch.setattr(completion, "SETTLE_SECONDS", 3600.0)
    clock = fresh()
    for i in range(completion.MAX_WINDOWS + completion.SELF_CHECK_STEPS):
        clock.backward_started(time.perf_counter())
        clock.backward_done()
        clock.new_step(i + 1, 2)
        clock.collect()
    assert clock.off_reason == "c10d's completion hook gave no WorkInfo in the first 20 steps"


@pytest.mark.parametrize("given", ["datetime", "steady_clock", "unix_timedelta"])
def test_the_start_time_of_a_completion_is_read_whatever_clock_pybind_hands_over(
    given: str,
) -> None:
    """torch's CUDA builds hand ``WorkInfo.time_started`` as a datetime (system_clock) or,
    on torch 2.11, as a timedelta of the steady clock (time.monotonic's): both are now."""
    import datetime
    import time

    from ddpmon.rank.timing.c10d import _unix

    now = time.time()
    moment = {
        "datetime": datetime.datetime.fromtimestamp(now),
        "steady_clock": datetime.timedelta(seconds=time.monotonic()),
        "unix_timedelta": datetime.timedelta(seconds=now),
    }[given]
    assert _unix(moment) == pytest.approx(now, abs=0.5)
