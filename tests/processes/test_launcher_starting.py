"""``ddpmon run`` on a real 2-rank job, asked by ``ddpmon doctor`` while its launcher is still
loading torch (seconds on a busy machine): the job is starting, with its command and since
when, never "no state files". tests/support/torch_gate_site holds ``import torch`` in the
command line's process, then in torchrun's agent, until the test opens each gate, so both
windows are seen for certain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpmon.state import launcher
from tests.support.commands import ROOT, run_doctor
from tests.support.harness import wait_until

pytestmark = pytest.mark.timeout(180)

SCRIPT = str(ROOT / "tests" / "distributed" / "plain_train.py")
GATE_SITE = str(ROOT / "tests" / "support" / "torch_gate_site")


def ask(state_dir: Path) -> tuple[int, dict]:
    done = run_doctor(str(state_dir), "--json")
    return done.returncode, json.loads(done.stdout)


def records(state_dir: Path) -> list[launcher.LauncherState]:
    return [launcher.read(p)[0] for p in launcher.list_paths(str(state_dir))]


def test_the_doctor_says_the_job_is_starting_while_torch_loads(tmp_path: Path) -> None:
    state_dir, gates, out = tmp_path / "state", tmp_path / "gates", tmp_path / "out"
    gates.mkdir()
    out.mkdir()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join((GATE_SITE, str(ROOT))),
        TORCH_IMPORT_GATE=str(gates),
        OMP_NUM_THREADS="1",
    )
    env.pop("DDPMON_JOB", None)
    argv = ["--nproc-per-node=2", "--master-port=29671", SCRIPT, str(out), "--steps", "5"]
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddpmon",
            "run",
            "--state-dir",
            str(state_dir),
            "--port",
            "-1",
            *argv,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # `ddpmon run` itself waits for torch (it reads torchrun's arguments with torch's parser)
        wait_until("ddpmon run to hold its torch import", (gates / "ddpmon.waiting").exists, 60)
        code, report = ask(state_dir)
        assert code == 0 and report["verdict"] == "healthy", report
        (first,) = records(state_dir)
        assert first.pid == run.pid and first.stage == launcher.LauncherStage.STARTING
        assert (first.nnodes, first.nproc_per_node, first.endpoint) == ("1", "2", "127.0.0.1:29671")
        assert first.command == [SCRIPT, str(out), "--steps", "5"] and first.node_rank == 0
        (finding,) = report["findings"]
        assert finding["kind"] == "starting", finding
        assert finding["summary"].startswith("the job is starting: node 0 (")
        assert "launcher has been starting for" in finding["summary"]
        assert f"({SCRIPT}; torch loading, no rendezvous tried yet)" in finding["summary"]
        assert finding["evidence"] == [
            f"{first.node}: {SCRIPT} {out} --steps 5; 1 node, 2 processes each, "
            "rendezvous static at 127.0.0.1:29671"
        ]
        (gates / "ddpmon").touch()
        # torchrun's agent (`python -m ddpmon.agent`) goes on with the same record, its own
        # torch not loaded yet
        wait_until(
            "the agent to hold its torch import", (gates / "ddpmon.agent.waiting").exists, 60
        )
        (agent,) = wait_until(
            "the agent's record", lambda: [r for r in records(state_dir) if r.pid != run.pid], 60
        )
        assert agent.stage == launcher.LauncherStage.STARTING
        assert agent.started_unix == first.started_unix  # since the user started it
        assert len(launcher.list_paths(str(state_dir))) == 1
        code, report = ask(state_dir)
        assert code == 0 and [f["kind"] for f in report["findings"]] == ["starting"], report
        assert "launcher has been starting for" in report["findings"][0]["summary"]
        (gates / "ddpmon.agent").touch()
        output, _ = run.communicate(timeout=150)
        assert run.returncode == 0, output
        (ended,) = records(state_dir)
        assert ended.stage == launcher.LauncherStage.ENDED and ended.endpoint == "127.0.0.1:29671"
        assert ended.command == first.command
        code, report = ask(state_dir)
        assert report["verdict"] == "healthy", report
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
