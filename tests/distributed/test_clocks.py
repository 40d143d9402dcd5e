"""Ranks whose clocks are off, in real gloo jobs: rank 1's clock 10 s ahead, rank 2's 7 s
behind (shifted inside their processes, tests/support/clock_shift.py). Each rank measures
its offset from rank 0's through the job's store at start; the doctor and the report put
every time on one clock with it, so no verdict, culprit, hang age or duration moves, also
where modification times mislead (files copied one by one, as a collector does)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import clock_shift, harness

pytestmark = pytest.mark.timeout(150)

SHIFTS = {1: 10.0, 2: -7.0}
SITE = harness.ROOT / "tests" / "support" / "inject_site"


def env() -> dict[str, str]:
    return {
        clock_shift.VARIABLE: clock_shift.value(SHIFTS),
        "PYTHONPATH": os.pathsep.join([str(SITE), str(harness.ROOT)]),
    }


def command(*args: str) -> tuple[int, dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "ddpmon", *args, "--json"],
        cwd=harness.ROOT,
        env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout, out.stderr
    return out.returncode, json.loads(out.stdout)


def wait_for(what: str, check: Any, procs: list[subprocess.Popen], workdir: Path) -> None:
    deadline = time.monotonic() + 90
    while not check():
        if time.monotonic() > deadline:
            harness.stop(procs)
            raise AssertionError(
                f"timed out waiting for {what}:\n"
                + harness.describe(harness.collect(procs, workdir))
            )
        time.sleep(0.1)


def copied_one_by_one(state_dir: Path, to: Path) -> Path:
    """The state files copied in rank order, half a second apart: each file's modification
    time is now when it was copied, not when its rank wrote it."""
    to.mkdir()
    for path in sorted(state_dir.glob("rank-*.json")):
        shutil.copy(path, to / path.name)
        time.sleep(0.5)
    return to


def measured_offsets(states: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1, 2):
        clock = states[rank]["clock"]
        assert clock is not None, states[rank]
        shift = SHIFTS.get(rank, 0.0)
        assert abs(clock["offset_seconds"] - shift) <= clock["delay_seconds"] / 2 + 0.01, clock


def test_ranks_failing_in_turn_keep_their_order_and_the_run_its_length(tmp_path: Path) -> None:
    """Rank 2 (7 s behind) raises first, rank 1 (10 s ahead) 2 s later, rank 0 then fails on
    the closed connection. The doctor names rank 2, from the state files and from copies of
    them (copied in rank order, so their modification times put rank 1's end first); the
    report's run lasts what rank 0's clock says, not 17 s more."""
    began = time.time()
    procs = harness.start_ranks(
        "fail_in_turn", 3, tmp_path, env(), ("2", "1", "2.0"), "tests.distributed.clock_worker"
    )
    try:
        wait_for(
            "every rank to end", lambda: all(p.poll() is not None for p in procs), procs, tmp_path
        )
    finally:
        harness.stop(procs)
    wall = time.time() - began
    states = harness.states(tmp_path)
    measured_offsets(states)
    state_dir = tmp_path / "state"
    for where in (state_dir, copied_one_by_one(state_dir, tmp_path / "copied")):
        code, report = command("doctor", str(where))
        assert code == 1 and report["verdict"] == "dead_rank", (where, report)
        assert report["suspect_ranks"] == [2], (where, report["findings"][0])
        summary = report["findings"][0]["summary"]
        assert summary == "rank 2 crashed first; ranks 0, 1 ended after it", summary
    _, run = command("report", str(state_dir))
    r0 = states[0]
    own = r0["last_progress_unix"] - r0["started_unix"]  # rank 0's span, on its own clock
    duration = run["duration_seconds"]
    assert own - 1.0 <= duration <= own + 1.0 and duration < wall, (duration, own, wall)


def test_hang_ages_and_the_culprit_do_not_move_with_the_clocks(tmp_path: Path) -> None:
    """Rank 1 (10 s ahead) never returns from its data loader; ranks 0 and 2 (7 s behind)
    wait in the same all-reduce: the doctor names rank 1, and both waits are as old as they
    really are, from the files and from copies."""
    procs = harness.start_ranks(
        "stuck", 3, tmp_path, env(), ("1", "4"), "tests.distributed.hang_worker"
    )

    def hung() -> bool:
        s = harness.states(tmp_path)
        return len(s) == 3 and all(d.get("hang") and d.get("clock") for d in s.values())

    try:
        wait_for("every rank's hang report and clock", hung, procs, tmp_path)
        states = harness.states(tmp_path)
        measured_offsets(states)
        state_dir = tmp_path / "state"
        for where in (state_dir, copied_one_by_one(state_dir, tmp_path / "copied")):
            issued = states[0]["in_flight"][0]["issued_unix"]  # rank 0's clock is true
            asked = time.time() - issued
            code, report = command("doctor", str(where))
            real_age = time.time() - issued  # (the doctor's moment lies in between)
            assert code == 1 and report["verdict"] == "hang", report
            assert report["suspect_ranks"] == [1], report["findings"][0]
            ranks = {r["rank"]: r for r in report["ranks"]}
            ages = [ranks[r]["waiting_in"]["age_seconds"] for r in (0, 2)]
            for age in ages:
                assert asked - 1.5 <= age <= real_age + 1.5, (where, ages, asked, real_age)
            assert abs(ages[0] - ages[1]) < 1.0, (where, ages)
    finally:
        harness.stop(procs)
