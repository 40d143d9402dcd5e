"""Goodput and the batch across scales on real jobs under ``ddpmon run`` (torchrun, gloo):
a job whose first attempt hangs, is ended by hang_action=abort and restarted, with
evaluation and checkpoint pauses; runs of one and two ranks compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("restart_train.py"))
ENV = dict(
    os.environ,
    OMP_NUM_THREADS="1",
    PYTHONUNBUFFERED="1",
    PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
)
PAUSE = 2.0


def ddpmon(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def launch(tmp_path: Path, name: str, nproc: int, *script: str, options=()) -> subprocess.Popen:
    out = tmp_path / f"out-{name}"
    out.mkdir()
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddpmon",
            "run",
            "--port",
            "-1",
            "--state-dir",
            str(tmp_path / name),
            "--job",
            name,
            *options,
            "--standalone",
            f"--nproc-per-node={nproc}",
            "--max-restarts=1",
            SCRIPT,
            str(out),
            *script,
        ],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 170) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the job did not end in {timeout} s: {err[-3000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    return err


@pytest.mark.timeout(230)
def test_goodput_of_a_job_that_hung_and_restarted_adds_up_to_its_wall_time(
    tmp_path: Path,
) -> None:
    """Attempt 0 pauses at step 10 (evaluation, then a checkpoint while rank 1 waits), rank 1
    stalls at step 12 and hang_action=abort ends it; attempt 1 trains 30 steps with pauses
    at steps 10 and 20. Productive plus lost is the wall time from the first process's
    creation to the last rank's end: no shorter than from the script's first line to its
    last (within 1%: another rank's last line may come a moment after rank 0's exit), no
    longer than from the launch to the launcher's return (a rank's exit record comes after
    its interpreter's teardown, 0.2 s past that last line on a loaded machine)."""
    launched = time.time()
    err = finish(
        launch(
            tmp_path,
            "hung",
            2,
            "--fault", "stall", "--at", "12", "--pause-every", "10", "--pause-seconds", str(PAUSE),
            options=("-o", "hang_timeout=3", "-o", "hang_action=abort"),
        )
    )  # fmt: skip
    returned = time.time()
    out, states = tmp_path / "out-hung", tmp_path / "hung"
    first_line = min(float((out / f"started-{r}-0").read_text()) for r in (0, 1))
    ended = max(float((out / f"ended-{r}-1").read_text()) for r in (0, 1))
    report = ddpmon("report", "--json", str(states))
    g = json.loads(report.stdout)["goodput"]
    lost = g["lost_seconds"]
    assert set(lost) == {
        "startup",
        "pauses",
        "hang_until_detected",
        "hang_until_ended",
        "after_last_step",
        "restarts",
    }
    assert g["attempts"] == 2 and g["notes"] == []
    assert g["productive_seconds"] + sum(lost.values()) == pytest.approx(g["wall_seconds"])
    wall = g["wall_seconds"]
    assert (ended - first_line) * 0.99 <= wall <= returned - launched, (g, ended, first_line)
    assert g["ratio"] == pytest.approx(g["productive_seconds"] / g["wall_seconds"])
    assert 3 * PAUSE * 0.9 <= lost["pauses"] <= 3 * PAUSE + 3, lost  # three pauses, 2 s each
    assert 3.0 <= lost["hang_until_detected"] <= 3.0 + 5, lost  # the hang timeout, and a sample
    # the abort ends the attempt promptly, and the job ends soon after its last step (a
    # rank's exit takes a second or two on a loaded machine)
    assert lost["hang_until_ended"] < 5.0 and lost["after_last_step"] < 5.0, lost
    assert lost["startup"] > 1.0 and 0.0 < lost["restarts"] < 30, lost  # two starts of torch
    assert 0.0 < g["productive_seconds"] < 42 * 0.02 * 6, g  # 42 steps of about 20 ms, loaded
    assert "ddpmon run: goodput " in err and " over 2 attempts); lost: startup" in err, err[-2000:]
    page = ddpmon("report", "-o", "-", str(states)).stdout
    assert "<h2>Goodput</h2>" in page and 'data-cause="hang until detected"' in page


@pytest.mark.timeout(230)
def test_compare_says_whether_the_learning_rate_followed_the_global_batch(
    tmp_path: Path,
) -> None:
    """One rank at lr 0.01; two ranks (twice the global batch) at 0.02 after a 3-step
    warm-up, and two ranks left at 0.01."""
    jobs = {
        "one": launch(tmp_path, "one", 1, "--fault", "none", "--steps", "8", "--lr", "0.01"),
        "scaled": launch(
            tmp_path,
            "scaled",
            2,
            "--fault",
            "none",
            "--steps",
            "8",
            "--lr",
            "0.02",
            "--warmup",
            "3",
        ),  # fmt: skip
        "kept": launch(tmp_path, "kept", 2, "--fault", "none", "--steps", "8", "--lr", "0.01"),
    }
    for proc in jobs.values():
        finish(proc)
    scaled = ddpmon("compare", str(tmp_path / "one"), str(tmp_path / "scaled"))
    assert scaled.returncode in (0, 1), scaled.stderr
    assert (
        "global batch differs: B takes 8 samples per optimizer step, A 4 (x2.00; 4 x 1 "
        "micro-batch x 2 ranks against 4 x 1 micro-batch x 1 rank)" in scaled.stdout
    ), scaled.stdout
    assert (
        "peak learning rate 0.02 in B against 0.01 in A (x2.00): it followed the linear "
        "scaling rule for SGD (x2.00)" in scaled.stdout
    ), scaled.stdout
    assert "B reached that rate at step 4, after a warm-up of 3 steps" in scaled.stdout
    kept = ddpmon("compare", str(tmp_path / "one"), str(tmp_path / "kept"))
    assert (
        "peak learning rate 0.01 in B against 0.01 in A (x1.00): the linear scaling rule for "
        "SGD gives x2.00 (0.02); B's did not follow it" in kept.stdout
    ), kept.stdout
    same = ddpmon("compare", str(tmp_path / "scaled"), str(tmp_path / "kept"))
    assert "global batch differs" not in same.stdout
    summary = json.loads(ddpmon("report", "--json", str(tmp_path / "scaled")).stdout)
    assert summary["training"] == {
        "batch_size": 4,
        "micro_batches": 1,
        "global_batch_size": 8,
        "world_size": 2,
        "optimizer": {
            "name": "SGD",
            "learning_rate": pytest.approx(0.02),
            "peak_learning_rate": pytest.approx(0.02),
            "peak_step": 4,
        },
    }
