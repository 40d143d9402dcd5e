"""How often `ddpmon doctor` is right on real faulty gloo jobs: N random scenarios
(tests/scenarios: 21 kinds of fault, straggler or healthy pause, world size 2-4, random
culprit rank and step), each diagnosed at a new user's moment; prints accuracy, the verdicts' macro-F1
and every wrong answer.

    python benchmarks/doctor_accuracy.py 100 [--seed S] [--kinds a,b]
    python benchmarks/doctor_accuracy.py 100 --load 2 --max-world 8   # beside two CPU hogs
    python benchmarks/doctor_accuracy.py 40 --kinds slow_data,slow_forward,slow_backward,slow_optimizer \
        --slowdown 0.2 --paced-at 20                                    # 20% stragglers, asked at step 20
"""

from __future__ import annotations

import argparse
import random
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("n", type=int, help="number of random scenarios")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kinds", default="", help="comma-separated kinds (default: all)")
    p.add_argument("--load", type=int, default=0, metavar="N", help="run N busy CPU hogs beside the jobs")
    p.add_argument("--max-world", type=int, default=4, help="world sizes drawn from 2 to this")
    p.add_argument("--slowdown", type=float, default=None, metavar="SHARE",
                   help="what a straggler adds to one part, as a share of the paced work (default 0.3)")
    p.add_argument("--paced-at", type=int, default=None, metavar="STEPS",
                   help="steps into a straggler (or jitter) when the doctor is asked (default 24)")
    args = p.parse_args()
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
    false_hangs = false_stragglers = 0
    per_kind: Counter[tuple[str, bool]] = Counter()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    with tempfile.TemporaryDirectory(prefix="ddpmon-accuracy-") as root:
        for i in range(args.n):
            s = draw(rng, kinds, args.max_world)
            outcome = run(s, Path(root) / f"{i:04d}", timeout=60.0 * (1 + args.load), env=env)
            want = expected(s)[0]
            pairs.append((want, outcome.verdict))
            per_kind[(s.kind, outcome.right)] += 1
            right += outcome.right
            false_hangs += want == "healthy" and outcome.verdict == "hang"
            false_stragglers += want != "straggler" and outcome.verdict == "straggler"
            mark = "ok " if outcome.right else "BAD"
            print(f"{mark} {s} -> {outcome.verdict} {outcome.suspects} ({outcome.seconds:.0f} s)", flush=True)
            if not outcome.right:
                wrong.append(f"{s}: {outcome.verdict} {outcome.suspects}: {outcome.summary[:200]}")
    for hog in hogs:
        hog.kill()
    print(f"\nseed {seed}: {right}/{args.n} right ({right / args.n:.1%}), verdict macro-F1 "
          f"{macro_f1(pairs):.3f}, false hangs on healthy runs: {false_hangs}, false stragglers: {false_stragglers}; "
          f"{args.load} CPU hogs beside, worlds 2-{args.max_world}")
    for kind in sorted({k for k, _ in per_kind}):
        print(f"  {kind:<20} {per_kind[(kind, True)]}/{per_kind[(kind, True)] + per_kind[(kind, False)]}")
    for line in wrong:
        print("wrong:", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
