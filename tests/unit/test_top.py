"""``ddpmon top``'s rendering of state files."""

from __future__ import annotations

from ddpmon.cli.top import render


def test_an_empty_bucket_table_says_why() -> None:
    rank = {"rank": 0, "step": 5, "phase": "forward", "buckets": []}
    off = render([dict(rank, bucket_timing="off")], buckets=True)
    assert "bucket timing is off (the default on gloo" in off and "bucket_timing='hook'" in off
    early = render([dict(rank, bucket_timing="hook")], buckets=True)
    assert "none seen yet" in early
    assert "bucket timing is off" not in render([dict(rank, bucket_timing="off")], buckets=False)


def test_parts_carrying_the_last_steps_one_by_one() -> None:
    """A state file's ``timings.parts.recent`` (the last steps, which the straggler score
    compares step by step) is read as a record, as the doctor reads it."""
    from ddpmon.state import records, schema

    n = 40
    recent = schema.RecentSteps(
        step=list(range(n)),
        busy_seconds=[0.09] * n,
        data_wait_seconds=[0.0] * n,
        h2d_seconds=[0.0] * n,
        forward_seconds=[0.03] * n,
        backward_seconds=[0.05] * n,
        optimizer_seconds=[0.01] * n,
        other_seconds=[0.0] * n,
    )
    parts = records.dump(
        schema.StepParts(steps=n, step_seconds=0.1, busy_seconds=0.09, recent=recent)
    )
    text = render(
        [{"rank": r, "step": n, "phase": "forward", "timings": {"parts": parts}} for r in range(3)]
    )
    assert "where the time goes" in text and "slower" in text
    from ddpmon import steps

    header = next(
        line for line in text.splitlines() if line.lstrip().startswith("rank") and "busy" in line
    )
    assert header.split()[1:-4] == [p.column for p in steps.PART_TABLE]  # one column per part
    # how much slower, with the steps its window holds: the same figure as the doctor's
    lines = text.splitlines()
    row = next(line for line in lines[lines.index(header) :] if line.split()[:1] == ["0"])
    assert row.split()[-1] == "+0%/20", row
    assert header.split()[-2:] == ["slower/steps", "straggler"], header
