"""The c10d bucket clock: completions shaped as torch's WorkInfo (its real OpType, datetimes and
timedeltas as pybind hands them over) matched to steps and buckets. NCCL itself runs in
tests/gpu; here the matching rules are pinned down, including the steps it must refuse. (The
group destroyed at the interpreter's exit: tests/processes/test_exits.py.)"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch._C._distributed_c10d as c10d

from ddpmon.fuses import Fuse
from ddpmon.rank.recorder import BucketTiming, Recorder, StepTimings
from ddpmon.rank.timing import c10d as completion
from ddpmon.rank.timing.c10d import CompletionClock
from ddpmon.rank.timing.layout import _numbers
from ddpmon.state.schema import Identity
from tests.support.c10d import info


@pytest.fixture(autouse=True)
def no_settle_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(completion, "SETTLE_MARGIN", 0.0)


def run_step(
    clock: CompletionClock,
    buckets: int,
    collectives: list[tuple[str, float]],
    seq0: int,
    generation: int = 0,
    step: int | None = None,
) -> int:
    """One step: backward opens the window, the collectives are enqueued in it, backward
    ends, the boundary closes it. Completions arrive as c10d would send them."""
    clock.backward_started(time.perf_counter() - 0.010)  # the step began 10 ms ago
    t0 = time.time()
    infos = [
        info(op, seq0 + i + 1, t0 + 0.0001 * (i + 1), ms) for i, (op, ms) in enumerate(collectives)
    ]
    time.sleep(0.002)
    clock.backward_done()
    clock.sync_done()
    clock.new_step(step, buckets, generation)
    for i in infos:
        clock.on_completion(i)
    return seq0 + len(collectives)


def fresh(find_unused: bool = False) -> CompletionClock:
    return CompletionClock("cpu", find_unused, Fuse("comm_hook"))


def test_allreduces_of_a_backward_become_its_buckets_in_order() -> None:
    clock = fresh()
    seq = run_step(clock, 3, [("ALLREDUCE", 1.0), ("ALLREDUCE", 2.0), ("ALLREDUCE", 4.0)], 10)
    assert clock.collect() == []  # nothing later yet: the step may still get collectives
    run_step(clock, 3, [("ALLREDUCE", 1.0)] * 3, seq)
    (resolved,) = clock.collect()
    timings = resolved.buckets
    assert [t.index for t in timings] == [0, 1, 2]
    assert [round(t.end - t.start, 6) for t in timings] == [0.001, 0.002, 0.004]
    assert all(0.009 < t.ready < 5 for t in timings), (
        "ready: seconds after the step began (10 ms ago and more)"
    )
    assert resolved.exposed is None and not resolved.measured  # on CPU there are no CUDA events
    assert clock.matched_steps == 1 and clock.unmatched_steps == 0


def test_other_collectives_are_ignored_and_a_wrong_count_is_never_guessed() -> None:
    clock = fresh()
    seq = run_step(
        clock,
        2,
        [("BROADCAST", 1.0), ("ALLREDUCE", 1.0), ("ALLGATHER", 1.0), ("ALLREDUCE", 3.0)],
        0,
    )
    seq = run_step(clock, 2, [("ALLREDUCE", 1.0)] * 3, seq)  # PowerSGD-like: 3 for 2 buckets
    run_step(clock, 2, [("ALLREDUCE", 1.0)] * 2, seq)
    steps = clock.collect()
    assert len(steps) == 1, "the second step is refused, not guessed"
    assert [round(t.end - t.start, 6) for t in steps[0].buckets] == [0.001, 0.003]
    assert clock.unmatched_steps == 1
    assert (
        clock.last_mismatch
        == "3 all-reduce(s) on DDP's process group during backward for 2 bucket(s)"
    )


def test_find_unused_parameters_adds_ddps_used_map_allreduce_after_the_last_bucket() -> None:
    clock = fresh(find_unused=True)
    seq = run_step(clock, 2, [("ALLREDUCE", 1.0), ("ALLREDUCE", 2.0), ("ALLREDUCE", 0.1)], 0)
    seq = run_step(clock, 2, [("ALLREDUCE", 1.0)] * 2, seq)  # the used map is missing: refused
    run_step(clock, 2, [("ALLREDUCE", 1.0)] * 3, seq)
    (resolved,) = clock.collect()
    assert [round(t.end - t.start, 6) for t in resolved.buckets] == [0.001, 0.002]
    assert clock.unmatched_steps == 1


def test_a_step_with_no_later_collective_settles_after_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = fresh()
    run_step(clock, 1, [("ALLREDUCE", 1.0)], 0)
    assert clock.collect() == []
    monkeypatch.setattr(completion, "SETTLE_SECONDS", 0.0)
    assert len(clock.collect()) == 1


def fail_to_match(clock: CompletionClock, steps: int, seq: int = 0) -> int:
    """``steps`` steps of 2 all-reduces for 4 buckets, each refused once settled (needs
    SETTLE_SECONDS = 0); returns the last sequence number."""
    for _ in range(steps):
        seq = run_step(clock, 4, [("ALLREDUCE", 1.0)] * 2, seq)
        time.sleep(0.001)
        assert clock.collect() == []
    return seq


def match_once(clock: CompletionClock) -> int:
    """One step of 4 all-reduces for 4 buckets, matched (needs SETTLE_SECONDS = 0)."""
    seq = run_step(clock, 4, [("ALLREDUCE", 1.0)] * 4, 0)
    time.sleep(0.001)
    assert len(clock.collect()) == 1
    return seq


def test_steps_that_keep_failing_to_match_say_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A source that worked and then stops matching (SyncBatchNorm switched on, say) warns
    once and keeps trying; one that never matched is the self-check's (test_c10d_sequences)."""
    monkeypatch.setattr(completion, "SETTLE_SECONDS", 0.0)
    clock = fresh()
    fail_to_match(clock, 2 * completion.WARN_AFTER_UNMATCHED, match_once(clock))
    assert clock.unmatched_steps == 2 * completion.WARN_AFTER_UNMATCHED
    assert (
        clock.warning
        and "bucket_timing='hook'" in clock.warning
        and "2 all-reduce(s)" in clock.warning
    )
    assert len([r for r in caplog.records if "matched no step" in r.getMessage()]) == 1
    assert clock.off_reason is None


def test_memory_stays_bounded_when_nothing_ever_matches() -> None:
    clock = fresh()
    for i in range(completion.MAX_WINDOWS * 3):
        clock.backward_started(time.perf_counter())
        clock.backward_done()
        clock.new_step(i + 1, 2)
    assert len(clock._windows) == completion.MAX_WINDOWS
    for i in range(completion.MAX_COLLECTIVES * 2):
        clock.on_completion(info("ALLREDUCE", i + 1, 0.0, 1.0))
    assert len(clock._done) == completion.MAX_COLLECTIVES


def test_a_bad_completion_switches_the_clock_off_without_raising() -> None:
    clock = fresh()
    clock.on_completion(SimpleNamespace(op_type=c10d.OpType.ALLREDUCE))  # no times at all
    assert not clock._fuse.ok
    clock.on_completion(info("ALLREDUCE", 1, 0.0, 1.0))  # ignored from now on
    assert not clock._done


def test_logging_data_lists_are_read_in_both_spellings() -> None:
    assert _numbers("526336, 526336") == [526336, 526336]
    assert _numbers([1, 2]) == [1, 2] and _numbers(None) == [] and _numbers("") == []


def test_matched_timings_feed_the_recorder_with_the_clocks_exposed_time() -> None:
    rec = Recorder(Identity(rank=0), world_size=2)
    rec.set_bucket_layout(0, 1000, "float32", ["w"])
    rec.close_step(1.0)
    clock = fresh()
    seq = run_step(clock, 1, [("ALLREDUCE", 2.0)], 0)
    run_step(clock, 1, [("ALLREDUCE", 2.0)], seq)
    for resolved in clock.collect():
        rec.add_step_timings(resolved._replace(exposed=0.0005, measured=True))
    (b,) = rec.bucket_stats()
    assert b.last_seconds == pytest.approx(0.002)
    assert b.last_busbw == pytest.approx(500_000)  # 1000 bytes in 2 ms; 2(n-1)/n = 1 for n = 2
    assert rec.histograms()["exposed_comm"].sum == pytest.approx(0.0005)


def test_a_step_may_match_the_layout_known_by_the_time_it_settles() -> None:
    """DDP rebuilds its buckets in iteration 1's forward, and its logging data shows them a
    step later: iteration 1 ends with the old layout known and is matched with the new one;
    iteration 0, which ran the old layout, is dropped rather than folded into the new one."""
    clock = fresh()
    seq = run_step(clock, 2, [("ALLREDUCE", 1.0)] * 2, 0, generation=1)  # iteration 0: 2 buckets
    seq = run_step(
        clock, 2, [("ALLREDUCE", 1.0)] * 4, seq, generation=1
    )  # rebuilt to 4, not yet shown
    seq = run_step(clock, 4, [("ALLREDUCE", 1.0)] * 4, seq, generation=2)
    run_step(clock, 4, [("ALLREDUCE", 1.0)] * 4, seq, generation=2)
    steps = clock.collect()
    assert [len(s.buckets) for s in steps] == [4, 4]
    assert clock.unmatched_steps == 0


def test_exposed_time_goes_to_the_step_it_was_measured_in() -> None:
    rec = Recorder(Identity(rank=0), world_size=2)
    for _ in range(3):
        rec.close_step(1.0)
    rec.add_step_timings(StepTimings([], 0.25, measured=True, step=2))
    assert [r.exposed_comm_seconds for r in rec.history_since(0)] == [None, 0.25, None]
    rec.add_step_timings(StepTimings([], None, measured=True, step=3))  # unknown: nothing made up
    assert rec.histograms()["exposed_comm"].count == 1


def test_timings_of_a_bucket_no_longer_in_the_layout_are_dropped() -> None:
    rec = Recorder(Identity(rank=0), world_size=2)
    rec.set_bucket_layout(0, 1000, "float32", ["w"])
    rec.close_step(1.0)
    rec.add_bucket_timings([BucketTiming(0, 0.1, 0.1, 0.2), BucketTiming(3, 0.1, 0.1, 0.2)])
    assert [b.index for b in rec.bucket_stats()] == [0]


def test_warning_clears_once_steps_match_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(completion, "SETTLE_SECONDS", 0.0)
    clock = fresh()
    seq = fail_to_match(clock, completion.WARN_AFTER_UNMATCHED, match_once(clock))
    assert clock.warning
    run_step(clock, 4, [("ALLREDUCE", 1.0)] * 4, seq)
    time.sleep(0.001)
    assert len(clock.collect()) == 1 and clock.warning is None


def test_a_completion_reported_out_of_order_waits_for_the_margin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """c10d's watchdog may report a later collective before an earlier one that completed
    during the same scan: a step settles only once its end is older than the margin."""
    monkeypatch.setattr(completion, "SETTLE_MARGIN", 0.3)
    clock = fresh()
    clock.backward_started(time.perf_counter())
    t0 = time.time()
    time.sleep(0.002)
    clock.backward_done()
    clock.new_step(1, 2)
    clock.on_completion(info("ALLREDUCE", 1, t0, 1.0))
    clock.on_completion(info("ALLREDUCE", 3, time.time() + 0.001, 1.0))  # the next step's
    assert clock.collect() == []  # bucket 1 (seq 2) may still be on its way
    clock.on_completion(info("ALLREDUCE", 2, t0 + 0.0001, 1.0))
    time.sleep(0.35)
    (resolved,) = clock.collect()
    assert len(resolved.buckets) == 2
