"""One rank of a job whose ranks fail in turn once every rank has measured its clock:
``python -m tests.distributed.clock_worker fail_in_turn FIRST SECOND GAP``.

Same environment as ``hang_worker.py``. The ranks train until every one's clock offset from
rank 0's is measured (``rank/clock_offset.py``; an all-reduce of a flag each step), then
rank FIRST raises, rank SECOND raises GAP seconds later, and the others fail in their next
all-reduce on the closed connection.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from ddpmon.rank import clock_offset
from tests.distributed.hang_worker import OUT, RANK, STEPS, setup, train_step
from tests.distributed.worker import batch


def fail_in_turn(first: str = "2", second: str = "1", gap: str = "2.0") -> None:
    ddp, _mon, opt = setup("clocks")
    deadline = time.monotonic() + 60
    for step in range(STEPS):
        train_step(ddp, opt, *batch(step))
        measured = torch.tensor([1.0 if clock_offset.measured() is not None else 0.0])
        dist.all_reduce(measured, op=dist.ReduceOp.MIN)
        if measured.item() == 1.0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    with open(f"{OUT}/result-{RANK}.json", "w") as f:
        json.dump({"step": step, "clock": str(clock_offset.measured())}, f)
    if RANK == int(first):
        raise RuntimeError("the first failure")
    if RANK == int(second):
        time.sleep(float(gap))
        raise RuntimeError("the second failure")
    for later in range(step + 1, STEPS):
        train_step(ddp, opt, *batch(later))


if __name__ == "__main__":
    {"fail_in_turn": fail_in_turn}[sys.argv[1]](*sys.argv[2:])
