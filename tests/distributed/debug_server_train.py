"""A 2-rank training script beside torch's debug server, for tests/distributed/test_debug_server.py.

    python debug_server_train.py OUT_DIR [--own-server PORT] [--steps N] [--tail SECONDS]

With ``--own-server`` the script starts ``torch.distributed.debug.start_debug_server`` itself
(dumps every 0.2 s into OUT_DIR/dumps), as a program written for it would. After training,
rank 0 waits until OUT_DIR/release exists (the test reads the servers meanwhile), then every
rank writes its losses and parameters; rank 0 ends ``--tail`` seconds after the others, as a
rank that saves a checkpoint does.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--own-server", type=int, default=0)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--tail", type=float, default=0.0)
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
if args.own_server:
    from torch.distributed.debug import start_debug_server

    start_debug_server(
        port=args.own_server, dump_dir=os.path.join(args.out, "dumps"), dump_interval=0.2
    )
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(rank)
losses = []
for _ in range(args.steps):
    loss = model(torch.randn(16, 8, generator=data)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
if rank == 0:
    deadline = time.monotonic() + 90
    while not os.path.exists(os.path.join(args.out, "release")) and time.monotonic() < deadline:
        time.sleep(0.05)
dist.barrier()
with open(os.path.join(args.out, f"result-{rank}.json"), "w") as f:
    json.dump({"losses": losses, "params": [t.tolist() for t in model.parameters()]}, f)
dist.destroy_process_group()
if rank == 0:
    time.sleep(args.tail)
