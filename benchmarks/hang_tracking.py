"""What hang tracking costs, and how fast the doctor answers.

    python benchmarks/hang_tracking.py

1. A 2-rank CPU gloo DDP job with ddpmon attached: blocks of steps alternate between
   collective tracking on and off (same run, same model); prints the median step-time ratio
   on/off with its spread, and the median time of a one-float all_reduce on a one-rank
   group (the call's own cost) with and without tracking.
2. ``ddpmon doctor`` on 64 synthetic ranks' state files (a hang): median wall time of
   ``examine()`` over 5 runs.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS, BLOCKS, WARMUP, CALLS = 30, 40, 20, 200


def rank_main(rank: int, world: int, store_path: str, state_dir: str, queue: object) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpmon

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]), bucket_cap_mb=0.25)
    mon = ddpmon.attach(model, job="bench", port=-1, state_dir=state_dir)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    x, y = torch.randn(64, 256), torch.randn(64, 256)

    def steps(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return (time.perf_counter() - start) / n

    solo = dist.new_group([0])  # a one-member group: the call's own cost, no peer to wait for

    def calls(n: int) -> float:
        if rank != 0:
            return 0.0
        t = torch.ones(1)
        start = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t, group=solo)
        return (time.perf_counter() - start) / n

    steps(WARMUP)
    ratios, call_on, call_off = [], [], []
    for block in range(BLOCKS):
        on_first = block % 2 == 0
        timings = {}
        for tracked in (True, False) if on_first else (False, True):
            (mon._collectives.install if tracked else mon._collectives.remove)()
            timings[tracked] = steps(STEPS)
            (call_on if tracked else call_off).append(calls(CALLS))
        ratios.append(timings[True] / timings[False])
    mon._collectives.install()
    mon.detach()
    if rank == 0:
        queue.put((ratios, call_on, call_off))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def job() -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=rank_main,
                args=(r, 2, os.path.join(tmp, "store"), os.path.join(tmp, "state"), queue),
            )
            for r in range(2)
        ]
        for p in procs:
            p.start()
        ratios, call_on, call_off = queue.get(timeout=600)
        for p in procs:
            p.join(60)
    q = statistics.quantiles(ratios, n=4)
    print(
        f"step time, collective tracking on / off: median {statistics.median(ratios):.3f} "
        f"(quartiles {q[0]:.3f}..{q[2]:.3f}, {BLOCKS} blocks of {STEPS} steps, 2 ranks, gloo, CPU)"
    )
    on, off = statistics.median(call_on), statistics.median(call_off)
    print(
        f"dist.all_reduce of 1 float on a one-rank gloo group: {on * 1e6:.1f} us tracked, "
        f"{off * 1e6:.1f} us untracked (+{(on - off) * 1e6:.1f} us per call)"
    )


def doctor() -> None:
    from ddpmon.doctor import examine
    from ddpmon.state import files as statefile

    now = time.time()
    frames = [{"file": "train.py", "line": i, "function": f"f{i}", "code": ""} for i in range(40)]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(64):
            waits = (
                []
                if r == 37
                else [
                    {
                        "seq": 900 + b,
                        "op": "all_reduce",
                        "group": "0",
                        "group_size": 64,
                        "bytes": 1 << 22,
                        "call_site": "train.py:88",
                        "function": "step",
                        "issued_unix": now - 20,
                        "bucket": b,
                    }
                    for b in range(25)
                ]
            )
            statefile.write_atomic(
                statefile.path_for(tmp, r),
                {
                    "rank": r,
                    "world_size": 64,
                    "host": f"node-{r // 8}",
                    "pid": 1000 + r,
                    "job": "j",
                    "backend": "nccl",
                    "now_unix": now,
                    "last_progress_unix": now - 20,
                    "step": 500,
                    "phase": "allreduce",
                    "in_flight": waits,
                    "state_interval": 1.0,
                    "collective_sites": {f"all_reduce train.py:{i}": 100 for i in range(60)},
                    "hang": {
                        "threads": [{"name": "MainThread", "main": True, "frames": frames}] * 8
                    },
                    "timings": {"window_steps": 256, "step_seconds": {"median": 0.5, "max": 0.9}},
                },
            )
        times = []
        for _ in range(5):
            start = time.perf_counter()
            d = examine(tmp)
            times.append(time.perf_counter() - start)
        assert d.suspect_ranks == [37], d.as_dict()
    print(
        f"ddpmon doctor on 64 ranks' state files (a hang): median {statistics.median(times) * 1000:.0f} ms "
        f"over 5 runs"
    )


if __name__ == "__main__":
    job()
    doctor()
