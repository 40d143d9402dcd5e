"""Fault injection, jobs: real gloo jobs under the faults a shared node produces. Training
is never harmed (final weights bit-identical to a run without ddpmon), the training
process keeps a bounded thread count under a slowloris, and concurrent jobs never collide."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.distributed.harness import collect, describe, start_ranks, stop

MODULE = "tests.distributed.fault_worker"
STEPS = "60"


def run_jobs(jobs: list[tuple[str, Path, dict[str, str]]], timeout: float = 120) -> list[list]:
    """Run several 2-rank jobs at once; every rank must succeed."""
    import time

    started = [start_ranks(mode, 2, workdir, env, (STEPS,), module=MODULE) for mode, workdir, env in jobs]
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and any(p.poll() is None for procs in started for p in procs):
            if any(p.poll() not in (None, 0) for procs in started for p in procs):
                time.sleep(3)
                break
            time.sleep(0.1)
    finally:
        for procs in started:
            stop(procs)
    results = [collect(procs, workdir) for procs, (_, workdir, _) in zip(started, jobs)]
    for r in results:
        assert all(x.returncode == 0 for x in r), describe(r)
    return results


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


def reference_of(plain: list) -> str:
    """The final weights of the job without ddpmon (the same on both ranks)."""
    assert plain[0].result["digest"] == plain[1].result["digest"]
    return plain[0].result["digest"]


def test_two_concurrent_default_jobs_never_collide(tmp_path: Path) -> None:
    shared_tmp = tmp_path / "tmp"  # both jobs' system temp dir
    shared_tmp.mkdir()
    shared_tmp.chmod(0o1777)
    env = {"TMPDIR": str(shared_tmp), "DDPMON_STATE_DIR": "", "DDPMON_JOB": ""}
    env_no_master = {k: "" for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    a, b, plain = run_jobs([("attached", tmp_path / "a", {**env, **env_no_master}),
                            ("attached", tmp_path / "b", {**env, **env_no_master}),
                            ("plain", tmp_path / "plain", {})])
    reference = reference_of(plain)
    jobs = [{r.result["job"] for r in a}, {r.result["job"] for r in b}]
    assert len(jobs[0]) == 1 and len(jobs[1]) == 1, "one job name per launch, the same on every rank"
    assert jobs[0] != jobs[1], "two launches never share a job label"
    files = [r.result["state_file"] for r in a + b]
    assert len(set(files)) == 4, files
    assert all(f.startswith(str(shared_tmp / f"ddpmon-{os.geteuid()}")) for f in files)
    assert {r.result["digest"] for r in a + b} == {reference}


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs state directory needs root")
def test_slowloris_sigstop_and_a_read_only_state_dir_leave_training_alone(tmp_path: Path) -> None:
    state = tmp_path / "attacked" / "state"
    if not mount_tmpfs(state, "1m"):
        pytest.skip("cannot mount a tmpfs here")
    full = tmp_path / "full" / "state"
    try:
        full_ok = mount_tmpfs(full, "4k")  # a state directory with no room for a state file
        # (no step history: an open SQLite file keeps `mount -o remount,ro` from succeeding; a
        # file system the kernel turns read-only after an error does not ask)
        jobs = [("attacked", tmp_path / "attacked", {"DDPMON_HISTORY": "0"}), ("plain", tmp_path / "plain", {})]
        if full_ok:
            jobs.append(("attached", tmp_path / "full", {"DDPMON_STATE_DIR": str(full)}))
        results = run_jobs(jobs)
    finally:
        subprocess.run(["umount", "-l", str(state)], capture_output=True)
        subprocess.run(["umount", "-l", str(full)], capture_output=True)
    attacked, reference = results[0], reference_of(results[1])
    rank0 = attacked[0].result
    assert rank0["attack_opened"] >= 200, rank0
    # 250 half-open connections (reopened as the server drops them) add no thread to the
    # training process (+1: the timer that wakes rank 1; +2 of noise)
    added = rank0["threads_peak"] - rank0["threads_before"]
    assert added <= 1 + 2, (added, rank0["threads_before"])
    assert {r.result["digest"] for rs in results for r in rs} == {reference}
    assert "Read-only file system" in attacked[0].stderr + attacked[1].stderr  # said, once per rank
    if full_ok:
        assert "No space left on device" in results[2][0].stderr + results[2][1].stderr
