"""A plain DDP script (no ddpmon in it) whose rank 1 prepares its data for LATE seconds
before init_process_group, as one rank tokenizing or downloading does."""

import os
import sys
import time

import torch
import torch.distributed as dist


def prepare_dataset():
    if int(os.environ["RANK"]) == 1:
        time.sleep(float(sys.argv[1]))
    return torch.randn(16, 8)


data = prepare_dataset()
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(data).sum().backward()
    opt.step()
dist.destroy_process_group()
