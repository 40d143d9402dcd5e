"""Run a scenario as a real multi-process gloo job: one OS process per rank, a FileStore
rendezvous per test (no ports), every rank's output kept. The parent polls and ends all
ranks when one fails (unless failures are expected) or when the timeout passes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    result: dict[str, Any] = field(default_factory=dict)
    pid: int = 0


def rank_env(
    rank: int, world_size: int, workdir: Path, extra: dict[str, str] | None = None
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        DDPMON_TEST_STORE=str(workdir / "store"),
        DDPMON_TEST_OUT=str(workdir),
        DDPMON_STATE_DIR=str(workdir / "state"),
        DDPMON_PORT="0",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    env.update(extra or {})
    return env


def start_ranks(
    scenario: str,
    world_size: int,
    workdir: Path,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    module: str = "tests.distributed.worker",
) -> list[subprocess.Popen]:
    """Start one process per rank running ``python -m MODULE SCENARIO ARGS``."""
    workdir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world_size):
        out = open(workdir / f"stdout-{rank}.txt", "w")
        err = open(workdir / f"stderr-{rank}.txt", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, scenario, *args],
                cwd=ROOT,
                env=rank_env(rank, world_size, workdir, env),
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        )
    return procs


def finish(procs: list[subprocess.Popen], workdir: Path, seconds: float = 20.0) -> None:
    """Ask ranks that train until ``<workdir>/stop`` exists to end, wait up to ``seconds``
    for them, then kill what is left."""
    (workdir / "stop").touch()
    deadline = time.monotonic() + seconds
    while procs and time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    stop(procs)


def wait_until(what: str, check: Callable[[], Any], timeout: float = 15.0) -> Any:
    """``check()``'s first true value, asked every 0.1 s; an AssertionError naming ``what``
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def stop(procs: list[subprocess.Popen], sig: int = signal.SIGKILL) -> None:
    """Signal each process's session and every process below it: torchrun starts its ranks
    in sessions of their own, so that a rank a test stalled would outlive its launcher."""
    for p in procs:
        if p.poll() is None:
            try:
                below = psutil.Process(p.pid).children(recursive=True)
            except psutil.Error:
                below = []
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
            for child in below:
                with contextlib.suppress(psutil.Error):
                    child.send_signal(sig)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass


def states(workdir: Path) -> dict[int, dict[str, Any]]:
    """The ranks' state files under ``workdir/state`` as read now, by rank (a file being
    replaced or not yet there is left out)."""
    out = {}
    for path in sorted((workdir / "state").glob("rank-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[data["rank"]] = data
    return out


def collect(procs: list[subprocess.Popen], workdir: Path) -> list[RankResult]:
    results = []
    for rank, p in enumerate(procs):
        path = workdir / f"result-{rank}.json"
        results.append(
            RankResult(
                rank,
                p.poll(),
                (workdir / f"stdout-{rank}.txt").read_text(),
                (workdir / f"stderr-{rank}.txt").read_text(),
                json.loads(path.read_text()) if path.exists() else {},
                p.pid,
            )
        )
    return results


def run_ranks(
    scenario: str,
    world_size: int,
    workdir: Path,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    expect_failure: bool = False,
    module: str = "tests.distributed.worker",
) -> list[RankResult]:
    """Run ``scenario`` on ``world_size`` ranks; raise with every rank's output on failure."""
    procs = start_ranks(scenario, world_size, workdir, env, args, module)
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > (
                10 if expect_failure else 3
            ):
                break
            time.sleep(0.05)
    finally:
        stop(procs)
    results = collect(procs, workdir)
    if not expect_failure and any(r.returncode != 0 for r in results):
        raise AssertionError(f"scenario {scenario!r} failed:\n" + describe(results))
    return results


def describe(results: list[RankResult]) -> str:
    return "\n".join(
        f"--- rank {r.rank} exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
        for r in results
    )
