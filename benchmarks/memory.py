"""Memory over a long run: a million simulated steps through the recorder and a bucket clock
(the code the hooks call each step), with RSS and Python heap printed along the way.

    python benchmarks/memory.py --steps 1000000                # the comm hook's wall clock
    python benchmarks/memory.py --steps 1000000 --clock c10d   # completions as c10d sends them
"""

from __future__ import annotations

import argparse
import datetime
import gc
import time
import tracemalloc
from types import SimpleNamespace

import psutil
import torch._C._distributed_c10d as c10d

from ddpmon.fuses import Fuse
from ddpmon.rank.recorder import Recorder
from ddpmon.rank.timing.c10d import CompletionClock
from ddpmon.rank.timing.hook import WallClock
from ddpmon.state.schema import Identity

IDENTITY = dict(
    rank=0,
    local_rank=0,
    world_size=8,
    host="node0",
    pid=1,
    job="bench",
    backend="gloo",
    torch_version="2.13.0",
    debug_level="OFF",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--buckets", type=int, default=8)
    p.add_argument("--params", type=int, default=64)
    p.add_argument("--clock", choices=("hook", "c10d"), default="hook")
    args = p.parse_args()
    rec = Recorder(Identity(**IDENTITY), world_size=8)
    clock = (
        WallClock() if args.clock == "hook" else CompletionClock("cpu", False, Fuse("comm_hook"))
    )
    seq = 0
    names = [f"layer{i}.weight" for i in range(args.params)]
    for b in range(args.buckets):
        rec.set_bucket_layout(b, 4 << 20, "float32", names[b :: args.buckets])
    proc = psutil.Process()
    tracemalloc.start()
    checkpoints = max(1, args.steps // 10)
    start = time.perf_counter()
    print(f"{'step':>9} {'rss MiB':>8} {'python heap KiB':>16} {'us/step':>8}")
    t = 0.0
    for step in range(1, args.steps + 1):
        rec.forward_started(t)
        rec.forward_finished(t + 0.001)
        rec.backward_started(t + 0.002)
        for _ in range(args.params):
            rec.backward_done(t + 0.003)
        if isinstance(clock, CompletionClock):  # what c10d's thread sends, one per bucket
            clock.backward_started(time.perf_counter())
            started = datetime.datetime.now()
            clock.backward_done()
            clock.sync_done()
            t += 0.01
            rec.close_step(t)
            clock.new_step(rec.steps, args.buckets)
            for _ in range(args.buckets):
                seq += 1
                clock.on_completion(
                    SimpleNamespace(
                        op_type=c10d.OpType.ALLREDUCE,
                        seq=seq,
                        time_started=started,
                        active_duration=datetime.timedelta(milliseconds=2),
                    )
                )
        else:
            for b in range(args.buckets):
                rec.bucket_launched(b == args.buckets - 1)
                clock.finish(clock.start(b, 0.003))
                rec.bucket_completed(b == args.buckets - 1)
            t += 0.01
            rec.close_step(t)
            clock.new_step(rec.steps)
        for resolved in clock.collect():
            rec.add_step_timings(resolved)
        rec.set_unused_parameters(["layer3.weight"] if step % 1000 == 0 else [])
        if step % checkpoints == 0 or step == 1000:
            gc.collect()
            heap, _ = tracemalloc.get_traced_memory()
            elapsed = time.perf_counter() - start
            print(
                f"{step:>9} {proc.memory_info().rss / 2**20:>8.1f} {heap / 1024:>16.1f} {elapsed / step * 1e6:>8.1f}",
                flush=True,
            )
    snap = rec.snapshot()
    timed = min((b["count"] for b in snap["buckets"]), default=0)
    print(
        f"done: {snap['step']} steps, {len(snap['buckets'])} buckets timed {timed} times each, "
        f"window {snap['timings']['window_steps']} steps"
    )


if __name__ == "__main__":
    main()
