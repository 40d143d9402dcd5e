"""A rank of a job whose rank 1 is slower by ``DELAY`` seconds before each forward (its data
loader), from the first step on, stepping until ``DDPMON_TEST_OUT/stop`` appears (at most
90 s): ``python -m tests.distributed.paced_straggler_worker``. For
tests/distributed/test_doctor_from_straggler.py, which asks the doctor here and through the
node daemon at moments it picks."""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpmon
from tests.distributed.worker import MLP, RANK, batch, init

DELAY = 0.02
JOB = "paced-straggler"


def main() -> None:
    init()
    torch.manual_seed(0)
    model = DDP(MLP())
    ddpmon.attach(model, job=JOB, port=-1)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    stop = os.path.join(os.environ["DDPMON_TEST_OUT"], "stop")
    deadline = time.monotonic() + 90
    step = 0
    while time.monotonic() < deadline:
        if step % 10 == 0:  # every rank stops at the same step: the other waits in no collective
            flag = torch.tensor([float(os.path.exists(stop))])
            torch.distributed.all_reduce(flag)
            if flag.item():
                break
        if RANK == 1:
            time.sleep(DELAY)
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        step += 1
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
