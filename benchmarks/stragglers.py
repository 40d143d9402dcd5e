"""Straggler detection accuracy on real gloo DDP jobs: how soon a rank 10% slower than the
others is named, whether the named cause is the part that was slowed, and whether healthy
jobs whose step times jitter at random are ever called stragglers.

One job per world size (2, 3 and 4 ranks, one process each); each job runs segments of
``--steps`` steps. In a straggler segment one random rank is slower by ``--slowdown`` of the
step's busy time in one random part (data wait, forward, backward, optimizer, other), on
top of random jitter on every rank; in a healthy segment every rank only jitters (up to
``--healthy-jitter`` of the busy time per step, in a random part). The busy time these
shares are of is measured first: the slowest rank's median over a 30-step warm-up (sleeps,
compute and overheads; about 19 ms here). Every rank's per-step rows
(``Recorder.history_since``) are scored afterwards exactly as the doctor would have scored
the state files after each step (ddpmon/steps.py over the last 20 steps of the segment).

    python benchmarks/stragglers.py                    # 16 segments per world size
    python benchmarks/stragglers.py --segments 4 --steps 30
    python benchmarks/stragglers.py --load 2           # beside two busy CPU hogs
    python benchmarks/stragglers.py --keep DIR         # keep every rank's rows in DIR ...
    python benchmarks/stragglers.py --replay DIR       # ... and score them again, no job run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

PARTS = ("data_wait", "forward", "backward", "optimizer", "other")
BASE = {"data_wait": 0.004, "forward": 0.004, "backward": 0.004, "optimizer": 0.002, "other": 0.001}
"""Seconds of work (sleep) per part on every rank: about 15 ms busy per step, plus compute."""
CALIBRATION_STEPS = 30


def plan(world: int, segments: int, seed: int) -> list[dict[str, Any]]:
    """Segments of one job: one in three healthy, the others one random straggler."""
    rng = random.Random(seed)
    out = []
    for i in range(segments):
        if i % 3 == 2:
            out.append({"kind": "healthy", "slow": None})
        else:
            out.append({"kind": rng.choice(PARTS), "slow": rng.randrange(world)})
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpmon
    from ddpmon.steps import busy_seconds

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", store=dist.FileStore(args.store, world), rank=rank, world_size=world
    )
    extra: dict[str, float] = dict.fromkeys(PARTS, 0.0)

    def sleep(part: str) -> None:
        time.sleep(BASE[part] + extra[part])

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            sleep("backward")
            return grad

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            sleep("forward")
            return Slow.apply(self.body(x))

    class SGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            sleep("optimizer")
            return super().step(closure)

    torch.manual_seed(0)
    model = DDP(Net())
    monitor = ddpmon.attach(model, job="stragglers-bench", port=-1, state_dir=None)
    opt = SGD(model.parameters(), lr=1e-3)
    rng = random.Random(1000 + rank)

    def step() -> None:
        x, y = torch.randn(16, 32), torch.randn(16, 8)
        sleep("data_wait")
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        sleep("other")
        opt.step()

    # "10% slower" is 10% of the busy time ddpmon measures (sleeps, compute and overheads),
    # taken from a warm-up every rank agrees on: the slowest rank's median.
    for _ in range(CALIBRATION_STEPS):
        step()
    measured = torch.tensor(
        [
            statistics.median(
                busy_seconds(r)
                for r in monitor.recorder.history_since(0)[-CALIBRATION_STEPS // 2 :]
            )
        ]
    )
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    busy = float(measured)
    marks: list[int] = []
    rows = monitor.recorder.history_since(0)
    for segment in plan(world, args.segments, args.seed):
        jitter = (args.healthy_jitter if segment["kind"] == "healthy" else args.jitter) * busy
        marks.append(monitor.recorder.steps)
        for _ in range(args.steps):
            extra.update(dict.fromkeys(PARTS, 0.0))
            extra[rng.choice(PARTS)] = rng.uniform(0.0, jitter)
            if segment["slow"] == rank:
                extra[segment["kind"]] += args.slowdown * busy
            step()
        rows += monitor.recorder.history_since(rows[-1].step)  # it keeps the last thousand or so
    monitor.detach()
    with open(os.path.join(args.out, f"rows-{rank}.json"), "w") as f:
        json.dump({"marks": marks, "busy": busy, "rows": [dataclasses.asdict(r) for r in rows]}, f)
    dist.barrier()
    dist.destroy_process_group()


KEPT_ARGS = ("segments", "steps", "slowdown", "jitter", "healthy_jitter", "seed", "load")
"""What a replay takes from the kept run rather than from its own command line."""


def run_job(world: int, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    if args.replay:
        return load_rows(os.path.join(args.replay, f"world-{world}"), world)
    if args.keep:
        out = os.path.join(args.keep, f"world-{world}")
        os.makedirs(out, exist_ok=True)
    else:
        out = tempfile.mkdtemp(prefix=f"ddpmon-stragglers-{world}-")
    env = dict(os.environ, WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    store = os.path.join(tempfile.mkdtemp(prefix="ddpmon-stragglers-store-"), "store")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--rank-worker",
        "--store",
        store,
        "--out",
        out,
        *sys.argv[1:],
    ]
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r))) for r in range(world)]
    if any(p.wait(timeout=1800) != 0 for p in procs):
        raise SystemExit(f"the {world}-rank job failed")
    return load_rows(out, world)


def load_rows(folder: str, world: int) -> dict[int, dict[str, Any]]:
    out = {}
    for r in range(world):
        with open(os.path.join(folder, f"rows-{r}.json")) as f:
            out[r] = json.load(f)
    return out


def start_hogs(count: int) -> list[subprocess.Popen[bytes]]:
    """Processes that keep a core busy each: the machine a job shares with another."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def evaluate(
    world: int, data: dict[int, dict[str, Any]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Score each segment after each of its steps, as the doctor would have."""
    from ddpmon import steps

    results = []
    for i, segment in enumerate(plan(world, args.segments, args.seed)):
        rows = {
            r: [
                steps.StepRow(**row)
                for row in d["rows"]
                if d["marks"][i] < row["step"] <= d["marks"][i] + args.steps
            ]
            for r, d in data.items()
        }
        named_at, cause_at_naming, ever_named, final = None, None, set(), {}
        for k in range(steps.MIN_STEPS, args.steps + 1):
            scores = steps.scores({r: steps.step_parts(rs[:k]) for r, rs in rows.items()})
            named = {r: s.cause for r, s in scores.items() if s.straggler}
            ever_named |= set(named)
            if named_at is None and segment["slow"] in named and len(named) == 1:
                named_at, cause_at_naming = k, named[segment["slow"]]
            final = named
        results.append(
            {
                "world": world,
                **segment,
                "named_at": named_at,
                "cause": cause_at_naming,
                "ever_named": sorted(ever_named),
                "final": final,
            }
        )
    return results


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worlds", default="2,3,4", help="world sizes, one job each")
    p.add_argument("--segments", type=int, default=16, help="segments per job")
    p.add_argument("--steps", type=int, default=40, help="steps per segment")
    p.add_argument(
        "--slowdown", type=float, default=0.10, help="the straggler's extra busy time (share)"
    )
    p.add_argument(
        "--jitter", type=float, default=0.10, help="random jitter in straggler segments (share)"
    )
    p.add_argument(
        "--healthy-jitter",
        type=float,
        default=0.30,
        help="random jitter in healthy segments (share)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--load", type=int, default=0, metavar="N", help="run N busy CPU hogs beside the jobs"
    )
    p.add_argument("--keep", metavar="DIR", help="keep every rank's step rows in DIR")
    p.add_argument(
        "--replay", metavar="DIR", help="score the rows kept in DIR instead of running jobs"
    )
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_worker:
        worker(args)
        return 0
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        with open(os.path.join(args.keep, "args.json"), "w") as f:
            json.dump({k: getattr(args, k) for k in KEPT_ARGS}, f)
    if args.replay:
        with open(os.path.join(args.replay, "args.json")) as f:
            vars(args).update(json.load(f))
    results = []
    hogs = start_hogs(args.load) if not args.replay else []
    try:
        for world in (int(w) for w in args.worlds.split(",")):
            results += evaluate(world, run_job(world, args), args)
    finally:
        for hog in hogs:
            hog.kill()
    stragglers = [r for r in results if r["slow"] is not None]
    healthy = [r for r in results if r["slow"] is None]
    named20 = [r for r in stragglers if r["named_at"] is not None and r["named_at"] <= 20]
    right = [r for r in stragglers if r["named_at"] is not None and r["cause"] == r["kind"]]
    wrong_rank = [r for r in stragglers if set(r["ever_named"]) - {r["slow"]}]
    false_pos = [r for r in healthy if r["ever_named"]]
    false_pos_final = [r for r in healthy if r["final"]]
    for r in results:
        print(
            f"world {r['world']} {r['kind']:<9} slow {r['slow']!s:<4} named at {r['named_at']!s:<4} "
            f"cause {r['cause']!s:<9} ever named {r['ever_named']}"
        )
    print(
        f"\n{len(stragglers)} stragglers ({args.slowdown:.0%} slower, jitter {args.jitter:.0%}), "
        f"{len(healthy)} healthy segments (jitter {args.healthy_jitter:.0%}); worlds {args.worlds}; "
        f"{args.load} CPU hogs beside"
    )
    print(f"named within 20 steps: {len(named20)}/{len(stragglers)}")
    named = [r["named_at"] for r in stragglers if r["named_at"] is not None]
    if named:
        print(f"steps to name it: median {sorted(named)[len(named) // 2]}, max {max(named)}")
    print(
        f"cause right when named: {len(right)}/{len([r for r in stragglers if r['named_at'] is not None])}"
    )
    print(f"another rank named in a straggler segment: {len(wrong_rank)}/{len(stragglers)}")
    print(
        f"healthy segments called stragglers at any step: {len(false_pos)}/{len(healthy)}; "
        f"after the last step: {len(false_pos_final)}/{len(healthy)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
