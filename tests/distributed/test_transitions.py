"""No false hang through a training script's pauses: a real 2-rank gloo job
(tests/distributed/transition_worker.py) evaluates without touching the DDP model, writes a
checkpoint on rank 0 while rank 1 waits in a barrier, evaluates through the DDP model on
rank 0 while rank 1 waits in a barrier, and works after its training loop;
the doctor is asked every quarter second throughout with a stall of 1 s (so every pause is
judged from its first second, the moment a rank's watchdog has not sampled it yet), and
must never answer hang; each pause must be seen as busy. The second test runs the work
after the loop with the ranks hardly ever scheduled: moved onto one CPU at the lowest
priority beside a CPU hog. The third runs it for far longer than 5 hang timeouts with
``hang_action=abort``: a rank that works while nobody waits for it is never hung, so no
hang report and no abort.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpmon.doctor import examine
from tests.support import harness

pytestmark = pytest.mark.timeout(90)

PHASES = ("evaluation", "checkpoint", "rank0_eval", "post_loop")
PAUSE = 3.0
"""Seconds each pause lasts: past the doctor's stall (1 s) and the watchdog's stillness
(2 s, its hang timeout)."""
STARVED = 6.0
"""Seconds of work after the loop, all but the last one hardly ever scheduled: long enough
for the ranks' watchdogs, scheduled as rarely, to sample a still stack for 2 s and judge
it. (The final barrier after it runs beside no hog: a collective whose ranks all get no
CPU takes seconds to complete, which a 2 s hang timeout would call a hang.)"""


def phase(workdir: Path) -> str | None:
    """The latest pause every rank has begun."""
    begun = [p for p in PHASES if all((workdir / f"mark-{r}-{p}").exists() for r in range(2))]
    return begun[-1] if begun else None


LONG = 15.0
"""Seconds of work after the loop in the third test: 7.5 hang timeouts (2 s)."""


def run(
    workdir: Path, starve: bool, long: bool = False
) -> list[tuple[str | None, str, list[int], str, str]]:
    """Run the job, ask the doctor until it ends; (phase, verdict, suspects, first finding's
    kind and summary) of every answer. Starved, the pauses before the loop's end are short
    and the work after it lasts ``STARVED`` seconds; long, it lasts ``LONG`` seconds, with
    ``hang_action=abort``."""
    cpu = min(os.sched_getaffinity(0))
    env = {"DDPMON_TEST_STARVE": str(cpu)} if starve else None
    pauses = (str(0.5), str(STARVED)) if starve else (str(PAUSE),)
    if long:
        env, pauses = {"DDPMON_HANG_ACTION": "abort"}, (str(0.5), str(LONG))
    procs = harness.start_ranks(
        pauses[0], 2, workdir, env, args=pauses[1:], module="tests.distributed.transition_worker"
    )
    hog: subprocess.Popen | None = None
    answers = []
    deadline = time.monotonic() + 60
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            now = phase(workdir)
            if starve and now == "post_loop" and hog is None:
                hog = subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass",
                    ],
                    start_new_session=True,
                )
                hog_until = time.monotonic() + STARVED - 1.0  # the final barrier is not starved
            if hog is not None and hog.poll() is None and time.monotonic() > hog_until:
                hog.kill()
            if (workdir / "state").is_dir() and list((workdir / "state").glob("rank-*.json")):
                d = examine(str(workdir / "state"), live_stacks=False, stall=1.0)
                first = d.findings[0] if d.findings else None
                answers.append(
                    (
                        now,
                        d.verdict,
                        list(d.suspect_ranks),
                        first.kind if first else "",
                        first.summary if first else "",
                    )
                )
            time.sleep(0.25)
    finally:
        if hog is not None and hog.poll() is None:
            os.killpg(hog.pid, signal.SIGKILL)
            hog.wait()
        results = harness.collect(procs, workdir)
        harness.stop(procs)
    assert all(r.returncode == 0 for r in results), harness.describe(results)
    logs = " ".join(r.stderr for r in results)
    assert "made no progress" not in logs and "ends itself" not in logs, logs[-3000:]
    for path in (workdir / "state").glob("rank-*.json"):  # no hang report was ever kept
        assert json.loads(path.read_text())["hang"] is None, path
    return answers


def check(
    answers: list[tuple[str | None, str, list[int], str, str]], phases: tuple[str, ...]
) -> None:
    shown = "\n".join(map(str, answers))
    assert not [a for a in answers if a[1] == "hang"], shown
    for p in phases:  # each pause was judged, and judged busy (not a hang)
        assert any(a[0] == p and a[3] == "busy" for a in answers), f"{p}:\n{shown}"


def test_evaluation_checkpoint_and_post_loop_work_are_never_a_hang(tmp_path: Path) -> None:
    answers = run(tmp_path, starve=False)
    check(answers, PHASES)
    # rank 1 waits in a barrier for rank 0's checkpoint: said, with when the process group's
    # own timeout (the workers' 60 s) would end the job
    assert any(
        a[0] == "checkpoint"
        and a[3] == "busy"
        and a[4].startswith("rank 1 has waited ")
        and re.search(r"the process group's timeout \(60 s\) ends the job in about 5\d s$", a[4])
        for a in answers
    ), "\n".join(map(str, answers))


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)"
)
def test_work_after_the_loop_while_hardly_ever_scheduled_is_not_a_hang(tmp_path: Path) -> None:
    check(run(tmp_path, starve=True), ("post_loop",))


def test_work_after_the_loop_for_many_hang_timeouts_is_never_a_hang_nor_aborted(
    tmp_path: Path,
) -> None:
    answers = run(tmp_path, starve=False, long=True)
    check(answers, ("post_loop",))
    busy = [a for a in answers if a[0] == "post_loop" and a[3] == "busy"]
    assert len(busy) >= 10, "\n".join(map(str, answers))  # asked all along, busy all along
