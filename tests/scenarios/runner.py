"""Run one fault scenario as a real gloo job and diagnose it with ``ddpmon doctor``.

``KINDS`` says, for each kind of fault, what the doctor should answer and when to ask (a
new user's moment: after a death, while a hang lasts, in the middle of a long healthy pause,
at the end). ``draw(rng)`` picks a random scenario (kind, world size 2-4 or up to
``max_world``, culprit rank, step); ``run(scenario, workdir)`` runs it and returns the doctor's answer and whether it is
right. Used by ``tests/scenarios/test_scenarios.py`` (a fixed-seed sample) and
``benchmarks/doctor_accuracy.py`` (N random ones).
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpmon.doctor import examine
from tests.support.harness import ROOT, rank_env, stop

HOLD = 9.0
ASK_DURING_HOLD = 6.5
"""The doctor is asked 6.5 s into a 9 s healthy pause: past its default stall of 5 s."""


@dataclass(frozen=True)
class Kind:
    verdict: str
    culprit_is_suspect: bool
    moment: str
    """death: the culprit ended; hang: the culprit misbehaves for a while; hold: inside a
    long healthy pause; post: inside work after the loop; paced: 15 s (by default: a straggler is
    named once its gap lasted 12 s) into a straggler (or every rank's jitter), the job running; end: every rank ended."""
    symmetric: bool = False
    """Two ranks that disagree (size, dtype, order) cannot say which one is wrong: in a
    2-rank job naming both is right too."""
    quiet: bool = False
    """A pattern scripts copy that is no mistake: any finding above info is wrong too."""


KINDS: dict[str, Kind] = {
    "healthy": Kind("healthy", False, "end"),
    "jitter": Kind("healthy", False, "paced"),
    "evaluation": Kind("healthy", False, "hold"),
    "eval_module": Kind("healthy", False, "hold"),
    "checkpoint_all": Kind("healthy", False, "hold"),
    "checkpoint_barrier": Kind("healthy", False, "hold"),
    "eval_barrier": Kind("healthy", False, "hold"),
    "post_loop": Kind("healthy", False, "post"),
    "exception": Kind("dead_rank", True, "death"),
    "spawn_exception": Kind("dead_rank", True, "death"),
    "sys_exit": Kind("dead_rank", True, "death"),
    "os_exit": Kind("dead_rank", True, "death"),
    "sigsegv": Kind("dead_rank", True, "death"),
    "size_mismatch": Kind("desync", True, "hang", symmetric=True),
    "dtype_mismatch": Kind("desync", True, "hang", symmetric=True),
    "order_swap": Kind("desync", True, "hang", symmetric=True),
    "extra_barrier": Kind("desync", True, "hang"),
    "late_barrier": Kind("desync", True, "hang"),
    "uneven": Kind("desync", True, "hang"),
    "uneven_more": Kind("desync", True, "hang"),
    "stall": Kind("hang", True, "hang"),
    "checkpoint_hang": Kind("hang", True, "hang"),
    "slow_data": Kind("straggler", True, "paced"),
    "slow_forward": Kind("straggler", True, "paced"),
    "slow_backward": Kind("straggler", True, "paced"),
    "slow_optimizer": Kind("straggler", True, "paced"),
    # patterns of scripts users copy
    "peek": Kind("healthy", False, "end", quiet=True),
    "accumulate_no_sync": Kind("healthy", False, "end", quiet=True),
    "accumulate_sync": Kind("healthy", False, "end"),
    "eval_rank0": Kind("healthy", False, "hold"),
    "metric_rank0": Kind("desync", True, "hang", symmetric=True),
    "fetch_between": Kind("straggler", True, "paced"),
}


@dataclass(frozen=True)
class Scenario:
    kind: str
    world: int
    culprit: int
    step: int

    def __str__(self) -> str:
        return f"{self.kind} (world {self.world}, culprit {self.culprit}, step {self.step})"


@dataclass
class Outcome:
    scenario: Scenario
    verdict: str
    suspects: list[int]
    right: bool
    seconds: float
    summary: str
    diagnosis: Any = None
    """The doctor's Diagnosis that decided (the first wrong one, else the last)."""


def draw(rng: random.Random, kinds: list[str] | None = None, max_world: int = 4) -> Scenario:
    kind = rng.choice(kinds or sorted(KINDS))
    world = rng.randint(2, max_world)
    return Scenario(kind, world, rng.randrange(world), rng.randint(2, 6))


def expected(s: Scenario) -> tuple[str, list[int]]:
    k = KINDS[s.kind]
    if s.kind == "uneven" and s.world == 2:
        # no majority: the rank with more batches, in DDP's all-reduce of a step the other
        # (out of batches, in the final barrier) does not have
        return k.verdict, [1 - s.culprit]
    return k.verdict, [s.culprit] if k.culprit_is_suspect else []


CAUSE_WORDS = {
    "slow_data": "in data wait",
    "slow_forward": "in forward",
    "slow_backward": "in backward",
    "slow_optimizer": "in optimizer step",
}
"""How the straggler finding names each straggler kind's part: a right rank with the wrong
cause is wrong."""


def right(s: Scenario, verdict: str, suspects: list[int], summary: str = "") -> bool:
    want = expected(s)
    if s.kind in CAUSE_WORDS and CAUSE_WORDS[s.kind] not in summary:
        return False
    if (verdict, suspects) == want:
        return True
    return KINDS[s.kind].symmetric and s.world == 2 and (verdict, suspects) == (want[0], [0, 1])


def run(
    s: Scenario, workdir: Path, timeout: float = 60.0, env: dict[str, str] | None = None
) -> Outcome:
    """Run the scenario's job, ask the doctor at the kind's moment, end the job."""
    workdir.mkdir(parents=True, exist_ok=True)
    procs = _start(s, workdir, env)
    started = time.monotonic()
    answers = []
    try:
        k = KINDS[s.kind]
        deadline = started + timeout
        if k.moment == "death":
            _wait(lambda: (workdir / f"mark-{s.culprit}-at").exists(), deadline)
            if s.kind.startswith("spawn_"):
                time.sleep(1.0)
            else:
                _wait(lambda: procs[s.culprit].poll() is not None, deadline)
            time.sleep(2.0)
        elif k.moment == "hang":
            _wait(lambda: (workdir / f"mark-{s.culprit}-at").exists(), deadline)
            time.sleep(8.0)
        elif k.moment == "paced":
            _wait(
                lambda: all((workdir / f"mark-{r}-paced").exists() for r in range(s.world)),
                deadline,
            )
            answers.append(examine(str(workdir / "state")))
            _wait(lambda: all(p.poll() is not None for p in procs), deadline)
        elif k.moment in ("hold", "post"):
            name = "at" if k.moment == "hold" else "loop_done"
            _wait(
                lambda: all((workdir / f"mark-{r}-{name}").exists() for r in range(s.world)),
                deadline,
            )
            time.sleep(ASK_DURING_HOLD)
            answers.append(examine(str(workdir / "state")))
            _wait(lambda: all(p.poll() is not None for p in procs), deadline)
        else:
            _wait(lambda: all(p.poll() is not None for p in procs), deadline)
        if k.moment != "paced":  # asked while it ran: the job's end is not the question
            answers.append(examine(str(workdir / "state")))
    except TimeoutError as exc:
        return Outcome(s, "timeout", [], False, time.monotonic() - started, str(exc))
    finally:
        stop(procs)
    wrong = [
        d
        for d in answers
        if not right(
            s, d.verdict, list(d.suspect_ranks), d.findings[0].summary if d.findings else ""
        )
        or (KINDS[s.kind].quiet and any(f.severity != "info" for f in d.findings))
    ]
    d = wrong[0] if wrong else answers[-1]
    summary = d.findings[0].summary if d.findings else ""
    return Outcome(
        s, d.verdict, list(d.suspect_ranks), not wrong, time.monotonic() - started, summary, d
    )


def _start(s: Scenario, workdir: Path, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    env_extra = {"DDPMON_SCENARIO_HOLD": str(HOLD), **(env or {})}
    ranks = [0] if s.kind.startswith("spawn_") else list(range(s.world))
    procs = []
    for rank in ranks:
        env = rank_env(rank, s.world, workdir, env_extra)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.scenarios.worker",
                    s.kind,
                    str(s.culprit),
                    str(s.step),
                ],
                cwd=ROOT,
                env=env,
                start_new_session=True,
                stdout=open(workdir / f"stdout-{rank}.txt", "w"),
                stderr=open(workdir / f"stderr-{rank}.txt", "w"),
            )
        )
    return procs


def _wait(done, deadline: float) -> None:
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("the scenario did not reach its moment in time")
        time.sleep(0.05)
