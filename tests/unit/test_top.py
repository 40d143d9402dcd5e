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
