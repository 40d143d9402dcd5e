"""``ddpmon preflight`` and ``ddpmon run --preflight`` on this machine, as a user runs them:
bad usage is refused before anything starts; a healthy node lets the job run after it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.commands import ROOT, env

pytestmark = pytest.mark.timeout(120)


def ddpmon(*args: str, cwd: Path = ROOT, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon", *args],
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_script_among_the_options_is_refused() -> None:
    done = ddpmon("preflight", "--nnodes=1", "train.py")
    assert done.returncode == 2, done.stderr
    assert "'train.py': preflight takes torchrun's options alone, without the script" in done.stderr


def test_bad_values_are_refused() -> None:
    done = ddpmon("preflight", "--message-bytes", "0", "--nnodes=1")
    assert done.returncode == 2 and "--message-bytes 0: expected 4 or more" in done.stderr
    done = ddpmon("preflight", "--nnodes=1", "--no-python")
    assert done.returncode == 2 and "--no-python: preflight starts its own program" in done.stderr


def test_run_preflight_needs_torchrun_arguments(tmp_path: Path) -> None:
    done = ddpmon("run", "--preflight", "python", "-c", "pass")
    assert done.returncode == 2
    assert "--preflight needs torchrun's arguments (the nodes), not a command" in done.stderr


def test_one_healthy_node_then_the_job(tmp_path: Path) -> None:
    """Preflight on one node with two processes: no links, an all-reduce, the node's checks;
    healthy, so ``run --preflight`` starts the script after it."""
    done = ddpmon("preflight", "--json", "--nnodes=1", "--nproc-per-node=2", "--master-port=29731")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["healthy"] and report["links"] == [] and report["allreduce"]["ranks"] == 2
    (check,) = report["checks"].values()
    assert check["clock_offset_seconds"] == 0.0 and check["free_disk_bytes"] > 0
    script = tmp_path / "train.py"
    script.write_text(
        "import os, pathlib\n"
        f"pathlib.Path({str(tmp_path)!r}, 'ran-' + os.environ['RANK']).write_text('')\n"
    )
    done = ddpmon(
        "run",
        "--preflight",
        "--state-dir",
        str(tmp_path / "state"),
        "--nnodes=1",
        "--nproc-per-node=2",
        "--master-port=29732",
        str(script),
    )
    assert done.returncode == 0, done.stderr
    assert "verdict: healthy: no slow or bad host among 1" in done.stderr
    assert done.stderr.index("verdict: healthy") < done.stderr.index("ddpmon run: exit status 0")
    assert sorted(p.name for p in tmp_path.glob("ran-*")) == ["ran-0", "ran-1"]


def test_a_node_that_never_arrives_ends_it_with_exit_1() -> None:
    """Two nodes expected, one started: after --timeout (and a grace) preflight says so,
    ends what it started and exits 1, rather than wait for torchrun's 15 minutes."""
    started = time.monotonic()
    done = ddpmon(
        "preflight", "--timeout", "3", "--nnodes=2", "--node-rank=0", "--master-port=29733"
    )
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert (
        "the nodes did not all report within 3 s (--timeout): a node did not start" in done.stderr
    )
    assert took < 3 + 10 + 15, took  # the grace, and the start of torch here
