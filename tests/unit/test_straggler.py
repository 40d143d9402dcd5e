"""The straggler score (ddpmon/steps.py) and the doctor's straggler rule on step parts."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ddpmon import steps
from ddpmon.doctor import words
from ddpmon.state.schema import StepParts


def step_parts(busy: float, spread: float = 0.001, steps: int = 20, **parts: float) -> StepParts:
    """A rank whose busy time is ``busy``: forward 0.01, backward 0.02, the rest in ``parts``
    (seconds per step), exposed communication filling up to a 0.1 s step."""
    p = {
        "data_wait_seconds": 0.0,
        "forward_seconds": 0.01,
        "backward_seconds": 0.02,
        "optimizer_seconds": 0.002,
        "other_seconds": 0.0,
    }
    p.update({k + "_seconds": v for k, v in parts.items()})
    own = sum(p.values())
    p["other_seconds"] += busy - own
    return StepParts(
        steps=steps,
        step_seconds=0.1,
        exposed_comm_seconds=0.1 - busy,
        busy_seconds=busy,
        busy_spread_seconds=spread,
        **p,
    )


def test_a_slow_data_loader_is_named_and_not_its_waiting_peers() -> None:
    scores = steps.scores(
        {
            0: step_parts(0.032),
            1: step_parts(0.072, data_wait=0.04),
            2: step_parts(0.033),
        }
    )
    named = {r: s for r, s in scores.items() if s.straggler}
    assert list(named) == [1]
    s = named[1]
    assert s.cause == "data_wait" and s.shares["data_wait"] > 0.95
    assert 1.1 < s.score < 1.3  # 0.072 against the others' median 0.0325
    assert scores[0].score < 0 and scores[2].score < 0


def test_each_part_is_named_as_the_cause() -> None:
    for part in ("forward", "backward", "optimizer", "other"):
        base = {"forward": 0.01, "backward": 0.02, "optimizer": 0.002, "other": 0.0}
        slow = dict(base, **{part: base[part] + 0.01})
        scores = steps.scores(
            {0: step_parts(0.032), 1: step_parts(0.042, **slow), 2: step_parts(0.032)}
        )
        assert [r for r, s in scores.items() if s.straggler] == [1], part
        assert scores[1].cause == part


def test_noise_and_small_gaps_are_no_straggler() -> None:
    # 15% slower, but its steps jitter by 10 ms around a 40 ms busy time: not consistent
    noisy = steps.scores({0: step_parts(0.040, spread=0.01), 1: step_parts(0.046, spread=0.01)})
    assert not any(s.straggler for s in noisy.values())
    # 50% slower by 0.5 ms: below the 1 ms floor
    tiny = steps.scores({0: step_parts(0.001, spread=0.0), 1: step_parts(0.0015, spread=0.0)})
    assert not any(s.straggler for s in tiny.values())
    # 12% slower and quiet: a straggler
    quiet = steps.scores({0: step_parts(0.040, spread=0.0005), 1: step_parts(0.045, spread=0.0005)})
    assert [r for r, s in quiet.items() if s.straggler] == [1]


def test_too_few_steps_or_ranks_give_no_score() -> None:
    assert steps.scores({0: step_parts(0.03), 1: step_parts(0.06, steps=4)}) == {}
    assert steps.scores({0: step_parts(0.03)}) == {}


def test_the_summary_names_rank_share_part_and_fix() -> None:
    text = words.straggler_summary(1, 0.41, "data_wait", 0.95, window=steps.over(50))
    assert text.startswith(
        "rank 1 is 41% slower than the others over its last 50 steps, 95% of it in data wait: "
        "look at its data loader"
    )
    assert (
        words.straggler_summary(2, 0.3, None, 0.0, window=steps.over(1200, whole=True))
        == "rank 2 is 30% slower than the others over the whole run (1200 steps), spread over "
        "several parts of the step"
    )


def test_typical_busy_time_ignores_a_few_slow_steps_and_knows_its_error() -> None:
    import random
    import statistics

    from ddpmon.steps import typical

    # two slow steps of twenty (a checkpoint, a GC pause) move neither value
    middle, spread = typical([0.010] * 18 + [0.5, 0.9])
    assert middle == pytest.approx(0.010) and spread == pytest.approx(0.0, abs=1e-12)
    # its standard error, checked on samples, for windows whose trimmed share is not 20%
    rng = random.Random(0)
    for n in (10, 14, 20):
        samples = [[rng.gauss(0.020, 0.002) for _ in range(n)] for _ in range(600)]
        means = [typical(s)[0] for s in samples]
        predicted = statistics.mean(typical(s)[1] for s in samples)
        assert statistics.stdev(means) == pytest.approx(predicted, rel=0.15), n
        assert statistics.mean(means) == pytest.approx(0.020, rel=0.01)


def test_files_of_an_older_ddpmon_are_scored_from_their_median_absolute_deviation() -> None:
    # no busy_error_seconds: the noise of a median, from the MAD (0.5 ms over 20 steps)
    old = steps.scores({0: step_parts(0.040, spread=0.0005), 1: step_parts(0.043, spread=0.0005)})
    assert old[1].noise_seconds == pytest.approx(
        0.000294, rel=1e-3
    )  # 0.29 ms: a median's error, for two ranks
    new = steps.scores(
        {
            0: dataclasses.replace(step_parts(0.040), busy_error_seconds=0.0002),
            1: dataclasses.replace(step_parts(0.043), busy_error_seconds=0.0004),
        }
    )
    assert new[1].noise_seconds == pytest.approx(
        0.000566, rel=1e-3
    )  # the larger error, 0.4 ms, for two ranks
    assert new[0].noise_seconds == pytest.approx(0.000566, rel=1e-3)


def test_a_rank_slower_but_within_its_noise_gets_an_info_note_not_a_verdict() -> None:
    from types import SimpleNamespace

    from ddpmon.doctor.rules import straggler as rule

    def view(rank: int, p: StepParts, status: str = "stepping") -> Any:
        return SimpleNamespace(
            rank=rank,
            status=status,
            file=SimpleNamespace(path=f"node-a:9490/rank-{rank}.json", daemon=None),
            state=SimpleNamespace(
                host="node-a", timings=SimpleNamespace(parts=p), stack_samples=None
            ),
        )

    noisy = [
        view(0, step_parts(0.040, spread=0.01)),
        view(1, step_parts(0.046, spread=0.01, data_wait=0.006)),
    ]
    assert rule.straggler(noisy, []) is None
    (note,) = rule.slowest_within_noise(noisy)
    assert (note.kind, note.severity, note.ranks) == ("slowest_rank", "info", [1])
    assert note.summary.startswith(
        "rank 1 is 15% slower than the others over its last 20 steps, most of it in data wait, "
        "but within"
    )
    # named, or not running, or not slower by 5%: no note
    quiet = [view(0, step_parts(0.040, spread=0.0005)), view(1, step_parts(0.045, spread=0.0005))]
    named = rule.straggler(quiet, [])
    assert rule.slowest_within_noise(quiet) == [] and (named.verdict, named.suspects) == (
        "straggler",
        [1],
    )
    assert named.findings[0].summary.startswith("rank 1 is 12% slower than the others")
    assert named.findings[0].fix.endswith(
        ". To see where its time goes, on node-a: ddpmon capture STATE_DIR --rank 1 "
        "--compare 0 (STATE_DIR: the job's state directory there)"
    )
    assert (
        rule.slowest_within_noise([noisy[0], view(1, noisy[1].state.timings.parts, "stuck")]) == []
    )
    assert (
        rule.slowest_within_noise(
            [view(0, step_parts(0.040, spread=0.01)), view(1, step_parts(0.041, spread=0.01))]
        )
        == []
    )


def test_a_rank_slower_by_5_to_10_percent_and_out_of_its_noise_is_named() -> None:
    # 10% slower measures 10% give or take its noise: naming from 5% names it every time
    eight = steps.scores(
        {
            0: step_parts(0.040, spread=0.0002),
            1: step_parts(0.0432, spread=0.0002),
            2: step_parts(0.040, spread=0.0002),
        }
    )
    assert [r for r, s in eight.items() if s.straggler] == [1]
    # below 5%, however quiet, it is within what ranks differ by
    four = steps.scores(
        {
            0: step_parts(0.040, spread=0.0001),
            1: step_parts(0.0416, spread=0.0001),
            2: step_parts(0.040, spread=0.0001),
        }
    )
    assert not any(s.straggler for s in four.values())


# Step by step: the rows a rank keeps (steps.StepRow) -> steps.phases -> steps.scores.

BASE = {"data_wait": 0.005, "forward": 0.010, "backward": 0.015, "optimizer": 0.005, "other": 0.005}
"""A rank's own work per step, 40 ms busy."""


def rows(
    count: int,
    first: int = 10,
    seed: int = 0,
    shared: list[float] | None = None,
    jitter: float = 0.002,
    slow: dict[str, float] | None = None,
    slow_from: int = 0,
) -> list[steps.StepRow]:
    """``count`` steps of one rank of a 0.1 s step: its own jitter (uniform, ``jitter`` s), the
    machine's noise that hits every rank in the same step (``shared``, s per step, put in the
    part each step names in turn) and, from step ``slow_from``, ``slow`` extra seconds per part."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(count):
        step = first + i
        parts = dict(BASE)
        parts[rng.choice(list(BASE))] += rng.uniform(0.0, jitter)
        if shared is not None:
            parts[list(BASE)[step % len(BASE)]] += shared[i]
        if slow and step >= slow_from:
            for part, extra in slow.items():
                parts[part] += extra
        busy = sum(parts.values())
        row = steps.StepRow(
            step,
            0.0,
            0.0,
            step_seconds=max(0.1, busy + 0.001),
            exposed_comm_seconds=max(0.1, busy + 0.001) - busy,
            **{p + "_seconds": v for p, v in parts.items()},
        )
        out.append(row)
    return out


def machine_noise(count: int, seed: int = 99) -> list[float]:
    """A busy machine: every step loses up to 30 ms to it, one in eight 30 to 60 ms more, the
    same on every rank."""
    import random

    rng = random.Random(seed)
    return [
        rng.uniform(0.0, 0.030) + (rng.uniform(0.030, 0.060) if rng.random() < 0.125 else 0.0)
        for _ in range(count)
    ]


def named(ranks: dict[int, list[steps.StepRow]]) -> dict[int, steps.Score]:
    scores = steps.scores({r: steps.step_parts(rs) for r, rs in ranks.items()})
    return {r: s for r, s in scores.items() if s.straggler}


def test_noise_that_hits_every_rank_at_once_cancels_out() -> None:
    # 20% slower in forward (8 ms on 40) on a machine whose noise per step is up to 90 ms,
    # shared: named within 20 steps, with its part; the same files scored on their means
    # alone (an older ddpmon's) do not stand out of that noise.
    noise = machine_noise(20)
    job = {
        r: rows(20, seed=r, shared=noise, slow={"forward": 0.008} if r == 1 else None)
        for r in range(3)
    }
    found = named(job)
    assert list(found) == [1] and found[1].cause == "forward" and found[1].steps == 20
    assert found[1].gap_seconds == pytest.approx(
        0.008, abs=0.0015
    )  # its 8 ms, whatever the machine added
    means_only = {
        r: dataclasses.replace(steps.step_parts(rs), recent=None) for r, rs in job.items()
    }
    assert not any(s.straggler for s in steps.scores(means_only).values())


def test_a_rank_descheduled_in_a_few_steps_is_not_that_much_slower() -> None:
    # 40 ms lost by rank 2 alone in 2 of 20 steps: the trimmed mean leaves them out, so
    # its own 8 ms in forward stand out, and only they
    def descheduled(job: dict[int, list[steps.StepRow]]) -> dict[int, list[steps.StepRow]]:
        for i in (4, 13):
            job[2][i].other_seconds += 0.040
            job[2][i].step_seconds += 0.040
        return job

    assert named(descheduled({r: rows(20, seed=r) for r in range(3)})) == {}
    found = named(
        descheduled(
            {r: rows(20, seed=r, slow={"forward": 0.008} if r == 2 else None) for r in range(3)}
        )
    )
    assert list(found) == [2] and found[2].cause == "forward"
    assert found[2].gap_seconds == pytest.approx(0.008, abs=0.0015)


def test_healthy_jittery_ranks_are_never_named() -> None:
    # 300 comparisons of healthy jobs of 2 to 8 ranks, each rank's steps jittering by up to
    # 40% of its busy time, with and without a busy machine's shared noise
    for seed in range(300):
        world = 2 + seed % 7
        noise = machine_noise(150, seed) if seed % 2 else None
        job = {
            r: rows(10 + seed % 141, seed=1000 * seed + r, shared=noise, jitter=0.016)
            for r in range(world)
        }
        assert named(job) == {}, seed


def test_a_long_window_names_what_a_short_one_cannot_and_a_short_one_what_just_began() -> None:
    # 6% slower (3 ms) under 16 ms of jitter: not out of the noise over 20 steps, named over 150
    def job(count: int) -> dict[int, list[steps.StepRow]]:
        return {
            r: rows(count, seed=r, jitter=0.016, slow={"backward": 0.003} if r == 0 else None)
            for r in range(4)
        }

    assert named(job(20)) == {}
    found = named(job(150))
    assert list(found) == [0] and found[0].steps == 150 and found[0].cause == "backward"
    # 25% slower over the last 11 steps of 150 only: the last 20 steps name it
    late = {
        r: rows(150, seed=r, slow={"data_wait": 0.010} if r == 2 else None, slow_from=140)
        for r in range(3)
    }
    found = named(late)
    assert list(found) == [2] and found[2].steps == 20 and found[2].cause == "data_wait"


def test_the_first_steps_of_the_job_are_left_out() -> None:
    # rank 0 twice as slow in the job's first 5 steps (allocations, the bucket rebuild)
    job = {r: rows(15, first=1, seed=r) for r in range(3)}
    job[0][:5] = rows(5, first=1, seed=0, slow={"other": 0.040})
    assert named(job) == {}
    assert steps.step_parts(job[0]).recent.step[0] == 6  # type: ignore[union-attr]


def test_only_the_steps_every_rank_has_are_compared() -> None:
    # rank 1 attached 10 steps later: compared on the 20 steps they share
    job = {
        0: rows(30, first=10, seed=0),
        1: rows(20, first=20, seed=1, slow={"optimizer": 0.010}),
        2: rows(30, first=10, seed=2),
    }
    found = named(job)
    assert list(found) == [1] and found[1].steps == 20 and found[1].cause == "optimizer"


def test_the_margin_is_students_t_for_the_steps_compared() -> None:
    # exact quantiles at 1e-4: 4.880 (15 degrees of freedom: 20 steps, 10% trimmed each side), 4.105 (39), 3.838 (119)
    assert steps.critical_value(20) == pytest.approx(4.880, abs=0.02)
    assert steps.critical_value(50) == pytest.approx(4.105, abs=0.02)
    assert steps.critical_value(150) == pytest.approx(3.838, abs=0.02)


def test_the_state_file_carries_the_last_steps_one_by_one_and_round_trips() -> None:
    from ddpmon.state import records
    from ddpmon.state.schema import StepParts

    p = steps.step_parts(rows(300, first=1))
    assert p is not None and p.recent is not None and p.steps == steps.PART_STEPS
    assert len(p.recent.step) == steps.SCORE_WINDOWS[-1] and p.recent.step[-1] == 300
    assert p.recent.busy_seconds[-1] == pytest.approx(
        steps.busy_seconds(rows(300, first=1)[-1]), abs=1e-6
    )
    again = records.load(StepParts, dataclasses.asdict(p))
    assert again == p


def test_one_table_names_the_parts_for_every_reader() -> None:
    """The doctor's fixes, ``top``'s columns and the report's colours and legend all come
    from ``steps.PART_TABLE``: every part has each, and every cause has a fix."""
    from ddpmon.doctor import words

    assert set(words.FIX_STRAGGLER_PART) == set(steps.BUSY_PARTS)
    assert steps.PARTS == tuple(p.name for p in steps.PART_TABLE)
    for p in steps.PART_TABLE:
        assert p.label and p.column and p.colour.startswith("#"), p
    assert steps.WAITING_PARTS == {"exposed_comm"}


def lasting_views(
    tmp_path: Any, slow_from: int, count: int = 150, status: str = "stepping"
) -> list[Any]:
    """Three ranks of ``count`` steps of 0.1 s (150: 15 s), each with its state file's parts
    and its history beside it; rank 1 is 10 ms slower in its forward from step ``slow_from``."""
    from types import SimpleNamespace

    from ddpmon.state import history

    t0 = 1_700_000_000.0
    views = []
    for rank in range(3):
        rs = rows(
            count, seed=rank, slow={"forward": 0.010} if rank == 1 else None, slow_from=slow_from
        )
        for r in rs:
            r.start_unix, r.end_unix = t0 + (r.step - 1) * 0.1, t0 + r.step * 0.1
        store = history.HistoryStore(history.path_for(str(tmp_path), rank), {"rank": rank})
        store.add_steps([r.history() for r in rs])
        store.close()
        views.append(
            SimpleNamespace(
                rank=rank,
                status=status,
                file=SimpleNamespace(path=str(tmp_path / f"rank-{rank}.json"), daemon=None),
                state=SimpleNamespace(
                    host="node-a",
                    timings=SimpleNamespace(parts=steps.step_parts(rs)),
                    stack_samples=None,
                ),
            )
        )
    return views


def test_a_gap_that_lasts_is_named_and_one_younger_than_the_sustain_time_is_not(
    tmp_path: Any,
) -> None:
    from ddpmon.doctor.rules import straggler as rule

    # slower for the whole 15 s of its history: named, and how it lasted is said
    lasting = rule.straggler(lasting_views(tmp_path / "a", slow_from=0), [])
    assert lasting is not None and lasting.suspects == [1]
    (held,) = [e for e in lasting.findings[0].evidence if e.startswith("it lasts: ")]
    assert held.endswith(
        " in 3 consecutive blocks of its last 12 s (a straggler's gap must hold 12 s)"
    ), held
    # slower for its last 5 s only (50 steps: its state file's windows name it): a burst of
    # a busy machine's scheduling looks the same, so not named yet, and said so
    young = lasting_views(tmp_path / "b", slow_from=110)
    scores = steps.scores({v.rank: v.state.timings.parts for v in young})
    assert [r for r, s in scores.items() if s.straggler] == [1]
    assert rule.straggler(young, []) is None
    (note,) = rule.slowest_within_noise(young)
    assert (note.kind, note.severity, note.ranks) == ("slowest_rank", "info", [1])
    assert "but that has not lasted 12 s (over its last 12 s, in 3 blocks: +" in note.summary
    assert note.summary.endswith(
        "not named a straggler yet (a busy machine slows one rank, then another, for seconds at a time)"
    )


def test_a_finished_job_is_named_only_when_its_gap_lasted_the_sustain_time(
    tmp_path: Any,
) -> None:
    """A job that ended is judged by the same rule as a running one: a short job whose last
    second a busy machine slowed on one rank looks like a straggler to the windows alone."""
    from ddpmon.doctor.rules import straggler as rule

    # slower over all 15 s of a finished job: it keeps the verdict, with how it lasted
    long = rule.finished_straggler(lasting_views(tmp_path / "a", 0, status="exited"))
    assert long is not None and long.verdict == "straggler" and long.suspects == [1]
    assert any(
        e.startswith("it lasts: ") and e.endswith("(a straggler's gap must hold 12 s)")
        for e in long.findings[0].evidence
    ), long.findings[0].evidence
    # as slow, but the job ended after 4 s: the windows name rank 1, the sustain rule does not
    short = lasting_views(tmp_path / "b", 0, count=40, status="exited")
    scores = steps.scores({v.rank: v.state.timings.parts for v in short})
    assert [r for r, s in scores.items() if s.straggler] == [1]
    assert rule.finished_straggler(short) is None


def test_sustained_asks_every_block_to_be_slower_over_the_sustain_time() -> None:
    def series(busy: Any, last: int = 136) -> dict[int, dict[str, list[Any]]]:
        numbers = range(6, last)  # 0.1 s steps, the first five (warm-up) left out
        return {
            r: {
                "step": list(numbers),
                "end_unix": [s * 0.1 for s in numbers],
                "busy_seconds": [busy(r, s) for s in numbers],
            }
            for r in range(3)
        }

    held = steps.sustained(series(lambda r, s: 0.05 if r == 1 else 0.04), 1)
    assert held.held and held.blocks == pytest.approx((0.25, 0.25, 0.25))
    assert held.seconds == pytest.approx(12.9)
    late = steps.sustained(series(lambda r, s: 0.05 if r == 1 and s > 50 else 0.04), 1)
    assert not late.held and late.blocks[0] < steps.SCORE_WARN < min(late.blocks[1:])
    short = steps.sustained(series(lambda r, s: 0.05 if r == 1 else 0.04, last=120), 1)
    assert not short.held and short.seconds == pytest.approx(11.3)


def test_steps_longer_than_a_block_are_shared_out_by_count() -> None:
    """Steps of 5 s: the last 12 s hold two or three of them, so the blocks take the steps
    read (at least ``MIN_STEPS``) a third each, and a straggler there is still named."""
    numbers = range(6, 18)
    series = {
        r: {
            "step": list(numbers),
            "end_unix": [s * 5.0 for s in numbers],
            "busy_seconds": [4.0 if r == 1 else 3.0 for s in numbers],
        }
        for r in range(3)
    }
    held = steps.sustained(series, 1)
    assert held.held and held.seconds == 55.0 and held.blocks == pytest.approx((1 / 3,) * 3)
