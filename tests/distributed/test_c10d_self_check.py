"""c10d bucket timing that finds nothing to time turns itself off, through the monitor: the
mode, the state file's note, ``ddpmon_rank_info`` and one log line change, the listener is
stopped, and training goes on. A real DDP job (gloo, one rank) with c10d's completion hook
stood in for (c10d_self_check_job.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.harness import run_ranks

pytestmark = pytest.mark.timeout(120)

REASONS = {
    "silent": "c10d's completion hook gave no WorkInfo in the first 20 steps",
    "split": (
        "none of the first 20 steps could be matched to DDP's buckets (8 all-reduce(s) on "
        "DDP's process group during backward for 4 bucket(s))"
    ),
}


def test_c10d_timing_that_times_nothing_turns_itself_off(tmp_path: Path) -> None:
    (rank,) = run_ranks(
        "", 1, tmp_path, module="tests.distributed.c10d_self_check_job", timeout=100
    )
    for kind, reason in REASONS.items():
        out = rank.result[kind]
        note = (
            f"per-bucket timing from c10d is off: {reason}; bucket_timing='hook' times buckets "
            "instead"
        )
        assert out["modes"] == ["c10d", "off"], kind
        assert out["notes"]["bucket_timing"] == note
        assert out["state_mode"] == "off" and out["state_notes"]["bucket_timing"] == note
        assert len(out["info"]) == 1 and 'bucket_timing="off"' in out["info"][0], out["info"]
        assert out["off_lines"] == [f"ddpmon: rank 0: {note}"]
        assert out["warnings"] == [], "one line, not a second warning beside it"
        assert (out["listening"], out["listeners_left"]) == (1, 0)
        assert out["steps"] == 25, "training and step timing go on"
