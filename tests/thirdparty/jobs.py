"""The third-party tier's jobs: training code that ddpmon's authors did not write, run
unmodified under ``ddpmon run`` (torchrun form, 2 CPU ranks, gloo, nothing downloaded), healthy
or with a fault injected from outside the script (tests/support/injector.py, armed by
``INJECT_FAULT`` through a sitecustomize on PYTHONPATH), and the doctor asked meanwhile. One
test file per package (test_lightning.py, test_transformers.py, test_accelerate.py), so that
the test workers share them out. A healthy run must end with no finding above info; a fault
must get the right verdict, culprit and place. A package that is not installed skips its tests.

PyTorch's own ``torch/testing/_internal/distributed`` holds no training script: its DDP code
is unittest mixins (``DistributedTest._DistTestBase``) that PyTorch's source tree, not its
wheel, turns into tests, so it is not run here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ddpmon.doctor import examine
from tests.support import harness

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SITE = ROOT / "tests" / "support" / "inject_site"
JOB_TIMEOUT = 150
"""Seconds a job may take: 15 to 40 s each on the 2-core machine under load."""


def needs(*packages: str) -> None:
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (pip install -e '.[test]' installs it)")


def start(tmp_path: Path, *argv: str, inject: str = "", **env: str) -> subprocess.Popen:
    """``ddpmon run --nproc-per-node=2 ARGV`` in a session of its own, output to tmp_path."""
    environ = {n: v for n, v in os.environ.items() if not n.startswith(("DDPMON_", "INJECT_"))}
    environ.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(SITE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **env,
    )
    if inject:
        environ["INJECT_FAULT"] = inject
    return subprocess.Popen(
        [sys.executable, "-m", "ddpmon", "run", "--port", "-1", "-o", "hang_timeout=2"]
        + ["--state-dir", str(tmp_path / "state"), "--nproc-per-node=2", "--max-restarts=0"]
        + list(argv),
        cwd=tmp_path,
        env=environ,
        stdout=open(tmp_path / "run.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def log(tmp_path: Path) -> str:
    return (tmp_path / "run.log").read_text(errors="replace")[-6000:]


def end(proc: subprocess.Popen) -> None:
    harness.stop([proc])  # the ranks too, in sessions of their own
    proc.wait(timeout=30)


def doctor(state_dir: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "ddpmon", "doctor", str(state_dir), "--json"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def model_dirs(state: Path) -> list[Path]:
    """The state directory and one more per further DDP model (model-1/, ...)."""
    return sorted({p.parent for p in state.rglob("rank-0.json")})


def loud(answer: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f["kind"], f["summary"]) for f in answer["findings"] if f["severity"] != "info"]


def healthy(tmp_path: Path, *argv: str, **env: str) -> list[dict[str, Any]]:
    """Run the job to its end, the doctor asked every second meanwhile (in this process,
    without py-spy) and at the end (the command); no answer may be anything but healthy
    with info notes. The last answer for every model directory the job left."""
    proc = start(tmp_path, *argv, **env)
    state = tmp_path / "state"
    during: list[tuple[str, str, list[tuple[str, str]]]] = []
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            for d in model_dirs(state):
                answer = examine(str(d), live_stacks=False).as_dict()
                if answer["verdict"] != "healthy" or loud(answer):
                    during.append((d.name, answer["verdict"], loud(answer)))
            time.sleep(1)
        assert proc.wait(timeout=5) == 0, log(tmp_path)
    finally:
        end(proc)
    assert during == [], during
    dirs = model_dirs(state)
    assert dirs, log(tmp_path)
    answers = [doctor(d) for d in dirs]
    for d, answer in zip(dirs, answers):
        assert (answer["verdict"], loud(answer)) == ("healthy", []), (d, answer["findings"])
        assert [f["kind"] for f in answer["findings"]] == ["finished"], answer["findings"]
    return answers


def diagnosed(
    tmp_path: Path, verdict: str, *argv: str, inject: str, until_end: bool = False, **env: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the job with a fault injected and ask the doctor every second until it answers
    ``verdict`` (or, with ``until_end``, once the job has ended); that answer and every one
    before it."""
    proc = start(tmp_path, *argv, inject=inject, **env)
    state = tmp_path / "state"
    answers: list[dict[str, Any]] = []
    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        while time.monotonic() < deadline:
            ended = proc.poll() is not None
            if until_end and not ended:
                time.sleep(1)
                continue
            if (state / "rank-1.json").exists():
                answers.append(doctor(state))
                if answers[-1]["verdict"] == verdict or ended:
                    return answers[-1], answers
            elif ended:
                break
            time.sleep(1)
    finally:
        end(proc)
    raise AssertionError(f"no {verdict} answer: {[a['verdict'] for a in answers]}\n{log(tmp_path)}")


def finding(answer: dict[str, Any], kind: str) -> dict[str, Any]:
    kinds = [f["kind"] for f in answer["findings"]]
    assert kind in kinds, answer["findings"]
    return answer["findings"][kinds.index(kind)]


def never_blamed_another(answers: list[dict[str, Any]], culprit: int) -> None:
    for a in answers:
        assert set(a["suspect_ranks"]) <= {culprit}, (a["verdict"], a["findings"])
