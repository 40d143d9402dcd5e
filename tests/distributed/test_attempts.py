"""Restarted jobs under ``ddpmon run`` (torchrun, 2 ranks, --max-restarts=1): a stalled rank
ended by hang_action=abort, a rank that raises, and every attempt kept apart."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpmon.doctor import examine
from tests.scenarios.runner import Scenario
from tests.scenarios.runner import run as run_scenario

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("restart_train.py"))
TIMEOUT = 150
"""Seconds the restarted job may take: two attempts, each starting torchrun's agent and two
ranks that import torch, which on the 2-core machine beside a loaded suite took over a minute
(under 20 s quiet); the job's own hang timeout and abort are asserted from its records."""


def ddpmon_run(
    tmp_path: Path, *options: str, fault: str
) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    (tmp_path / "out").mkdir()
    started = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpmon",
            "run",
            "--port",
            "-1",
            "--state-dir",
            str(tmp_path / "state"),
            "--job",
            "restarted",
            *options,
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            SCRIPT,
            str(tmp_path / "out"),
            "--fault",
            fault,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    return proc, started


def state(path: Path) -> dict:
    return json.loads(path.read_text())


def test_a_stalled_rank_is_ended_and_the_next_attempt_completes(tmp_path: Path) -> None:
    proc, started = ddpmon_run(
        tmp_path, "-o", "hang_timeout=3", "-o", "hang_action=abort", fault="stall"
    )
    out, states = tmp_path / "out", tmp_path / "state"
    stalled = float((out / "stalled-1").read_text())
    first = (
        states / "attempt-0" if (states / "attempt-0").exists() else states
    )  # moved once attempt 1 attaches
    ended = state(first / "rank-1.json")["exit"]
    assert ended["how"] == "hang_abort" and ended["code"] == 87 and ended["culprits"] == [1], (
        proc.stderr[-3000:]
    )
    assert ended["unix"] - stalled < 3 + 10, ended
    assert "ends itself after a proven hang" in proc.stderr
    assert "gloo backend has no abort" in proc.stderr
    assert "failed (exitcode: 87)" in proc.stderr  # the launcher saw ddpmon's exit status
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "done-0-1").exists() and (out / "done-1-1").exists()
    assert [state(states / f"rank-{r}.json")["attempt"] for r in (0, 1)] == [1, 1]
    d = examine(str(states), live_stacks=False)
    assert d.verdict == "healthy"
    assert [(a["attempt"], a["culprit_ranks"]) for a in d.attempts] == [(0, [1])]
    assert "ended by ddpmon after a hang" in d.attempts[0]["ended"]


def test_a_rank_that_raises_and_the_attempts_told_apart(tmp_path: Path) -> None:
    proc, _ = ddpmon_run(tmp_path, fault="raise")
    assert proc.returncode == 0, proc.stderr[-3000:]
    states = tmp_path / "state"
    assert (
        state(states / "attempt-0" / "rank-1.json")["exit"]["exception"]
        == "RuntimeError: bad batch at step 5"
    )
    assert state(states / "rank-1.json")["exit"]["exception"] is None
    d = examine(str(states), live_stacks=False)
    assert d.verdict == "healthy"
    (a,) = d.attempts
    assert (
        a["attempt"] == 0 and a["culprit_ranks"] == [1] and "RuntimeError: bad batch" in a["ended"]
    )
    report = subprocess.run(
        [sys.executable, "-m", "ddpmon", "doctor", "--no-stacks", str(states)],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert "earlier attempts:" in report.stdout and "attempt 0: rank 1 failed" in report.stdout, (
        report.stdout
    )
    summary = subprocess.run(
        [sys.executable, "-m", "ddpmon", "report", "--json", str(states)],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    (attempt,) = json.loads(summary.stdout)["attempts"]
    assert attempt["culprit_ranks"] == [1] and attempt["lost_seconds"] is not None, summary.stdout[
        -2000:
    ]
    assert (
        "attempts: 2; before this one:" in proc.stderr and "ddpmon run: 2 attempts" in proc.stderr
    )
    page = subprocess.run(
        [sys.executable, "-m", "ddpmon", "report", "-o", "-", str(states)],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert (
        "<h2>Attempts</h2>" in page.stdout
        and 'data-attempt="0">attempt 0: rank 1 failed' in page.stdout
    )
    top = subprocess.run(
        [sys.executable, "-m", "ddpmon", "top", "--once", str(states)],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert top.stdout.startswith("job restarted  world size 2  attempt 1  "), top.stdout


def test_report_never_aborts_a_stall(tmp_path: Path) -> None:
    """hang_action=report: the stall is reported and the job is not ended by ddpmon (the
    test ends it)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddpmon",
            "run",
            "--port",
            "-1",
            "--state-dir",
            str(tmp_path / "state"),
            "--job",
            "kept",
            "-o",
            "hang_timeout=2",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            SCRIPT,
            str(tmp_path),
            "--fault",
            "stall",
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
    )
    try:
        rank_1 = tmp_path / "state" / "rank-1.json"
        deadline = time.time() + 50  # a busy machine starts torchrun and its ranks slowly
        while time.time() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                if state(rank_1).get("hang"):
                    break
            time.sleep(0.2)
        with pytest.raises(
            subprocess.TimeoutExpired
        ):  # the hang reported, still waiting: nothing ended it
            proc.wait(timeout=8)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        for path in (tmp_path / "state").glob(
            "rank-*.json"
        ):  # torchrun's workers have sessions of their own
            try:
                os.kill(state(path)["pid"], signal.SIGKILL)
            except (OSError, ValueError, KeyError):
                pass
    files = sorted((tmp_path / "state").glob("rank-*.json"))
    assert [f.name for f in files] == ["rank-0.json", "rank-1.json"]
    assert not (tmp_path / "state" / "attempt-0").exists()
    data = state(tmp_path / "state" / "rank-1.json")
    assert data["hang"] is not None and (
        data["exit"] is None or data["exit"]["how"] != "hang_abort"
    )


@pytest.mark.parametrize("kind", ["evaluation", "checkpoint_barrier", "post_loop"])
def test_busy_work_is_never_aborted(kind: str, tmp_path: Path) -> None:
    outcome = run_scenario(
        Scenario(kind, 2, 1, 3),
        tmp_path,
        timeout=55.0,
        env={"DDPMON_HANG_ACTION": "abort", "DDPMON_HANG_TIMEOUT": "2"},
    )
    assert outcome.right, f"{kind}: {outcome.verdict} {outcome.suspects}: {outcome.summary}"
    for path in (tmp_path / "state").glob("rank-*.json"):
        ended = state(path)["exit"]
        assert ended is not None and ended["how"] != "hang_abort" and not ended["code"], ended
    logs = " ".join(p.read_text() for p in tmp_path.glob("stderr-*.txt"))
    assert "ends itself" not in logs, logs[-3000:]
