"""A fixed-seed sample of the randomized fault scenarios (tests/scenarios/runner.py): real
gloo jobs that die under mp.spawn, all-reduce mismatched sizes, wait in a barrier while one
rank writes a checkpoint, or have uneven inputs (two ranks, one with fewer batches; three,
one with a batch more), and a tutorial's loader peeked before its loop (no finding above
info). ``benchmarks/doctor_accuracy.py N`` runs N random ones."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from tests.scenarios.runner import Scenario, draw, run

SEED = 2026
CI_WORLD = {
    "spawn_exception": 2,
    "size_mismatch": 3,
    "checkpoint_barrier": 2,
    "uneven": 2,
    "uneven_more": 3,
    "peek": 2,
}
"""World sizes kept small in CI (start-up dominates); the benchmark draws 2-4."""


def _sample(i: int, kind: str) -> Scenario:
    s = draw(random.Random(SEED + i), [kind])
    world = CI_WORLD[kind]
    return dataclasses.replace(s, world=world, culprit=s.culprit % world)


SAMPLE = [_sample(i, kind) for i, kind in enumerate(CI_WORLD)]


@pytest.mark.parametrize("scenario", SAMPLE, ids=[s.kind for s in SAMPLE])
def test_the_doctor_is_right(scenario, tmp_path: Path) -> None:
    # a 2 s hang timeout: the checkpoint's 9 s are past it, yet no watchdog may call it a hang
    env = {"DDPMON_HANG_TIMEOUT": "2"} if scenario.kind == "checkpoint_barrier" else None
    outcome = run(scenario, tmp_path, timeout=90.0, env=env)
    assert outcome.right, f"{scenario}: {outcome.verdict} {outcome.suspects}: {outcome.summary}"
    d = outcome.diagnosis
    first = d.findings[0]
    if scenario.kind == "spawn_exception":
        # torch's _wrap turns the exception into sys.exit(1): the record still names it
        culprit = next(v for v in d.ranks if v.rank == scenario.culprit)
        assert culprit.ending.exception == "RuntimeError: batch 17 has NaN labels"
        assert culprit.ending.where.endswith("in misbehave") and culprit.ending.code == 1
        assert first.kind == "dead_rank" and "RuntimeError: batch 17 has NaN labels" in first.fix
    elif scenario.kind == "size_mismatch":
        assert first.kind == "mismatch"
        assert "1000 elements" in " ".join([first.summary, *first.evidence])
        assert "worker.py" in first.summary
    elif scenario.kind == "uneven":
        # two ranks, no majority: the one with more batches, in DDP's all-reduce while the
        # other waits in the final barrier, is named from where each one stands
        more, fewer = 1 - scenario.culprit, scenario.culprit
        assert (first.kind, d.suspect_ranks) == ("mismatch", [more])
        assert first.summary.startswith(
            f"rank {more} has more batches than rank {fewer} (uneven inputs)"
        )
        assert first.fix.startswith("Give every rank the same number of batches")
    elif scenario.kind == "uneven_more":
        others = [r for r in range(scenario.world) if r != scenario.culprit]
        assert (first.kind, d.suspect_ranks) == ("mismatch", [scenario.culprit])
        assert first.summary.startswith(
            f"rank {scenario.culprit} has more batches than ranks {others[0]}, {others[1]}"
        )
    else:
        assert d.verdict == "healthy"
        logs = " ".join(p.read_text() for p in tmp_path.glob("stderr-*.txt"))
        assert "made no progress" not in logs, logs[-3000:]
