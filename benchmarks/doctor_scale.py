"""Doctor time against the number of ranks: N realistic state files (buckets, collective
sites, a hang report with stacks on every rank), one rank stuck outside any collective; the
whole `ddpmon doctor DIR --json` command timed end to end, Python start-up included.

    python benchmarks/doctor_scale.py --ranks 64 1024
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from ddpmon.rank.recorder import BucketTiming, Recorder
from ddpmon.state import files as statefile
from ddpmon.state.schema import Identity


def rank_state(rank: int, world: int, now: float) -> dict:
    rec = Recorder(
        Identity(
            rank=rank,
            local_rank=rank % 8,
            world_size=world,
            host=f"node-{rank // 8}",
            pid=10000 + rank,
            port=9500 + rank % 8,
            job="scale",
            backend="nccl",
            debug_level="OFF",
            state_interval=1.0,
        ),
        world,
    )
    for b in range(24):
        rec.set_bucket_layout(
            b, 25 << 20, "bfloat16", [f"layers.{b}.{p}" for p in ("q", "k", "v", "o", "mlp")]
        )
    for s in range(300):
        rec.forward_started(s * 0.1)
        rec.forward_finished(s * 0.1 + 0.02)
        rec.backward_done(s * 0.1 + 0.07)
        rec.close_step(s * 0.1 + 0.1)
        rec.add_bucket_timings(
            [BucketTiming(b, 0.03 + b * 1e-3, b * 1e-3, b * 1e-3 + 0.004) for b in range(24)]
        )
    snap = rec.snapshot()
    frames = [
        {"file": "/src/train.py", "line": 100 + i, "function": f"step_{i}", "code": "x = f(x)"}
        for i in range(30)
    ]
    stuck = rank == world // 3
    in_flight = (
        []
        if stuck
        else [
            {
                "seq": 7000 + b,
                "op": "all_reduce",
                "group": "0",
                "group_size": world,
                "bytes": 25 << 20,
                "call_site": "DDP backward",
                "function": "backward",
                "issued_unix": now - 120,
                "bucket": b,
                "step": 300,
            }
            for b in range(24)
        ]
    )
    snap.update(
        now_unix=now,
        last_progress_unix=now - 120,
        started_unix=now - 3600,
        phase="after_forward" if stuck else "allreduce",
        in_flight=in_flight,
        collective_seq={"0": 7023 - (24 if stuck else 0)},
        collective_sites={f"all_reduce /src/train.py:{i}": 100 for i in range(40)},
        hang={
            "detected_unix": now - 60,
            "last_progress_unix": now - 120,
            "silent_seconds": 60.0,
            "timeout_seconds": 60.0,
            "timeout_source": "learned",
            "threads": [{"name": "MainThread", "main": True, "frames": frames}] * 6,
            "in_flight": in_flight,
        },
    )
    return snap


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, nargs="*", default=[64, 1024])
    args = p.parse_args()
    for world in args.ranks:
        directory = tempfile.mkdtemp(prefix=f"ddpmon-doctor-{world}-")
        now = time.time()
        states = [rank_state(r, world, now) for r in range(world)]
        now = time.time()  # every file as if written just now, so that none is stale
        for state in states:
            state.update(now_unix=now, last_progress_unix=now - 120, started_unix=now - 3600)
            state["hang"].update(detected_unix=now - 60, last_progress_unix=now - 120)
            path = statefile.path_for(directory, state["rank"])
            statefile.write_atomic(path, state)
            os.utime(path, (now, now))
        size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "ddpmon", "doctor", directory, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        took = time.perf_counter() - start
        out = json.loads(done.stdout)
        print(
            f"{world:>5} ranks, {size / 2**20:6.1f} MiB of state files: doctor {took:5.2f} s "
            f"(exit {done.returncode}, verdict {out['verdict']}, suspects {out['suspect_ranks']})"
        )
        shutil.rmtree(directory, ignore_errors=True)  # 33 MiB a run at 1,024 ranks


if __name__ == "__main__":
    main()
