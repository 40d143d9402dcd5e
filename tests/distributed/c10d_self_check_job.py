"""A world of one (gloo) whose c10d bucket timing finds nothing to time: run by
test_c10d_self_check.py as ``python -m tests.distributed.c10d_self_check_job`` under the
distributed harness.

gloo has no completion hook, so c10d's is stood in for as in tests/distributed/worker.py's
c10d_wiring: ddpmon's listener is kept in a list. Two models, one after the other:
``silent``, where c10d reports nothing at all (DDP's own all-reduce runs, no WorkInfo), and
``split``, where every bucket is reported as two all-reduces (a hook that splits buckets),
so no step fits DDP's buckets.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed.worker import MLP, captured_logs, init, read_state, scrape, train

STEPS = 25


def run(kind: str, listeners: list[Any]) -> dict[str, Any]:
    import ddpmon

    torch.manual_seed(0)
    model = DDP(MLP(), bucket_cap_mb=0.01)
    state_dir = os.path.join(os.environ["DDPMON_TEST_OUT"], f"state-{kind}")
    logs = captured_logs()
    mon = ddpmon.attach(model, job=kind, port=0, state_dir=state_dir)
    modes = [mon.snapshot()["bucket_timing"]]
    if kind == "split":

        def split(state, bucket):  # type: ignore[no-untyped-def]  # (DDP checks real annotations)
            for _ in range(2):
                record = types.SimpleNamespace(
                    op_type=torch._C._distributed_c10d.OpType.ALLREDUCE,
                    seq=0,
                    time_started=datetime.datetime.now(),
                    active_duration=datetime.timedelta(milliseconds=1),
                )
                for fn in tuple(listeners):
                    fn(record)
            return (
                dist.group.WORLD.allreduce([bucket.buffer()])
                .get_future()
                .then(lambda f: f.value()[0])
            )

        model.register_comm_hook(None, split)
    listening = len(listeners)
    train(model, STEPS)
    mon.step()
    snap = mon.snapshot()
    metrics = scrape(mon.port)
    mon.detach()
    state = read_state(os.path.join(state_dir, "rank-0.json"))
    return {
        "modes": modes + [snap["bucket_timing"]],
        "steps": snap["step"],
        "notes": snap["notes"],
        "listening": listening,
        "listeners_left": len(listeners),
        "state_mode": state["bucket_timing"],
        "state_notes": state["notes"],
        "info": [line for line in metrics.splitlines() if line.startswith("ddpmon_rank_info{")],
        "off_lines": [line for line in logs if "timing from c10d is off" in line],
        "warnings": [line for line in logs if "matched no step" in line],
    }


def main() -> None:
    from ddpmon.rank.timing import c10d as completion

    init()
    listeners: list[Any] = []
    completion.unavailable_reason = lambda group, device="cpu": None  # type: ignore[assignment]
    completion.listen = lambda group, fn: listeners.append(fn) or (lambda: listeners.remove(fn))  # type: ignore[assignment]
    completion.SETTLE_SECONDS = 0.0  # each step settles at its own boundary
    completion.SETTLE_MARGIN = 0.0
    result = {kind: run(kind, listeners) for kind in ("silent", "split")}
    with open(os.path.join(os.environ["DDPMON_TEST_OUT"], "result-0.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as worker.py: skip a gloo finalization that can abort


if __name__ == "__main__":
    main()
