"""A training script that knows nothing of ddpmon, for ``ddpmon run`` tests.

    python plain_train.py OUT_DIR [--steps N] [--models K] [--fail] [--spawn WORLD] [--exit CODE] [--attach]

Under torchrun it uses torchrun's rendezvous; with ``--spawn`` it starts its own ranks
with ``torch.multiprocessing.spawn`` (a function and a class of this file are pickled) and a
FileStore in OUT_DIR. Each rank writes ``seen-<rank>.json``: what the script saw of itself
(``sys.argv``, ``__name__``, ``__file__``, ``sys.path[0]``) and of ddpmon. With ``--attach``
it also calls ``ddpmon.attach`` itself, as a script written for ddpmon would.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):  # pickled to the spawned ranks by reference: __main__.Net
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--models", type=int, default=1)
    p.add_argument("--fail", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--attach", action="store_true")
    return p.parse_args()


def train(rank, world, args, net_class):
    if args.spawn:
        store = dist.FileStore(os.path.join(args.out, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    models = [DDP(net_class()) for _ in range(args.models)]
    explicit = None
    if args.attach:
        import ddpmon

        explicit = ddpmon.attach(models[0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    for _ in range(args.steps):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    import ddpmon.launch  # only to report what happened; the script never calls ddpmon

    seen = {
        "argv": sys.argv,
        "name": __name__,
        "file": __file__,
        "path0": sys.path[0],
        "monitors": [m.state_file for m in ddpmon.launch.monitors()]
        if "ddpmon.launch" in sys.modules
        else [],
        "net_module": net_class.__module__,
        "explicit_is_launched": explicit is not None and explicit is ddpmon.launch.monitors()[0],
        "pythonpath": os.environ.get("PYTHONPATH", ""),
    }
    with open(os.path.join(args.out, f"seen-{dist.get_rank()}.json"), "w") as f:
        json.dump(seen, f)
    dist.barrier()
    if args.fail and dist.get_rank() == 1:
        fail_here()
    dist.destroy_process_group()


def fail_here():
    raise ValueError("boom from the training script")


def spawned(rank, world, args, net_class):
    train(rank, world, args, net_class)


if __name__ == "__main__":
    args = parse()
    if args.spawn:
        import torch.multiprocessing as mp

        mp.spawn(spawned, args=(args.spawn, args, Net), nprocs=args.spawn)
    else:
        train(None, None, args, Net)
    sys.exit(args.exit)
