"""Does the doctor's answer hold still? A healthy gloo job run with ``ddpmon run`` for
``--seconds``, asked ``ddpmon doctor --json`` every ``--every`` seconds, as a user watching a
job (or a cron check) would; prints each answer that was not HEALTHY and the counts.

    python benchmarks/polling.py                           # 4 ranks, 120 s, every 2 s
    python benchmarks/polling.py --load 2                  # beside two CPU hogs
    python benchmarks/polling.py --ranks 2 --seconds 60 --jitter 0.3

The job (``train`` below) is a small MLP whose ranks each sleep ``--work`` seconds a step
in data loading, forward and the optimizer, each part jittered at random by up to
``--jitter`` of itself on every rank alike: no rank is slower than the others, so every
answer but HEALTHY is a false alarm. The machine's load average is printed at the start and
at the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doctor_accuracy import hogs  # noqa: E402 (after the path is set)

TRAIN = """
import os, random, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

work, jitter, until = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
dist.init_process_group("gloo")
torch.manual_seed(int(os.environ["RANK"]))  # each rank its own batches (DDP syncs the weights)
ddp = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)))
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
rng = random.Random(int(os.environ["RANK"]))
def pause():
    time.sleep(work * (1 + rng.uniform(-jitter, jitter)))
step = 0
while True:
    stop = torch.tensor([time.time() > until], dtype=torch.int)
    if step % 20 == 0:
        dist.all_reduce(stop)
        if stop.item():
            break
    pause()  # data loading
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    loss = nn.functional.mse_loss(ddp(x), y)
    pause()  # forward's share of the work
    loss.backward()
    opt.step()
    opt.zero_grad()
    pause()  # the optimizer's
    step += 1
dist.destroy_process_group()
"""


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--seconds", type=float, default=120.0, help="how long the doctor is asked")
    p.add_argument("--every", type=float, default=2.0, help="seconds between two questions")
    p.add_argument("--work", type=float, default=0.004, help="seconds per part per step")
    p.add_argument("--jitter", type=float, default=0.2, help="share of --work, at random")
    p.add_argument("--load", type=int, default=0, help="CPU hogs beside the job")
    args = p.parse_args()

    print(f"load average at start: {os.getloadavg()}", flush=True)
    answers: collections.Counter[str] = collections.Counter()
    wrong: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ddpmon-polling-") as root, hogs(args.load):
        script = Path(root, "train.py")
        script.write_text(TRAIN)
        state = Path(root, "state")
        warmup = 15.0
        until = time.time() + warmup + args.seconds
        job = subprocess.Popen(
            [sys.executable, "-m", "ddpmon", "run", "--state-dir", str(state), "--port", "-1"]
            + ["--standalone", f"--nproc-per-node={args.ranks}", str(script)]
            + [str(args.work), str(args.jitter), str(until)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(warmup)
            started = time.monotonic()
            while time.monotonic() - started < args.seconds and job.poll() is None:
                asked = time.monotonic()
                r = subprocess.run(
                    [sys.executable, "-m", "ddpmon", "doctor", str(state), "--json"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                try:
                    answer = json.loads(r.stdout)
                    verdict = answer.get("verdict", "?")
                    warnings = [
                        f["kind"] for f in answer.get("findings", []) if f["severity"] != "info"
                    ]
                except json.JSONDecodeError:
                    verdict, warnings = f"no answer (exit {r.returncode})", []
                key = f"exit {r.returncode}: {verdict}" + (
                    f" ({', '.join(warnings)})" if warnings else ""
                )
                answers[key] += 1
                if r.returncode != 0 or warnings:
                    at = asked - started
                    wrong.append(f"{at:6.1f} s  {key}")
                    print(f"{at:6.1f} s  {key}", flush=True)
                time.sleep(max(0.0, args.every - (time.monotonic() - asked)))
        finally:
            job.terminate()
            try:
                job.wait(30)
            except subprocess.TimeoutExpired:
                job.kill()
    total = sum(answers.values())
    print(f"load average at end: {os.getloadavg()}")
    print(
        f"{args.ranks} ranks, asked {total} times over {args.seconds:.0f} s"
        + (f", beside {args.load} CPU hogs" if args.load else "")
    )
    for key, n in answers.most_common():
        print(f"  {n:4d}  {key}")
    print(f"not healthy: {len(wrong)} of {total}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
