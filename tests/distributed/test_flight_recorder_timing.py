"""Bucket timing from torch's flight recorder on a real gloo job: torch 2.13 to 2.15 record
gloo's collectives there (sequence, op, sizes, when issued) but never how long they ran, so
the source reads DDP's all-reduces from the real recorder, finds no duration and turns itself
off, saying why, in the log, the state and ``ddpmon_rank_info``; training is unchanged. The
durations NCCL's recorder carries: tests/gpu/test_cuda_timing.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.harness import run_ranks

pytestmark = pytest.mark.timeout(120)

NOTE = re.compile(
    r"per-bucket timing from flight_recorder is off: torch's flight recorder recorded (\d+) all-reduce\(s\) "
    r"of DDP's process group, none with its duration \(this backend's recorder keeps when each was issued, "
    r"not how long it ran\); bucket_timing='hook' times buckets instead"
)


def test_gloo_records_no_duration_and_the_source_says_so(tmp_path: Path) -> None:
    for r in run_ranks("flight_recorder_timing", 2, tmp_path, timeout=100):
        out = r.result
        assert out["modes"] == ["flight_recorder", "off"], out
        found = NOTE.fullmatch(out["notes"]["bucket_timing"])
        assert found, out["notes"]
        # each all-reduce of the group counted once: the watched model's and the plain one's
        # beside it (the same group), no other collective
        assert 20 <= int(found.group(1)) <= 2 * out["steps"] * out["buckets"], (found.group(1), out)
        assert out["off_lines"] == [f"ddpmon: rank {r.rank}: {out['notes']['bucket_timing']}"]
        assert len(out["info"]) == 1 and 'bucket_timing="off"' in out["info"][0], out["info"]
        assert out["max_diff"] == 0.0, "gradients as without ddpmon"
