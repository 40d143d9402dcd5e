"""Steps counted exactly and step parts attributed in real gloo DDP jobs; stragglers of every
part named with their cause, and jittery healthy jobs left healthy.

Two jobs keep this under a minute: the README's loop (and its variants) at 2 ranks, and one
job of segments (one straggling part each, and jitter) at 3 ranks, whose state files the
doctor reads live. The randomized accuracy runs (10% stragglers, 2-4 ranks, many seeds) are
benchmarks/stragglers.py; their figures are in docs/performance.md.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from ddpmon import steps as scoring
from ddpmon.state import records
from ddpmon.state.schema import StepParts
from tests.support import harness
from tests.support.torch_features import COMPILE_CHECK

PARTS = ("data_wait", "h2d", "forward", "backward", "exposed_comm", "optimizer", "other")


def run(
    scenario: str, world: int, tmp_path: Path, *args: str, timeout: float = 120.0
) -> list[harness.RankResult]:
    return harness.run_ranks(
        scenario,
        world,
        tmp_path,
        timeout=timeout,
        args=args,
        module="tests.distributed.steps_worker",
    )


def test_readme_loop_counts_64_of_64_steps_and_its_parts_sum(tmp_path: Path) -> None:
    for r in run("readme_example", 2, tmp_path):
        out = r.result
        # Counted at the optimizer step: the last one at once, nothing after the loop.
        assert (out["after_loop"], out["after_eval"], out["after_detach"]["step"]) == (64, 64, 64)
        assert out["eval_heartbeat"] is True
        rows = out["rows"]
        assert [row["step"] for row in rows] == list(range(1, 65))
        assert rows[-1]["step_seconds"] < 0.4, rows[-1]  # the 0.5 s after the loop is not in it
        for row in rows:
            parts = sum(row[p + "_seconds"] or 0.0 for p in PARTS)
            assert parts == pytest.approx(row["step_seconds"], abs=1e-6), row
            assert (
                row["optimizer_seconds"] > 0
                and row["forward_seconds"] > 0
                and row["micro_steps"] == 1
            )
            assert row["h2d_seconds"] is None
        # Steps follow one another: each starts where the previous one ended.
        for a, b in zip(rows, rows[1:]):
            assert b["start_unix"] == pytest.approx(a["end_unix"], abs=1e-3)

        # No torch.optim: the synchronised end of backward ends the step; 64 of 64 at detach.
        assert out["manual_sgd"]["step"] == 64
        sgd_rows = out["manual_sgd_rows"]
        assert len(sgd_rows) == 64 and sgd_rows[-1]["step_seconds"] < 0.4
        assert all(row["optimizer_seconds"] == 0 for row in sgd_rows)

        acc = out["accumulation"]
        assert (acc["step"], acc["micro_steps"]) == (5, 15)
        assert acc["timings"]["parts"]["micro_steps"] == 3.0
        if COMPILE_CHECK:  # (torch 2.2: ddpmon's compile support is off, docs/install.md)
            assert out["compiled"] == 6


def scores_of(segment_by_rank: dict[int, dict[str, Any]]) -> dict[int, scoring.Score]:
    return scoring.scores(
        {r: records.load(StepParts, s["parts"]) for r, s in segment_by_rank.items()}
    )


def test_stragglers_of_every_part_are_named_with_their_cause_and_jitter_is_healthy(
    tmp_path: Path,
) -> None:
    kinds = ("jitter", "data_wait", "forward", "backward", "optimizer", "other")
    results = run(
        "stragglers", 3, tmp_path, "2", "0.02", "24", ",".join(kinds), "data_wait", timeout=150
    )
    by_rank = {r.rank: r.result["segments"] for r in results}
    for i, kind in enumerate(kinds):
        scores = scores_of({rank: segs[i] for rank, segs in by_rank.items()})
        named = {r: (s.cause, round(s.score, 2)) for r, s in scores.items() if s.straggler}
        if kind == "jitter":
            assert named == {}, (kind, scores)
        else:
            assert list(named) == [2], (kind, scores)
            assert named[2][0] == kind, (kind, scores)
            assert scores[2].shares[kind] >= 0.5
    # The doctor on the live job, after the data-wait segment: rank 2, for its data loader.
    doctor = by_rank[0][kinds.index("data_wait")]["doctor"]
    report = doctor["report"]
    assert doctor["code"] == 1, doctor
    assert (report["verdict"], report["suspect_ranks"]) == ("straggler", [2]), report
    finding = next(f for f in report["findings"] if f["kind"] == "straggler")
    assert finding["ranks"] == [2]
    # named once its gap lasted (its segment is that long), so its stack was sampled meanwhile:
    # the fix names the line in steps_worker.py where it sleeps, or its data loader
    summary = finding["summary"]
    assert summary.startswith("rank 2 is") and "over its last" in summary, summary
    assert "in data wait: look at its data loader" in summary or (
        "in data wait: look at tests/distributed/steps_worker.py:" in summary
    ), summary
    # and how to see where its time goes, beside a healthy peer, in this state directory
    assert re.search(
        r"To see where its time goes: ddpmon capture \S+/state --rank 2 --compare [01]$",
        finding["fix"],
    )
