"""One rank of a randomized fault scenario: ``python -m tests.scenarios.worker KIND CULPRIT STEP``.

Environment as ``tests/support/harness.rank_env`` (RANK, WORLD_SIZE, DDPMON_TEST_STORE,
DDPMON_TEST_OUT, DDPMON_STATE_DIR). Every rank trains a small DDP MLP with ddpmon attached
(its default hang timeout logic, state written every 0.2 s); rank CULPRIT misbehaves at step
STEP as KIND says (``KINDS`` in ``tests/scenarios/runner.py``). A rank writes
``mark-<rank>-<name>`` into DDPMON_TEST_OUT when it reaches a moment the runner waits for.
``spawn`` runs the job under ``torch.multiprocessing.spawn`` instead (one process here).
"""

from __future__ import annotations

import ctypes
import io
import math
import os
import random
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpmon
from ddpmon.steps import SUSTAIN_SECONDS

OUT = os.environ.get("DDPMON_TEST_OUT", ".")
EXTRA_STEPS = 8
PACE = 0.005
"""Seconds every rank spends in each of data loading, forward, backward and the optimizer
per paced step."""
PACED_AT = int(
    os.environ.get("DDPMON_SCENARIO_PACED_AT", math.ceil((SUSTAIN_SECONDS + 3.0) / (4 * PACE)))
)
"""Steps after STEP in the straggler and jitter kinds when every rank marks ``paced``, and
the doctor is asked: by default as many as last 3 s longer than a straggler's gap must
hold before it is named, its history written (each paced step sleeps 4 x ``PACE`` at least)."""
PACED_STEPS = PACED_AT + 16
SLOW = float(os.environ.get("DDPMON_SCENARIO_SLOW_SHARE", "0.3")) * 4 * PACE
"""Seconds a straggler's part takes longer per step: by default 30% of the paced work (its
busy time about 25% longer, compute and overheads counted)."""
SLOW_PART = {
    "slow_data": "data_wait",
    "slow_forward": "forward",
    "slow_backward": "backward",
    "slow_optimizer": "optimizer",
}
HOLD = float(os.environ.get("DDPMON_SCENARIO_HOLD", "9"))
"""Seconds a long healthy pause (evaluation, checkpoint, post-loop work) lasts."""


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 8)
        self.extra = {"forward": 0.0, "backward": 0.0}
        """Seconds to sleep in the forward and in the backward of this step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.extra["forward"])
        return SleepInBackward.apply(self.b(torch.relu(self.a(x))), self.extra)


class SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, extra: dict[str, float]) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = extra["backward"]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


def mark(rank: int, name: str) -> None:
    open(os.path.join(OUT, f"mark-{rank}-{name}"), "w").close()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def load_data(rank: int, step: int, stall: bool) -> tuple[torch.Tensor, torch.Tensor]:
    while stall:
        time.sleep(0.05)  # a data loader that never returns
    return batch(rank, step)


def save_checkpoint(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:  # busy: serialising, writing
        sum(i * i for i in range(20000))


def evaluate(model: nn.Module, seconds: float) -> None:
    """Evaluation under ``no_grad``: through DDP's forward (``ddp``) or its inner module
    (``ddp.module``: no DDP forward, no heartbeat)."""
    end = time.time() + seconds
    with torch.no_grad():
        while time.time() < end:
            model(torch.randn(64, 32))


def write_checkpoint(model: nn.Module, rank: int, seconds: float) -> None:
    """A checkpoint written again and again: serialising (CPU) and writing (I/O)."""
    end = time.time() + seconds
    while time.time() < end:
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "extra": torch.randn(256, 1024)}, buffer)
        with open(os.path.join(OUT, f"checkpoint-{rank}.pt"), "wb") as f:
            f.write(buffer.getvalue())


def run(rank: int, world: int, kind: str, culprit: int, at: int) -> None:
    store = dist.FileStore(os.environ["DDPMON_TEST_STORE"], world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    torch.manual_seed(0)
    model = MLP()
    ddp = DDP(model)
    ddpmon.attach(ddp, job="scenario", state_interval=0.2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    slow_optimizer = [0.0]
    opt.register_step_pre_hook(
        lambda *_: time.sleep(slow_optimizer[0])
    )  # inside the optimizer's step
    me = rank == culprit
    paced = kind in SLOW_PART or kind in ("jitter", "fetch_between")
    loader = epochs(rank, world) if kind == "peek" else None
    steps = at + (PACED_STEPS if paced else EXTRA_STEPS)
    if kind == "uneven" and me:
        steps = at  # fewer batches on this rank
    if kind == "uneven_more" and me:
        steps += 1  # one batch more on this rank
    jitter = random.Random(rank)
    for step in range(steps):
        if paced and step >= at:
            extra = dict.fromkeys(("data_wait", "forward", "backward", "optimizer"), PACE)
            if kind == "jitter":  # every rank, a random part, up to the straggler's slowdown
                extra[jitter.choice(list(extra))] += jitter.uniform(0.0, SLOW)
            elif me and kind in SLOW_PART:
                extra[SLOW_PART[kind]] += SLOW
            time.sleep(extra["data_wait"])
            model.extra.update(forward=extra["forward"], backward=extra["backward"])
            slow_optimizer[0] = extra["optimizer"]
            if step == at + PACED_AT:
                mark(rank, "paced")
        if step == at:
            mark(rank, "at")
            if me:
                misbehave(kind, ddp)
            if kind in ("size_mismatch", "dtype_mismatch", "order_swap"):
                collectives(kind, me)
            if kind == "evaluation":
                evaluate(ddp, HOLD)
            elif kind == "eval_module":
                evaluate(ddp.module, HOLD)
            elif kind == "checkpoint_all":
                write_checkpoint(ddp.module, rank, HOLD)
            elif kind == "checkpoint_barrier":
                if rank == culprit:
                    save_checkpoint(HOLD)
                dist.barrier()
            elif kind == "eval_barrier":
                if rank == culprit:
                    evaluate(ddp, HOLD)
                dist.barrier()
            elif kind == "eval_rank0" and me:
                evaluate(ddp.module, HOLD)  # the others wait in the next gradient all-reduce
            elif kind == "metric_rank0" and me:
                dist.all_reduce(torch.zeros(3))  # a metric summed on one rank alone
        if loader is not None:
            x, y = next(loader)
        else:
            x, y = load_data(rank, step, me and kind == "stall" and step >= at)
        opt.zero_grad()
        if kind.startswith("accumulate_"):
            accumulate(ddp, x, y, kind == "accumulate_no_sync")
        else:
            out = ddp(x)
            if kind == "fetch_between":  # the next batch fetched between forward and backward
                time.sleep(SLOW if me and paced and step >= at else 0.0)
                load_data(rank, step + 1, False)
            nn.functional.mse_loss(out, y).backward()
        opt.step()
        if kind == "late_barrier" and me and step == at:
            dist.barrier()  # a rank-conditional barrier at the end of the loop's body
    if kind == "uneven" and me:
        mark(rank, "at")  # out of batches: it goes on to the barrier below
    mark(rank, "loop_done")
    if kind == "post_loop":
        save_checkpoint(HOLD)  # every rank: work after the training loop
    dist.barrier()
    mark(rank, "done")
    dist.destroy_process_group()


def epochs(rank: int, world: int):
    """Batches of a DataLoader with a DistributedSampler, as tutorials write it: one batch
    peeked before the loop (its size), then ``set_epoch`` at every epoch."""
    data = torch.utils.data.TensorDataset(torch.randn(64 * world, 32), torch.randn(64 * world, 8))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank)
    loader = torch.utils.data.DataLoader(data, batch_size=16, sampler=sampler)
    len(next(iter(loader))[0])  # the peek
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def accumulate(ddp: DDP, x: torch.Tensor, y: torch.Tensor, no_sync: bool) -> None:
    """Two micro-batches per optimizer step; the first under ``no_sync`` or not (both are
    right: without it DDP all-reduces twice)."""
    halves = list(zip(x.chunk(2), y.chunk(2)))
    if no_sync:
        with ddp.no_sync():
            nn.functional.mse_loss(ddp(halves[0][0]), halves[0][1]).backward()
    else:
        nn.functional.mse_loss(ddp(halves[0][0]), halves[0][1]).backward()
    nn.functional.mse_loss(ddp(halves[1][0]), halves[1][1]).backward()


def misbehave(kind: str, ddp: DDP) -> None:
    if kind == "exception" or kind == "spawn_exception":
        raise RuntimeError("batch 17 has NaN labels")
    if kind == "sys_exit":
        sys.exit(3)
    if kind == "os_exit":
        os._exit(5)
    if kind == "sigsegv":
        ctypes.string_at(0)
    if kind == "extra_barrier":
        dist.barrier()
    if kind == "checkpoint_hang":
        while True:
            time.sleep(0.05)  # a save to a file system that never answers


def collectives(kind: str, me: bool) -> None:
    """Every rank all-reduces a metric; the culprit's differs in size, dtype or order."""
    if kind == "size_mismatch":
        dist.all_reduce(torch.zeros(1000 if me else 10))  # sum a metric
    elif kind == "dtype_mismatch":
        dist.all_reduce(torch.zeros(10, dtype=torch.float64 if me else torch.float32))
    elif me:
        dist.broadcast(torch.zeros(4), src=0)  # order: broadcast, then all-reduce
        dist.all_reduce(torch.zeros(4))
    else:
        dist.all_reduce(torch.zeros(4))
        dist.broadcast(torch.zeros(4), src=0)


def spawned(rank: int, world: int, kind: str, culprit: int, at: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    run(rank, world, kind, culprit, at)


def main() -> None:
    kind, culprit, at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if kind.startswith("spawn_"):
        import torch.multiprocessing as mp

        mp.spawn(spawned, args=(world, kind, culprit, at), nprocs=world, join=True)
        return
    run(int(os.environ.get("RANK", "0")), world, kind, culprit, at)


if __name__ == "__main__":
    main()
