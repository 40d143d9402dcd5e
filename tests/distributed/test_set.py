"""``ddpmon set`` on a real 2-rank gloo job (tests/distributed/capture_worker.py, which trains
until told to stop): a hang timeout changed live and used by the watchdog, on one rank or
every rank; invalid values and options that cannot change live refused with their reason,
by the command and by the rank itself; requests that are not the rank's own ignored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpmon.state import settings
from tests.support import harness
from tests.support.live_settings import request, training, wait_until, watchdog_timeout

pytestmark = pytest.mark.timeout(60)


def run_set(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon", "set", str(state_dir), *args],
        cwd=harness.ROOT,
        env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    workdir = tmp_path_factory.mktemp("set")
    # no slow rank; an endpoint each (ephemeral ports)
    with training(workdir, env={"DDPMON_TEST_PORT": "0"}):
        yield workdir


def answer(state_dir: Path, req: settings.Request) -> settings.Status:
    path = settings.status_path(str(state_dir), req.rank, req.nonce)
    wait_until(f"rank {req.rank}'s answer", lambda: os.path.exists(path))
    return settings.read_status(path)


def test_hang_timeout_on_one_rank_is_used_by_its_watchdog(job: Path) -> None:
    state_dir = job / "state"
    before = watchdog_timeout(job, 0)
    done = run_set(state_dir, "hang_timeout=7.5", "--rank", "1")
    assert done.returncode == 0, done.stderr + done.stdout
    assert "rank 1: hang_timeout = 7.5" in done.stdout
    assert "rank 0" not in done.stdout
    wait_until("rank 1's watchdog to use 7.5 s", lambda: watchdog_timeout(job, 1) == 7.5)
    time.sleep(1.5)  # a watchdog pass or more on rank 0
    assert watchdog_timeout(job, 0) == before != 7.5


def test_every_rank_back_to_learned(job: Path) -> None:
    done = run_set(job / "state", "hang_timeout=auto", "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    answers = json.loads(done.stdout)
    assert answers["no_answer"] == []
    assert {r: a["applied"] for r, a in answers["ranks"].items()} == {
        "0": {"hang_timeout": None},
        "1": {"hang_timeout": None},
    }
    wait_until("rank 1's watchdog to learn again", lambda: watchdog_timeout(job, 1) != 7.5)


def test_invalid_value_refused_by_the_command(job: Path) -> None:
    done = run_set(job / "state", "hang_timeout=-3")
    assert done.returncode == 2
    assert "hang_timeout='-3' is not valid: expected seconds >= 0" in done.stderr
    done = run_set(job / "state", "port=9600")
    assert done.returncode == 2
    assert "port is fixed at attach: restart the job with DDPMON_PORT" in done.stderr


def test_option_not_safe_here_refused_by_each_rank(job: Path) -> None:
    # on gloo by default no ddpmon comm hook runs: DDP takes one only before training
    done = run_set(job / "state", "bucket_timing=hook")
    assert done.returncode == 1, done.stderr + done.stdout
    for rank in (0, 1):
        assert f"rank {rank}: bucket_timing refused: no ddpmon comm hook" in done.stdout


def test_rank_checks_a_request_itself(job: Path) -> None:
    """A request written by hand, not by the command: the rank refuses the bad value with
    what it accepts, and applies the good one."""
    state_dir = job / "state"
    req = request(job, 0, hang_timeout="soon", bucket_timing="off")
    settings.write_request(str(state_dir), req)
    status = answer(state_dir, req)
    assert status.rank == 0
    assert status.refused == {
        "hang_timeout": "hang_timeout='soon' is not valid: expected seconds >= 0 (0 = off), "
        "or auto (learned from the step times)"
    }
    assert status.applied == {"bucket_timing": "off"}
    assert harness.states(job)[0]["bucket_timing"] == "off"


def test_requests_not_for_this_process_are_ignored(job: Path) -> None:
    state_dir = job / "state"
    # bound to another process: taken away, never applied, never answered
    req = request(job, 1, hang_timeout="3")
    stale = settings.Request(**{**req.__dict__, "pid": req.pid + 1})
    settings.write_request(str(state_dir), stale)
    path = settings.request_path(str(state_dir), 1)
    wait_until("the rank to take the request away", lambda: not os.path.exists(path))
    time.sleep(1.5)
    assert not os.path.exists(settings.status_path(str(state_dir), 1, stale.nonce))
    assert watchdog_timeout(job, 1) != 3.0
    # a symbolic link to a valid request elsewhere: not followed
    elsewhere = job / "elsewhere.request"
    elsewhere.write_text(json.dumps(req.to_json()))
    os.symlink(elsewhere, path)
    wait_until("the rank to remove the link", lambda: not os.path.lexists(path))
    time.sleep(1.5)
    assert not os.path.exists(settings.status_path(str(state_dir), 1, req.nonce))
    assert watchdog_timeout(job, 1) != 3.0


def series_served(workdir: Path, rank: int) -> set[str]:
    """The series (name and labels) that the rank's endpoint serves now."""
    port = harness.states(workdir)[rank]["port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {line.rpartition(" ")[0] for line in text.splitlines() if line and line[0] != "#"}


def test_metrics_detail_switches_what_the_rank_serves(job: Path) -> None:
    """A 2-rank job serves every series (full, by auto); summary on rank 0 brings its scrape
    within the summary budget of 40 series, rank 1 untouched; full brings them back."""
    full = series_served(job, 0)
    assert len(full) > 60, len(full)
    done = run_set(job / "state", "metrics_detail=summary", "--rank", "0")
    assert done.returncode == 0, done.stderr + done.stdout
    assert "rank 0: metrics_detail = summary (applied" in done.stdout, done.stdout
    summary = series_served(job, 0)
    assert 20 <= len(summary) <= 40, sorted(summary)
    assert any(s.startswith("ddpmon_steps_total{") for s in summary)
    assert len(series_served(job, 1)) > 60
    done = run_set(job / "state", "metrics_detail=full", "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    answers = json.loads(done.stdout)
    assert {r: a["applied"] for r, a in answers["ranks"].items()} == {
        "0": {"metrics_detail": "full"},
        "1": {"metrics_detail": "full"},
    }
    again = series_served(job, 0)
    names = {s.partition("{")[0] for s in again}
    assert len(again) > 60 and {s.partition("{")[0] for s in summary} <= names, len(again)
