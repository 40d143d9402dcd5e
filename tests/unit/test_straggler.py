"""The straggler score (ddpmon/steps.py) and the doctor's straggler rule on step parts."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ddpmon import steps
from ddpmon.doctor import words
from ddpmon.state.schema import StepPhases


def phases(busy: float, spread: float = 0.001, steps: int = 20, **parts: float) -> StepPhases:
    """A rank whose busy time is ``busy``: forward 0.01, backward 0.02, the rest in ``parts``
    (seconds per step), exposed communication filling up to a 0.1 s step."""
    p = {"data_wait_seconds": 0.0, "forward_seconds": 0.01, "backward_seconds": 0.02,
         "optimizer_seconds": 0.002, "other_seconds": 0.0}
    p.update({k + "_seconds": v for k, v in parts.items()})
    own = sum(p.values())
    p["other_seconds"] += busy - own
    return StepPhases(steps=steps, step_seconds=0.1, exposed_comm_seconds=0.1 - busy, busy_seconds=busy,
                      busy_spread_seconds=spread, **p)


def test_a_slow_data_loader_is_named_and_not_its_waiting_peers() -> None:
    scores = steps.scores({
        0: phases(0.032), 1: phases(0.072, data_wait=0.04), 2: phases(0.033),
    })
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
        scores = steps.scores({0: phases(0.032), 1: phases(0.042, **slow), 2: phases(0.032)})
        assert [r for r, s in scores.items() if s.straggler] == [1], part
        assert scores[1].cause == part


def test_noise_and_small_gaps_are_no_straggler() -> None:
    # 15% slower, but its steps jitter by 10 ms around a 40 ms busy time: not consistent
    noisy = steps.scores({0: phases(0.040, spread=0.01), 1: phases(0.046, spread=0.01)})
    assert not any(s.straggler for s in noisy.values())
    # 50% slower by 0.5 ms: below the 1 ms floor
    tiny = steps.scores({0: phases(0.001, spread=0.0), 1: phases(0.0015, spread=0.0)})
    assert not any(s.straggler for s in tiny.values())
    # 12% slower and quiet: a straggler
    quiet = steps.scores({0: phases(0.040, spread=0.0005), 1: phases(0.045, spread=0.0005)})
    assert [r for r, s in quiet.items() if s.straggler] == [1]


def test_too_few_steps_or_ranks_give_no_score() -> None:
    assert steps.scores({0: phases(0.03), 1: phases(0.06, steps=4)}) == {}
    assert steps.scores({0: phases(0.03)}) == {}


def test_the_summary_names_rank_share_part_and_fix() -> None:
    text = words.straggler_summary(1, 0.41, "data_wait", 0.95)
    assert text.startswith("rank 1 is 41% slower than the others, 95% of it in data wait: look at its data loader")
    assert words.straggler_summary(2, 0.3, None, 0.0) == "rank 2 is 30% slower than the others, spread over several parts of the step"


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
    old = steps.scores({0: phases(0.040, spread=0.0005), 1: phases(0.043, spread=0.0005)})
    assert old[1].noise_seconds == pytest.approx(0.000294, rel=1e-3)  # 0.29 ms: a median's error, for two ranks
    new = steps.scores({
        0: dataclasses.replace(phases(0.040), busy_error_seconds=0.0002),
        1: dataclasses.replace(phases(0.043), busy_error_seconds=0.0004),
    })
    assert new[1].noise_seconds == pytest.approx(0.000566, rel=1e-3)  # the larger error, 0.4 ms, for two ranks
    assert new[0].noise_seconds == pytest.approx(0.000566, rel=1e-3)


def test_a_rank_slower_but_within_its_noise_gets_an_info_note_not_a_verdict() -> None:
    from types import SimpleNamespace

    from ddpmon.doctor.rules import straggler as rule

    def view(rank: int, p: StepPhases, status: str = "stepping") -> Any:
        return SimpleNamespace(rank=rank, status=status, state=SimpleNamespace(timings=SimpleNamespace(phases=p)))

    noisy = [view(0, phases(0.040, spread=0.01)), view(1, phases(0.046, spread=0.01, data_wait=0.006))]
    assert rule.straggler(noisy, []) is None
    (note,) = rule.slowest_within_noise(noisy)
    assert (note.kind, note.severity, note.ranks) == ("slowest_rank", "info", [1])
    assert note.summary.startswith("rank 1 is 15% slower than the others, most of it in data wait, but within")
    # named, or not running, or not slower by 5%: no note
    quiet = [view(0, phases(0.040, spread=0.0005)), view(1, phases(0.045, spread=0.0005))]
    named = rule.straggler(quiet, [])
    assert rule.slowest_within_noise(quiet) == [] and (named.verdict, named.suspects) == ("straggler", [1])
    assert named.findings[0].summary.startswith("rank 1 is 12% slower than the others")
    assert rule.slowest_within_noise([noisy[0], view(1, noisy[1].state.timings.phases, "stuck")]) == []
    assert rule.slowest_within_noise([view(0, phases(0.040, spread=0.01)), view(1, phases(0.041, spread=0.01))]) == []


def test_a_rank_slower_by_5_to_10_percent_and_out_of_its_noise_is_named() -> None:
    # 10% slower measures 10% give or take its noise: naming from 5% names it every time
    eight = steps.scores({0: phases(0.040, spread=0.0002), 1: phases(0.0432, spread=0.0002),
                              2: phases(0.040, spread=0.0002)})
    assert [r for r, s in eight.items() if s.straggler] == [1]
    # below 5%, however quiet, it is within what ranks differ by
    four = steps.scores({0: phases(0.040, spread=0.0001), 1: phases(0.0416, spread=0.0001),
                             2: phases(0.040, spread=0.0001)})
    assert not any(s.straggler for s in four.values())
