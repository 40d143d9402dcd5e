"""Where a straggler's time goes in the user's code, on a real 2-rank gloo job shaped like
nanoGPT (tests/distributed/nanogpt_worker.py): the next batch is fetched between forward and
backward, and rank 1's ``get_batch`` is slow. The doctor names the gap by where it lies and
the function from the rank's own stack samples; ``ddpmon capture --compare`` lists
``get_batch`` first among the Python functions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import harness

pytestmark = pytest.mark.timeout(120)

WORKER = harness.ROOT / "tests" / "distributed" / "nanogpt_worker.py"
WORKER_NAME = "tests/distributed/nanogpt_worker.py"


def line_of(fragment: str) -> int:
    for number, text in enumerate(WORKER.read_text().splitlines(), 1):
        if fragment in text:
            return number
    raise AssertionError(f"{fragment!r} is not in {WORKER}")


def ddpmon(*args: str, timeout: float = 40) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon", *args],
        cwd=harness.ROOT,
        env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """rank 1's get_batch sleeps 20 ms more, twice a step (two micro-steps)."""
    workdir = tmp_path_factory.mktemp("nanogpt")
    procs = harness.start_ranks(
        "1", 2, workdir, args=("0.02",), module="tests.distributed.nanogpt_worker"
    )
    try:
        yield workdir
    finally:
        harness.finish(procs, workdir)


def sampled_straggler(workdir: Path, deadline: float) -> dict[str, Any]:
    """The doctor's straggler finding, once it has the slow rank's stack samples."""
    last = ""
    while time.monotonic() < deadline:
        run = ddpmon("doctor", str(workdir / "state"), "--json")
        last = run.stdout + run.stderr
        if run.returncode == 1:
            report = json.loads(run.stdout)
            for f in report["findings"]:
                if f["kind"] == "straggler" and any("stack samples" in e for e in f["evidence"]):
                    assert report["suspect_ranks"] == [1], report
                    return dict(f)
        time.sleep(1.0)
    raise AssertionError("the doctor never named rank 1 with its stack samples:\n" + last)


def test_the_doctor_names_the_gap_and_the_function_of_the_slow_rank(job: Path) -> None:
    finding = sampled_straggler(job, time.monotonic() + 75)
    where = f"{WORKER_NAME}:{line_of('time.sleep(slow_seconds)')} in get_batch"
    summary = finding["summary"]
    assert summary.startswith("rank 1 is "), summary
    assert "of it between forward and backward: look at " + where in summary, summary
    assert "logging" not in summary and ".item()" not in summary, summary
    (line,) = [e for e in finding["evidence"] if "stack samples" in e]
    assert line.startswith("rank 1: +") and " ms/step between forward and backward, " in line, line
    share = int(line.split(", ")[1].split("%")[0])
    assert share >= 80 and line.endswith(f" stack samples there in {where}"), line
    excess = float(line.split("+")[1].split(" ms")[0])
    assert 25 <= excess <= 80, line  # 2 x 20 ms a step


def test_capture_compare_lists_get_batch_first_among_python_functions(job: Path) -> None:
    run = ddpmon("capture", str(job / "state"), "--rank", "1", "--compare", "0", "--steps", "5")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    header = next(i for i, t in enumerate(lines) if t.startswith("your Python functions where"))
    first = lines[header + 1]
    assert first.startswith("  rank 1: +"), run.stdout
    assert f" ms/step in get_batch at {WORKER_NAME}:{line_of('def get_batch')} (" in first, (
        run.stdout
    )
    ms = float(first.split("+")[1].split(" ms")[0])
    assert ms >= 30, run.stdout  # 2 x 20 ms a step, nearly all of it in time.sleep
