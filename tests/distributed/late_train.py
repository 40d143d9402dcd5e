"""A plain DDP script (no ddpmon in it) whose rank 1 prepares its data before
init_process_group, as one rank tokenizing or downloading does, until the file GO exists
(the test has seen it late; at most 60 s)."""

import os
import sys
import time

import torch
import torch.distributed as dist


def prepare_dataset():
    if int(os.environ["RANK"]) == 1:
        while not os.path.exists(sys.argv[1]) and time.monotonic() < GIVE_UP:
            time.sleep(0.05)
    return torch.randn(16, 8)


GIVE_UP = time.monotonic() + 60
data = prepare_dataset()
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(data).sum().backward()
    opt.step()
dist.destroy_process_group()
