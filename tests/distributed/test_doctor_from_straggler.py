"""``ddpmon doctor --from`` a node daemon gives the straggler verdict that the doctor on the
node gives, on a real 2-rank gloo job whose rank 1 is slower from its first step: before
its gap has lasted ``steps.SUSTAIN_SECONDS`` both say it is not named yet (the daemon serves
the recent busy times that the sustain check reads: ``/history?busy=SECONDS``), after it
both name rank 1."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from ddpmon.state import history
from ddpmon.steps import SUSTAIN_SECONDS
from tests.support import harness
from tests.support.commands import run_doctor, start_daemon, terminate

pytestmark = pytest.mark.timeout(150)

MODULE = "tests.distributed.paced_straggler_worker"


def ask(*where: str) -> dict:
    done = run_doctor(*where, "--json", "--no-stacks")
    return json.loads(done.stdout)


def verdict(report: dict) -> tuple:
    return (
        report["verdict"],
        report["suspect_ranks"],
        sorted(
            (f["kind"], tuple(f["ranks"]))
            for f in report["findings"]
            if f["kind"] in ("straggler", "slowest_rank")
        ),
    )


def stepped_seconds(state_dir: Path) -> float:
    """How long both ranks' histories span (0 before both have one)."""
    spans = []
    for r in (0, 1):
        path = history.path_for(str(state_dir), r)
        try:
            ends = history.busy_since(path, 1e9)["end_unix"]
        except history.HistoryError:
            return 0.0
        spans.append(ends[-1] - ends[0] if len(ends) > 30 else 0.0)
    return min(spans)


def test_doctor_from_a_daemon_judges_a_straggler_as_the_local_doctor(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    daemon, port = start_daemon("--state-dir", str(state_dir), "--serve-state")
    procs: list[subprocess.Popen] = []
    try:
        procs = harness.start_ranks("", 2, tmp_path, module=MODULE)
        deadline = time.monotonic() + 60
        while stepped_seconds(state_dir) < 3.0:  # the window (20 steps and more) names it
            assert time.monotonic() < deadline, harness.describe(harness.collect(procs, tmp_path))
            time.sleep(0.2)
        local, remote = ask(str(state_dir)), ask("--from", f"127.0.0.1:{port}")
        assert stepped_seconds(state_dir) < SUSTAIN_SECONDS - 2, (
            "asked too late to see it held back"
        )
        expected = ("healthy", [], [("slowest_rank", (1,))])
        assert verdict(local) == expected, local
        assert verdict(remote) == expected, remote
        while stepped_seconds(state_dir) < SUSTAIN_SECONDS + 3.0:
            assert time.monotonic() < deadline + 30, harness.describe(
                harness.collect(procs, tmp_path)
            )
            time.sleep(0.5)
        local, remote = ask(str(state_dir)), ask("--from", f"127.0.0.1:{port}")
        expected = ("straggler", [1], [("straggler", (1,))])
        assert verdict(local) == expected, local
        assert verdict(remote) == expected, remote
        (tmp_path / "stop").touch()
        for p in procs:
            assert p.wait(timeout=60) == 0, harness.describe(harness.collect(procs, tmp_path))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        terminate(daemon)
