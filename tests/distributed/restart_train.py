"""A training script that knows nothing of ddpmon, for restarted jobs under ``ddpmon run``.

    python restart_train.py OUT_DIR [--steps N] [--culprit R] [--at STEP] [--fault stall|raise]

In the job's first attempt (TORCHELASTIC_RESTART_COUNT=0) rank ``--culprit`` misbehaves at
step ``--at``: ``stall`` waits forever for its next batch (a data loader that never
answers), ``raise`` raises. Later attempts train every step and each rank writes
``done-<rank>-<attempt>`` at the end.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--culprit", type=int, default=1)
    p.add_argument("--at", type=int, default=5)
    p.add_argument("--fault", choices=("stall", "raise", "none"), default="stall")
    return p.parse_args()


def next_batch(step, faulty, fault):
    if faulty and fault == "stall":
        with open(os.path.join(ARGS.out, f"stalled-{dist.get_rank()}"), "w") as f:
            f.write(str(time.time()))
        while True:  # the loader's worker never answers
            time.sleep(0.5)
    if faulty and fault == "raise":
        raise RuntimeError(f"bad batch at step {step}")
    return torch.randn(4, 8)


def main():
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # A store of each attempt's own: torchrun's store keeps the gloo addresses of the attempt
    # before, which a restarted rank can read and fail to connect to (connection refused).
    world = int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(os.path.join(ARGS.out, f"store-{attempt}"), world)
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]), world_size=world)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(ARGS.steps):
        faulty = attempt == 0 and dist.get_rank() == ARGS.culprit and step == ARGS.at
        x = next_batch(step, faulty, ARGS.fault)
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        time.sleep(0.02)
    with open(os.path.join(ARGS.out, f"done-{dist.get_rank()}-{attempt}"), "w") as f:
        f.write(str(time.time()))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ARGS = parse()
    main()
