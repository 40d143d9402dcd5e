"""A job before its first step, under ``ddpmon run``: every rank's state file from its
process's start (rank/startup.py), and the doctor's answer about a rank that is late."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from ddpmon.doctor.view import STALL_MIN

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("late_train.py"))
STALL = STALL_MIN + 0.5
"""Seconds rank 0 has waited when the doctor is asked: past the stall before any step."""


def env() -> dict[str, str]:
    out = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    out.pop("DDPMON_STATE_DIR", None)
    out.pop("DDPMON_JOB", None)
    return out


def read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_a_late_rank_is_named_with_its_function_while_the_other_waits(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    cmd = [sys.executable, "-m", "ddpmon", "run", "--port", "-1", "--state-dir", str(state_dir)]
    port = free_port()
    go = tmp_path / "go"  # rank 1 prepares its data until then
    cmd += ["--job", "late", "--nproc-per-node=2", f"--master-port={port}", SCRIPT, str(go)]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # rank 0 waits in init_process_group, rank 1 prepares its data
            r0, r1 = read(state_dir / "rank-0.json"), read(state_dir / "rank-1.json")
            if (
                r0
                and r1
                and r0["stage"] in ("rendezvous", "init_process_group")
                and "prepare_dataset" in str((r1.get("activity") or {}).get("where"))
                and time.time() - r0["startup"]["stage_since_unix"] > STALL
            ):  # a shorter wait is a job starting: ranks never arrive together
                break
            assert time.monotonic() < deadline and proc.poll() is None, (r0, r1)
            time.sleep(0.2)
        assert r1["stage"] == "starting" and r1["pid"] != r0["pid"]
        assert r0["startup"]["backend"] == "gloo" and r0["startup"]["store"] == f"127.0.0.1:{port}"
        asked = time.monotonic()
        doctor = subprocess.run(
            [sys.executable, "-m", "ddpmon", "doctor", "--json", str(state_dir)],
            env=env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        took = time.monotonic() - asked
        answer = json.loads(doctor.stdout)
        assert doctor.returncode == 1 and answer["verdict"] == "not_started", doctor.stdout
        assert answer["suspect_ranks"] == [1]
        summary = answer["findings"][0]["summary"]
        assert re.search(rf"rank 0 waits in \w+ at 127.0.0.1:{port} for \d", summary), summary
        assert re.search(  # in its sleep (or, rarely, the check between two)
            r"rank 1 has not arrived: in prepare_dataset, \S*late_train.py:1[56], starting for \d",
            summary,
        ), summary
        assert took < 10, took
        seen_waiting = time.time() - r0["startup"]["stage_since_unix"]
        go.touch()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    for r in (0, 1):  # the monitor took the file over, and kept how the rank came up
        s = read(state_dir / f"rank-{r}.json")
        assert s["stage"] == "detached" and s["step"] == 3, s
        up = s["startup"]
        assert up["init_done_unix"] >= up["init_started_unix"] and up["ddp_started_unix"]
    waited = read(state_dir / "rank-0.json")["startup"]
    assert waited["init_done_unix"] - waited["init_started_unix"] > seen_waiting


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
