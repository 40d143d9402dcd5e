"""``ddpmon capture`` on real 2-rank gloo jobs (tests/distributed/capture_worker.py): a live
rank's steps profiled while the job trains on, a slow rank compared with a healthy one, and
the captures that cannot be done (a rank the job lacks, a dead rank, a hung rank, torch's
profiler already in use, a request left by another run) refused with their reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ddpmon.state import captures, files
from tests.support import harness

pytestmark = pytest.mark.timeout(120)  # (a module fixture's start-up counts in its first test)

WORKER = harness.ROOT / "tests" / "distributed" / "capture_worker.py"


def start(workdir: Path, *args: str) -> list[subprocess.Popen]:
    procs = harness.start_ranks(
        args[0], 2, workdir, args=args[1:], module="tests.distributed.capture_worker"
    )
    wait_for(
        "both ranks to train",
        lambda: all(step(workdir, r) >= 10 for r in (0, 1)),
        procs,
        workdir,
        timeout=60,  # torch's start-up on a loaded machine
    )
    return procs


def step(workdir: Path, rank: int) -> int:
    return harness.states(workdir).get(rank, {}).get("step", 0)


def wait_for(
    what: str,
    check: Callable[[], bool],
    procs: list[subprocess.Popen],
    workdir: Path,
    timeout: float = 20.0,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    harness.stop(procs)
    raise AssertionError(
        f"timed out waiting for {what}:\n" + harness.describe(harness.collect(procs, workdir))
    )


def finish(procs: list[subprocess.Popen], workdir: Path) -> list[harness.RankResult]:
    """Ask the ranks to stop together, and wait (bounded) for them."""
    (workdir / "stop").touch()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    harness.stop(procs)
    return harness.collect(procs, workdir)


def capture(state_dir: Path, *args: str, timeout: float = 25) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon", "capture", str(state_dir), *args],
        cwd=harness.ROOT,
        env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def def_line(fragment: str) -> int:
    for number, text in enumerate(WORKER.read_text().splitlines(), 1):
        if fragment in text:
            return number
    raise AssertionError(f"{fragment!r} is not in {WORKER}")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[subprocess.Popen]]]:
    """A job whose rank 1 runs an extra matrix product in its forward."""
    workdir = tmp_path_factory.mktemp("capture-job")
    procs = start(workdir, "1")
    yield workdir, procs
    finish(procs, workdir)


def test_capture_writes_a_trace_of_aten_ops_and_the_job_trains_on(
    job: tuple[Path, list[subprocess.Popen]], tmp_path: Path
) -> None:
    workdir, procs = job
    out = tmp_path / "f.json"
    run = capture(workdir / "state", "--rank", "1", "--steps", "3", "-o", str(out))
    assert run.returncode == 0, run.stderr
    assert "rank 1: steps " in run.stdout and "(3 steps)" in run.stdout and str(out) in run.stdout
    trace = json.loads(
        out.read_text(errors="replace"), strict=False
    )  # (as profiles.read: torch 2.2's names)
    ops = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "cpu_op"}
    assert {"aten::mm", "aten::addmm", "c10d::allreduce_"} <= ops, sorted(ops)
    assert (
        sum(1 for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")) == 3
    )
    assert any(e.get("cat") == "python_function" for e in trace["traceEvents"])  # call sites
    assert (trace["ddpmon"]["rank"], trace["ddpmon"]["steps"]) == (1, 3)
    done = [c for c in captures.listing(str(workdir / "state")) if c.rank == 1 and c.trace_path]
    assert (
        done
        and done[-1].status.state == "ok"
        and done[-1].status.last_step == done[-1].status.first_step + 2
    )
    assert os.stat(done[-1].trace_path).st_mode & 0o077 in (0, 0o040)  # the state files' mode
    assert not os.path.exists(captures.request_path(str(workdir / "state"), 1))
    after = done[-1].status.last_step
    wait_for(
        "rank 1 to train on after its capture",
        lambda: step(workdir, 1) >= after + 10,
        procs,
        workdir,
    )
    # the report lists it, with its trace
    report = subprocess.run(
        [sys.executable, "-m", "ddpmon", "report", "--json", str(workdir / "state")],
        cwd=harness.ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0, report.stderr
    listed = [
        c for c in json.loads(report.stdout)["captures"] if c["rank"] == 1 and c["state"] == "ok"
    ]
    assert listed and listed[-1]["trace"] == done[-1].trace_path
    assert (listed[-1]["first_step"], listed[-1]["last_step"]) == (
        done[-1].status.first_step,
        after,
    )


def test_compare_names_the_slow_ranks_extra_op_first_with_its_call_site(
    job: tuple[Path, list[subprocess.Popen]],
) -> None:
    workdir, _ = job
    run = capture(workdir / "state", "--rank", "1", "--compare", "0", "--steps", "5")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    first = lines[lines.index("where rank 1 spends more than rank 0:") + 1]
    forward = def_line("def forward(self, x: torch.Tensor)")
    assert first.startswith("  rank 1: +") and " ms/step in aten::mm (" in first, run.stdout
    assert first.endswith(f"called from forward (tests/distributed/capture_worker.py:{forward})"), (
        run.stdout
    )
    assert (
        "rank 0: steps " in run.stdout
        and "note: the ranks recorded different steps" not in run.stdout
    )


def test_a_rank_the_job_does_not_have_is_named(job: tuple[Path, list[subprocess.Popen]]) -> None:
    workdir, _ = job
    run = capture(workdir / "state", "--rank", "7")
    assert run.returncode == 2
    assert "rank 7 is not in this job" in run.stderr and "ranks 0, 1 (world size 2)" in run.stderr


def test_a_request_left_by_another_run_is_ignored(job: tuple[Path, list[subprocess.Popen]]) -> None:
    workdir, procs = job
    state_dir = str(workdir / "state")
    live = files.read(files.path_for(state_dir, 1))
    nonce = uuid.uuid4().hex[:16]
    now = time.time()
    old = captures.Request(
        nonce,
        1,
        live.job,
        live.pid + 100000,
        (live.started_unix or now) - 3600,
        2,
        None,
        now,
        now + 60,
    )  # an earlier run's: another pid, another attach time
    path = captures.write_request(state_dir, old)
    wait_for(
        "rank 1 to remove the stale request",
        lambda: not os.path.exists(path),
        procs,
        workdir,
        timeout=6,
    )
    time.sleep(1.5)  # (a request taken would be answered at once)
    assert not os.path.exists(captures.status_path(state_dir, 1, nonce))
    assert not os.path.exists(os.path.join(state_dir, captures.trace_name(1, nonce)))


def test_a_busy_profiler_fails_the_capture_and_leaves_it_alone(tmp_path: Path) -> None:
    procs = start(tmp_path, "-1", "profiler")  # rank 1 trains under a torch.profiler of its own
    try:
        run = capture(tmp_path / "state", "--rank", "1", "--steps", "2")
        assert run.returncode == 3, run.stdout + run.stderr
        assert (
            "rank 1: profiler busy: torch's profiler is already running in this process"
            in run.stderr
        )
        failed = [c for c in captures.listing(str(tmp_path / "state")) if c.rank == 1]
        assert [c.status.state for c in failed] == ["error"] and "profiler busy" in failed[
            0
        ].status.reason
        before = step(tmp_path, 1)
        wait_for("rank 1 to train on", lambda: step(tmp_path, 1) >= before + 10, procs, tmp_path)
    finally:
        results = finish(procs, tmp_path)
    assert [r.returncode for r in results] == [0, 0], harness.describe(results)
    assert (
        results[1].result["user_profiler_on"] and results[1].result["user_profiler_ops"] > 0
    )  # still whole
    assert "no active profiling session" not in results[1].stderr
    # the job has ended: its ranks detached
    run = capture(tmp_path / "state", "--rank", "1")
    assert run.returncode == 2 and "rank 1 is not alive: it detached from ddpmon" in run.stderr, (
        run.stderr
    )


def test_a_frozen_rank_a_hung_one_and_a_dead_one_are_told_apart(tmp_path: Path) -> None:
    procs = start(tmp_path, "1")
    try:
        os.killpg(procs[1].pid, signal.SIGSTOP)  # rank 1 frozen, its ddpmon threads too
        # rank 0 waits for rank 1 in its next all-reduce: no step boundary comes (both asked at once)
        hung, frozen = (
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ddpmon",
                    "capture",
                    str(tmp_path / "state"),
                    "--rank",
                    rank,
                    *more,
                ],
                cwd=harness.ROOT,
                env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank, more in (("0", ("--timeout", "2")), ("1", ()))
        )
        out, err = hung.communicate(timeout=20)
        assert hung.returncode == 1, out + err
        assert (
            "rank 0 did not reach a step boundary within 2 s: it may be hung; run ddpmon doctor"
            in err
        )
        out, err = frozen.communicate(timeout=20)
        assert frozen.returncode == 1, out + err
        assert "rank 1 did not pick up the request within" in err and "the process is frozen" in err
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait(5)
        run = capture(tmp_path / "state", "--rank", "1")
        assert run.returncode == 2, run.stdout + run.stderr
        assert "rank 1 is not alive: its process is gone (pid" in run.stderr
    finally:
        harness.stop(procs)
