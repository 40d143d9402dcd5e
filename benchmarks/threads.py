"""CPU time and wake-ups of every thread of an attached rank: what ddpmon's own threads take
from a job, each on its own.

A DDP job (the MLP of overhead.py, gloo, ``--ranks`` ranks under torchrun, its endpoint
scraped every ``--scrape`` seconds) trains ``--warmup`` steps, then rank 0 reads every
thread's CPU time and context switches from /proc/self/task before and after ``--seconds``
of training, and prints them per thread: CPU milliseconds per second, voluntary switches
(wake-ups) and involuntary ones (preempted) per second. On a machine with no spare core
(2 ranks on 2 cores) every millisecond a ddpmon thread takes is one a rank waits for.
/proc counts CPU in ticks of 10 ms: over 20 s a figure moves in steps of 0.5 ms/s.

    python benchmarks/threads.py                  # 2 ranks, 20 s
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from overhead import build_model, scraped, under_torchrun  # as in overhead.py


def threads() -> dict[int, tuple[str, float, int, int]]:
    """Each thread of this process: (name, CPU seconds, voluntary, involuntary switches)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except OSError:  # a thread that ended
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (
            stat[stat.index("(") + 1 : stat.rindex(")")],
            (int(fields[11]) + int(fields[12])) / tick,
            int(status["voluntary_ctxt_switches"]),
            int(status["nonvoluntary_ctxt_switches"]),
        )
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpmon

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(build_model(args))
    monitor = ddpmon.attach(model, job="threads", port=0)
    stop = scraped(monitor.metrics_url, args.scrape)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    before, start, steps = threads(), time.perf_counter(), 0
    while time.perf_counter() - start < args.seconds:
        step()
        steps += 1
    after, seconds = threads(), time.perf_counter() - start
    stop.set()
    if dist.get_rank() == 0:
        names = {t.native_id: t.name for t in threading.enumerate()}
        print(
            f"rank 0 of {dist.get_world_size()}: {steps} steps in {seconds:.1f} s "
            f"({seconds / steps * 1000:.2f} ms a step)"
        )
        print(f"  {'thread':<28} {'CPU ms/s':>9} {'wakes/s':>8} {'preempted/s':>12}")
        rows = []
        for tid, (name, cpu, woke, preempted) in after.items():
            _, cpu0, woke0, preempted0 = before.get(tid, (name, 0.0, 0, 0))
            rows.append(
                (
                    names.get(tid, name),
                    (cpu - cpu0) * 1000 / seconds,
                    (woke - woke0) / seconds,
                    (preempted - preempted0) / seconds,
                )
            )
        for name, cpu, woke, preempted in sorted(rows, key=lambda r: -r[1]):
            print(f"  {name:<28} {cpu:9.1f} {woke:8.1f} {preempted:12.1f}")
        ours = sum(r[1] for r in rows if r[0].startswith("ddpmon"))
        print(f"  {'(ddpmon threads, in all)':<28} {ours:9.1f}")
    monitor.detach()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=int, default=600, help="steps before the count")
    p.add_argument("--scrape", type=float, default=1.0, help="seconds between scrapes (0: none)")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.model = "mlp"
    if args.rank_worker:
        worker(args)
    else:
        under_torchrun(__file__, args.ranks, sys.argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
