"""A training script that knows nothing of ddpmon, for restarted jobs under ``ddpmon run``.

    python restart_train.py OUT_DIR [--steps N] [--culprit R] [--at STEP] [--fault stall|raise]
        [--pause-every N --pause-seconds S] [--batch B] [--lr LR] [--optimizer sgd|adamw]
        [--warmup STEPS]

In the job's first attempt (TORCHELASTIC_RESTART_COUNT=0) rank ``--culprit`` misbehaves at
step ``--at``: ``stall`` waits forever for its next batch (a data loader that never
answers), ``raise`` raises. Later attempts train every step and each rank writes
``done-<rank>-<attempt>`` at the end. Every ``--pause-every`` steps the ranks evaluate (the
DDP model under no_grad) for about ``--pause-seconds``, then rank 0 writes a checkpoint while
the others wait in a barrier. Each rank writes ``started-<rank>-<attempt>`` (the time of
its first line: its process was created a little earlier) and ``ended-<rank>-<attempt>``
(the time it finished): the test's own measure of the wall time.
"""

import time

STARTED = time.time()

import argparse  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--culprit", type=int, default=1)
    p.add_argument("--at", type=int, default=5)
    p.add_argument("--fault", choices=("stall", "raise", "none"), default="stall")
    p.add_argument("--pause-every", type=int, default=0)
    p.add_argument("--pause-seconds", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--warmup", type=int, default=0, help="steps of a linear warm-up to --lr")
    return p.parse_args()


def next_batch(step, faulty, fault):
    if faulty and fault == "stall":
        with open(os.path.join(ARGS.out, f"stalled-{dist.get_rank()}"), "w") as f:
            f.write(str(time.time()))
        while True:  # the loader's worker never answers
            time.sleep(0.5)
    if faulty and fault == "raise":
        raise RuntimeError(f"bad batch at step {step}")
    return torch.randn(ARGS.batch, 8)


def pause(model):
    """An evaluation through the DDP model, then a checkpoint by rank 0 (the others wait)."""
    until = time.time() + ARGS.pause_seconds / 2
    with torch.no_grad():
        while time.time() < until:
            model(torch.randn(64, 8))
    if dist.get_rank() == 0:
        until = time.time() + ARGS.pause_seconds / 2
        while time.time() < until:
            torch.save(model.module.state_dict(), os.path.join(ARGS.out, "checkpoint.pt"))
    dist.barrier()


def main():
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(os.path.join(ARGS.out, f"started-{RANK}-{attempt}"), "w") as f:
        f.write(str(STARTED))
    # A store of each attempt's own: torchrun's store keeps the gloo addresses of the attempt
    # before, which a restarted rank can read and fail to connect to (connection refused).
    world = int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(os.path.join(ARGS.out, f"store-{attempt}"), world)
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]), world_size=world)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    make = torch.optim.SGD if ARGS.optimizer == "sgd" else torch.optim.AdamW
    opt = make(model.parameters(), lr=ARGS.lr)
    warmup = torch.optim.lr_scheduler.LinearLR(
        opt, start_factor=1 / (ARGS.warmup + 1), total_iters=ARGS.warmup
    )
    for step in range(ARGS.steps):
        if ARGS.pause_every and step and step % ARGS.pause_every == 0:
            pause(model)
        faulty = attempt == 0 and dist.get_rank() == ARGS.culprit and step == ARGS.at
        x = next_batch(step, faulty, ARGS.fault)
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        warmup.step()
        time.sleep(0.02)
    with open(os.path.join(ARGS.out, f"done-{dist.get_rank()}-{attempt}"), "w") as f:
        f.write(str(time.time()))
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(ARGS.out, f"ended-{RANK}-{attempt}"), "w") as f:
        f.write(str(time.time()))


if __name__ == "__main__":
    ARGS = parse()
    RANK = int(os.environ["RANK"])
    main()
