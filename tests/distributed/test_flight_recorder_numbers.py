"""torch's flight-recorder numbers beside ddpmon's own, on a real 2-rank gloo job with
TORCH_FR_BUFFER_SIZE set whose rank 1 is stuck in its data loader (tests/distributed/
hang_worker.py ``stuck``): rank 0 waits in the gradient all-reduce, and the doctor's
evidence gives ddpmon's number and torch's (``collective_seq_id``, which also counts the
collectives DDP's constructor issued before ddpmon attached), the entry's state, and rank
1's last collective the same way."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import harness

pytestmark = pytest.mark.timeout(120)


def test_the_doctor_gives_both_numbers_of_the_collective_a_rank_waits_in(tmp_path: Path) -> None:
    procs = harness.start_ranks(
        "stuck",
        2,
        tmp_path,
        {"TORCH_FR_BUFFER_SIZE": "64"},
        ("1", "4"),
        "tests.distributed.hang_worker",
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            states = harness.states(tmp_path)
            if len(states) == 2 and all(
                (s.get("hang") or {}).get("flight_recorder") for s in states.values()
            ):
                break
            assert time.monotonic() < deadline, harness.describe(harness.collect(procs, tmp_path))
            time.sleep(0.2)
        fr = states[0]["hang"]["flight_recorder"]
        entries = [e for e in fr["entries"] if e["process_group"][0] == "0"]
        assert len(fr["entries"]) <= 32 and fr["total_entries"] <= 64  # TORCH_FR_BUFFER_SIZE
        waited = states[0]["hang"]["in_flight"][0]  # ddpmon's own record
        open_entries = [e for e in entries if not e["retired"]]  # gloo: retired once completed
        open_entry = open_entries[0]
        assert (
            open_entry["profiling_name"] == "gloo:all_reduce" and open_entry["state"] == "scheduled"
        )
        ours, torchs = waited["seq"], open_entry["collective_seq_id"]
        # DDP's constructor (parameter check, module state broadcast) ran before ddpmon
        # attached: torch counts them, ddpmon does not
        before = [e for e in entries if e["collective_seq_id"] < torchs - ours + 1]
        assert torchs > ours and len(before) == torchs - ours, (ours, torchs, entries)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddpmon",
                "doctor",
                str(tmp_path / "state"),
                "--json",
                "--no-stacks",
            ],
            cwd=harness.ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        report = json.loads(done.stdout)
        assert report["verdict"] == "hang" and report["suspect_ranks"] == [1], report
        evidence = [line for f in report["findings"] for line in f["evidence"]]
        d = torchs - ours
        line = next(x for x in evidence if x.startswith("rank 0 ") and "has waited" in x)
        assert f" in all_reduce #{ours} (group 0, gradient bucket " in line, line
        assert line.endswith(
            f"(flight recorder: pg 0 seq {torchs}, enqueued, not completed; torch counts {d} "
            f"collective{'s' if d != 1 else ''} of the group that ddpmon did not see (before "
            "attach, or torch's own))"
        ), line
        last = states[1]["hang"]["last_collective"]
        stuck = next(x for x in evidence if x.startswith("rank 1 (host"))
        assert re.search(
            rf"; its last collective was all_reduce #{last['seq']} \(group 0, .*\) \(flight recorder: "
            rf"pg 0 seq {last['seq'] + d}, completed; torch counts {d} ",
            stuck,
        ), stuck
    finally:
        harness.stop(procs)
