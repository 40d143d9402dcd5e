"""A job's end on NCCL, timed (tests/gpu/life_worker.py, one rank on cuda:0): a stalled rank
named by the doctor, ``hang_action=abort`` ending the NCCL group and the process, a job that
ends normally and one that raises exiting promptly, a GPU that stops making progress, and
``ddpmon capture`` recording CUDA kernels. With DDPMON_GPU_FIGURES set, each test appends
what it timed to that file (one JSON object a line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import harness

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

HANG_TIMEOUT = 3.0  # life_worker's


def figure(**values: Any) -> None:
    path = os.environ.get("DDPMON_GPU_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(values) + "\n")


def start(tmp_path: Path, end: str, *args: str) -> subprocess.Popen:
    (proc,) = harness.start_ranks(end, 1, tmp_path, module="tests.gpu.life_worker", args=args)
    return proc


def ended_at(tmp_path: Path, proc: subprocess.Popen, timeout: float = 90) -> float:
    """The wall time at which the rank marked its ending."""
    deadline = time.monotonic() + timeout
    while not (tmp_path / "ending.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            harness.stop([proc])
            raise AssertionError(
                "the rank never reached its ending:\n"
                + harness.describe(harness.collect([proc], tmp_path))
            )
        time.sleep(0.05)
    time.sleep(0.05)
    return json.loads((tmp_path / "ending.json").read_text())["unix"]


def exit_after(tmp_path: Path, proc: subprocess.Popen, timeout: float) -> tuple[int, float]:
    """(exit status, seconds from the marked ending to the process's end)."""
    since = ended_at(tmp_path, proc)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        harness.stop([proc])
        raise AssertionError(
            f"still running {timeout} s after its ending:\n"
            + harness.describe(harness.collect([proc], tmp_path))
        ) from None
    return code, time.time() - since


def doctor(state_dir: Path) -> tuple[int, dict[str, Any], str]:
    out = subprocess.run(
        [sys.executable, "-m", "ddpmon", "doctor", str(state_dir), "--json"],
        cwd=harness.ROOT,
        env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout, out.stderr
    return out.returncode, json.loads(out.stdout), out.stderr


def hang_reported(tmp_path: Path, proc: subprocess.Popen, timeout: float = 30) -> float:
    since = ended_at(tmp_path, proc)
    deadline = time.monotonic() + timeout
    while not harness.states(tmp_path).get(0, {}).get("hang"):
        if time.monotonic() > deadline or proc.poll() is not None:
            text = json.dumps(harness.states(tmp_path).get(0, {}).get("activity"))
            harness.stop([proc])
            raise AssertionError(
                f"no hang report {timeout} s after the stall; activity {text}\n"
                + harness.describe(harness.collect([proc], tmp_path))
            )
        time.sleep(0.05)
    return time.time() - since


@pytest.mark.parametrize("end,code", [("finish", 0), ("raise", 1)])
def test_a_job_that_ends_exits_promptly(tmp_path: Path, end: str, code: int) -> None:
    proc = start(tmp_path, end)
    status, seconds = exit_after(tmp_path, proc, timeout=60)
    figure(check=f"exit after {end}", seconds=round(seconds, 2), status=status)
    assert status == code, harness.describe(harness.collect([proc], tmp_path))
    assert seconds < 10, seconds
    state = harness.states(tmp_path)[0]
    assert state["exit"]["how"] == ("end" if end == "finish" else "exception"), state["exit"]
    assert state["bucket_timing"] == "c10d"


def test_a_stalled_nccl_rank_is_named_by_the_doctor(tmp_path: Path) -> None:
    proc = start(tmp_path, "stall")
    try:
        seconds = hang_reported(tmp_path, proc)
        begun = time.monotonic()
        code, report, _ = doctor(tmp_path / "state")
        figure(
            check="stall: hang report after",
            seconds=round(seconds, 2),
            doctor_seconds=round(time.monotonic() - begun, 2),
            verdict=report["verdict"],
        )
        assert seconds < HANG_TIMEOUT + 5, seconds
        assert code == 1 and report["verdict"] == "hang" and report["suspect_ranks"] == [0], report[
            "findings"
        ]
        found = [f for f in report["findings"] if f["kind"] == "stuck_rank"]
        assert found and any("load_batch" in line for line in found[0]["evidence"]), report[
            "findings"
        ]
        fr = harness.states(tmp_path)[0]["hang"][
            "flight_recorder"
        ]  # NCCL's own recorder, read back
        assert fr and any(e["profiling_name"] == "nccl:all_reduce" for e in fr["entries"]), fr
    finally:
        harness.stop([proc])


def test_hang_action_abort_ends_the_nccl_group_and_the_process(tmp_path: Path) -> None:
    proc = start(tmp_path, "stall", "abort")
    status, seconds = exit_after(tmp_path, proc, timeout=HANG_TIMEOUT + 30)
    err = (tmp_path / "stderr-0.txt").read_text()
    figure(
        check="hang_action=abort: exit after the stall", seconds=round(seconds, 2), status=status
    )
    assert status == 87, err[-3000:]
    assert seconds < HANG_TIMEOUT + 10, seconds
    assert "aborted the NCCL process groups" in err or "aborted each NCCL process group" in err, (
        err[-3000:]
    )
    state = harness.states(tmp_path)[0]
    assert state["exit"]["how"] == "hang_abort" and state["exit"]["culprits"] == [0]


def test_a_gpu_that_stops_is_a_hang_of_that_rank(tmp_path: Path) -> None:
    """The rank's main thread waits in ``loss.item()`` for a GPU that makes no progress."""
    proc = start(tmp_path, "gpu_stall")
    try:
        since = ended_at(tmp_path, proc)
        time.sleep(HANG_TIMEOUT + 5)
        code, report, _ = doctor(tmp_path / "state")
        state = harness.states(tmp_path)[0]
        figure(
            check="gpu_stall",
            seconds=round(time.time() - since, 2),
            verdict=report["verdict"],
            activity=state.get("activity"),
            hang=bool(state.get("hang")),
            findings=[(f["kind"], f.get("title") or f.get("summary")) for f in report["findings"]],
        )
        assert report["verdict"] == "hang" and report["suspect_ranks"] == [0], json.dumps(
            {"activity": state.get("activity"), "findings": report["findings"]}, indent=1
        )[:4000]
        assert (
            state["activity"]["state"] == "stuck"
            and state["activity"]["gpu_behind_seconds"] >= HANG_TIMEOUT
        )
        # NCCL's flight recorder: the step's all-reduce enqueued behind the kernel, not started
        found = report["findings"][0]
        assert found["kind"] == "gpu_behind", found
        assert any(
            "waiting for its GPU, which has not finished the work" in line
            for line in found["evidence"]
        ), found
    finally:
        harness.stop([proc])


def test_capture_records_cuda_kernels(tmp_path: Path) -> None:
    proc = start(tmp_path, "serve")
    try:
        deadline = time.monotonic() + 60
        while harness.states(tmp_path).get(0, {}).get("step", 0) < 20:
            assert proc.poll() is None and time.monotonic() < deadline, harness.describe(
                harness.collect([proc], tmp_path)
            )
            time.sleep(0.1)
        out = tmp_path / "trace.json"
        begun = time.monotonic()
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddpmon",
                "capture",
                str(tmp_path / "state"),
                "--rank",
                "0",
                "--steps",
                "3",
                "-o",
                str(out),
            ],
            cwd=harness.ROOT,
            env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        trace = json.loads(out.read_text(errors="replace"), strict=False)
        kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]
        names = {e["name"] for e in kernels}
        figure(
            check="capture on cuda",
            seconds=round(time.monotonic() - begun, 2),
            kernels=len(kernels),
            nccl=sorted(n for n in names if "nccl" in n.lower())[:3],
        )
        assert kernels, sorted({e.get("cat") for e in trace["traceEvents"]})
        assert any(
            "gemm" in n.lower() or "sm90" in n.lower() or "cutlass" in n.lower() for n in names
        ), sorted(names)
        assert any(e.get("name") == "aten::addmm" for e in trace["traceEvents"])
    finally:
        (tmp_path / "stop").touch()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            harness.stop([proc])
