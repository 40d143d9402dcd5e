"""How often `ddpmon doctor` is right on real faulty gloo jobs: N random scenarios
(tests/scenarios: 32 kinds of fault, straggler, healthy pause or pattern users copy, world
size 2-4, random culprit rank and step), each diagnosed at a new user's moment; prints
accuracy, the verdicts' macro-F1 and every wrong answer.

    python benchmarks/doctor_accuracy.py 100 [--seed S] [--kinds a,b] [--load N] [--max-world W]
    python benchmarks/doctor_accuracy.py 40 --kinds slow_data,slow_forward,slow_backward,slow_optimizer,jitter \
        --slowdown 0.2                                                  # 20% stragglers

A false hang is a healthy run answered hang by the doctor, or one whose watchdog logged a
hang report; a memory finding on a healthy run (memory_creep) is counted too. ``--load N`` runs N CPU hogs beside every job (each in a session of its own, so that the
scheduler weighs each one like a rank: with autogroups it weighs sessions); ``--max-world W``
draws world sizes from 2 to W (default 4). ``--slowdown`` and ``--paced-at`` set what a
straggler adds to one part (a share of the paced work) and how many steps into it the doctor
is asked. A false straggler is a run that is not one answered straggler. The machine's load
average is printed at the start and at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.scenarios.runner import KINDS, draw, expected, run  # noqa: E402


def macro_f1(pairs: list[tuple[str, str]]) -> float:
    """Macro-averaged F1 over the verdicts that occur (expected or answered)."""
    labels = sorted({e for e, _ in pairs} | {a for _, a in pairs})
    scores = []
    for label in labels:
        tp = sum(1 for e, a in pairs if e == label and a == label)
        fp = sum(1 for e, a in pairs if e != label and a == label)
        fn = sum(1 for e, a in pairs if e == label and a != label)
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores) if scores else 0.0


@contextlib.contextmanager
def hogs(n: int):
    """``n`` CPU hogs, each in a session of its own, for the duration of the block."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(n)
    ]
    try:
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} {five:.1f} {fifteen:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("n", type=int, help="number of random scenarios")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kinds", default="", help="comma-separated kinds (default: all)")
    p.add_argument(
        "--load",
        type=int,
        default=0,
        metavar="N",
        help="CPU hogs to run beside every job (default 0)",
    )
    p.add_argument(
        "--max-world", type=int, default=4, metavar="W", help="largest world size drawn (default 4)"
    )
    p.add_argument(
        "--slowdown",
        type=float,
        default=None,
        metavar="SHARE",
        help="what a straggler adds to one part, as a share of the paced work (default 0.3)",
    )
    p.add_argument(
        "--paced-at",
        type=int,
        default=None,
        metavar="STEPS",
        help="steps into a straggler (or jitter) when the doctor is asked (default: as many as "
        "last 15 s, 3 s past the 12 s a straggler's gap must hold to be named)",
    )
    args = p.parse_args()
    if args.max_world < 2:
        p.error(f"--max-world must be at least 2, not {args.max_world}")
    kinds = [k for k in args.kinds.split(",") if k] or None
    if kinds and (unknown := set(kinds) - set(KINDS)):
        p.error(f"unknown kinds: {', '.join(sorted(unknown))}; known: {', '.join(sorted(KINDS))}")
    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)
    env = {}
    if args.slowdown is not None:
        env["DDPMON_SCENARIO_SLOW_SHARE"] = str(args.slowdown)
    if args.paced_at is not None:
        env["DDPMON_SCENARIO_PACED_AT"] = str(args.paced_at)
    pairs, right, wrong = [], 0, []
    false_hangs = watchdog_hangs = false_stragglers = false_memory = judged = 0
    per_kind: Counter[tuple[str, bool]] = Counter()
    started = load()
    print(
        f"load average at the start: {started}"
        + (f"; {args.load} CPU hogs beside every job" if args.load else ""),
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="ddpmon-accuracy-") as root, hogs(args.load):
        for i in range(args.n):
            s = draw(rng, kinds, args.max_world)
            workdir = Path(root) / f"{i:04d}"
            outcome = run(s, workdir, timeout=120.0 * (1 + args.load), env=env)
            want = expected(s)[0]
            pairs.append((want, outcome.verdict))
            per_kind[(s.kind, outcome.right)] += 1
            right += outcome.right
            if want == "healthy" and outcome.verdict == "hang":
                false_hangs += 1
            false_stragglers += want != "straggler" and outcome.verdict == "straggler"
            if want == "healthy" and outcome.diagnosis is not None:
                d = outcome.diagnosis
                false_memory += any(f.kind == "memory_creep" for f in d.findings)
                judged += sum(
                    any(t.bytes_per_step is not None for t in v.state.memory.trends)
                    for v in d.ranks
                )
            reported = want == "healthy" and any(
                "made no progress" in p.read_text(errors="replace")
                for p in workdir.glob("stderr-*.txt")
            )
            watchdog_hangs += reported
            mark = "ok " if outcome.right else "BAD"
            print(
                f"{mark} {s} -> {outcome.verdict} {outcome.suspects} ({outcome.seconds:.0f} s)"
                + (" (a watchdog reported a hang)" if reported else ""),
                flush=True,
            )
            if not outcome.right:
                wrong.append(f"{s}: {outcome.verdict} {outcome.suspects}: {outcome.summary[:200]}")
    print(
        f"\nseed {seed}: {right}/{args.n} right ({right / args.n:.1%}), verdict macro-F1 "
        f"{macro_f1(pairs):.3f}, false hangs on healthy runs: {false_hangs} (doctor), "
        f"{watchdog_hangs} (a watchdog's hang report); false stragglers: {false_stragglers}; "
        f"memory findings on healthy runs: {false_memory} (ranks whose memory trends were "
        f"judged: {judged})"
    )
    print(
        f"load average (1, 5, 15 min) at the start {started}, at the end {load()}"
        + (f", with {args.load} CPU hogs" if args.load else "")
    )
    for kind in sorted({k for k, _ in per_kind}):
        print(
            f"  {kind:<20} {per_kind[(kind, True)]}/{per_kind[(kind, True)] + per_kind[(kind, False)]}"
        )
    for line in wrong:
        print("wrong:", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
