"""Synthetic history databases, as ranks would write them: for the scale benchmark
(benchmarks/report_scale.py) and the report's tests without a training job; a developer's
tool, outside the installed package."""

from __future__ import annotations

import os
import random
import time
from typing import Any

from ddpmon.state import history


def write_run(
    state_dir: str,
    ranks: int,
    steps: int,
    *,
    job: str = "synthetic",
    buckets: int = 4,
    slow_rank: int | None = None,
    slow_seconds: float = 0.02,
    step_seconds: float = 0.1,
    gpu: bool = True,
    seed: int = 0,
    batch: int = 5000,
    slow_part: str = "backward",
    clock_offsets: dict[str, float] | None = None,
) -> list[str]:
    """Write ``ranks`` databases of ``steps`` steps each; ``slow_rank`` spends ``slow_seconds``
    longer in ``slow_part`` (one of ``steps.PARTS``), and the others wait that long in
    exposed comm. ``clock_offsets`` sets a host's clock ahead by that many seconds (hosts
    are ``node<rank // 8>``)."""
    os.makedirs(state_dir, exist_ok=True)
    rng = random.Random(seed)
    start = time.time() - steps * step_seconds
    paths = []
    for rank in range(ranks):
        identity = {
            "rank": rank,
            "world_size": ranks,
            "ddp_world_size": ranks,
            "job": job,
            "host": f"node{rank // 8}",
            "device": f"cuda:{rank % 8}" if gpu else "cpu",
            "backend": "nccl" if gpu else "gloo",
            "local_rank": rank % 8,
        }
        path = history.path_for(state_dir, rank)
        store = history.HistoryStore(path, identity)
        rows: list[dict[str, Any]] = []
        for step in range(1, steps + 1):
            fwd = step_seconds * 0.3 * (1 + 0.05 * rng.random())
            bwd = step_seconds * 0.5 * (1 + 0.05 * rng.random())
            slow = slow_seconds if rank == slow_rank else 0.0
            exposed = step_seconds * 0.1 + (
                0.0 if rank == slow_rank or slow_rank is None else slow_seconds
            )
            total = fwd + bwd + slow + exposed + step_seconds * 0.1
            t0 = (
                start + (step - 1) * step_seconds + (clock_offsets or {}).get(identity["host"], 0.0)
            )
            row: dict[str, Any] = {
                "step": step,
                "start_unix": t0,
                "end_unix": t0 + total,
                "step_seconds": total,
                "forward_seconds": fwd,
                "backward_seconds": bwd,
                "exposed_comm_seconds": exposed,
                "buckets": [
                    {
                        "index": i,
                        "seconds": 0.004 * (1 + i) * (1 + 0.1 * rng.random()),
                        "bytes": 25 * 2**20,
                    }
                    for i in range(buckets)
                ],
                "gpu_utilization_ratio": 0.8 + 0.1 * rng.random() if gpu else None,
                "gpu_memory_used_bytes": (20 + rank % 3) * 2**30 if gpu else None,
                "process_resident_memory_bytes": 3 * 2**30,
            }
            row[f"{slow_part}_seconds"] = (row.get(f"{slow_part}_seconds") or 0.0) + slow
            rows.append(row)
            if len(rows) >= batch:
                store.add_steps(rows)
                rows = []
        store.add_steps(rows)
        store.set_exit("exited", steps, {"unix": time.time(), "exception": None})
        store.close()
        paths.append(path)
    return paths
