"""One rank of a job that really hangs, dies, desyncs or straggles:
``python -m tests.distributed.hang_worker SCENARIO [ARGS]``.

Same environment as ``worker.py`` (RANK, WORLD_SIZE, DDPMON_TEST_STORE, DDPMON_TEST_OUT,
DDPMON_STATE_DIR). Every job trains a small DDP MLP with ddpmon attached (hang timeout 2 s)
and then misbehaves on purpose; the test reads the state files, runs the doctor and ends
the ranks. The process group timeout (60 s) ends a rank the test failed to end.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpmon
from tests.distributed.worker import MLP, TwoHeads, batch

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
STEPS = 100_000  # "forever": the test ends the job
OUT = os.environ.get("DDPMON_TEST_OUT", ".")


def init() -> None:
    store = dist.FileStore(os.environ["DDPMON_TEST_STORE"], WORLD)
    dist.init_process_group(
        "gloo", store=store, rank=RANK, world_size=WORLD, timeout=timedelta(seconds=60)
    )


def setup(
    job: str, model: nn.Module | None = None, **options: Any
) -> tuple[DDP, Any, torch.optim.Optimizer]:
    init()
    torch.manual_seed(0)
    ddp = DDP(model or MLP(), bucket_cap_mb=0.01)
    mon = ddpmon.attach(ddp, job=job, hang_timeout=2.0, state_interval=0.2, **options)
    return ddp, mon, torch.optim.SGD(ddp.parameters(), lr=0.01)


def train_step(ddp: DDP, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    loss = nn.functional.mse_loss(ddp(x), y)
    loss.backward()  # the bucket all-reduces are issued (and waited for) here
    opt.step()


def load_batch(step: int, stuck_rank: int, at: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data loader; on ``stuck_rank`` it never returns from step ``at`` on."""
    if RANK == stuck_rank and step >= at:
        while True:
            time.sleep(0.05)
    return batch(step)


def stuck(stuck_rank: str = "1", at: str = "5") -> None:
    """One rank stuck in its data loader (outside any collective); the others wait for it
    in the gradient all-reduce."""
    ddp, _mon, opt = setup("stuck")
    for step in range(STEPS):
        x, y = load_batch(step, int(stuck_rank), int(at))
        train_step(ddp, opt, x, y)


def die(dead_rank: str = "1", at: str = "5") -> None:
    """One rank's process ends abruptly (no exception, no exit handlers); the others then
    fail in their all-reduce."""
    ddp, _mon, opt = setup("die")
    for step in range(STEPS):
        if RANK == int(dead_rank) and step == int(at):
            os._exit(3)
        train_step(ddp, opt, *batch(step))


def report_progress(step: int) -> None:
    """Rank-conditional extra collective: only ``odd_rank`` reaches this barrier."""
    dist.barrier()  # the odd rank's barrier


def desync(odd_rank: str = "1", at: str = "5") -> None:
    """One rank issues a barrier the others never issue; they go on to the next step's
    gradient all-reduce and every rank waits in a different collective."""
    ddp, _mon, opt = setup("desync")
    for step in range(STEPS):
        if RANK == int(odd_rank) and step == int(at):
            report_progress(step)
        train_step(ddp, opt, *batch(step))


def unused_layer() -> None:
    """Every rank leaves one layer unused with find_unused_parameters=False: DDP raises
    "Expected to have finished reduction" at the next forward, on every rank alike."""
    init()
    torch.manual_seed(0)
    ddp = DDP(TwoHeads())
    ddpmon.attach(ddp, job="unused-layer", hang_timeout=2.0, state_interval=0.2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x, use_a=True), y).backward()  # head_b never used
        opt.step()


def log_metrics(loss: torch.Tensor) -> None:
    """Averages the loss for a log line: a collective that only rank 0 issues."""
    dist.all_reduce(loss.detach().reshape(1))  # rank 0's logging all-reduce


def log_on_rank_0(at: str = "5") -> None:
    """Rank 0 alone all-reduces a metric in its logging function; rank 1 goes on to the
    next step's gradient all-reduce, so gloo meets two sizes under one sequence number."""
    ddp, _mon, opt = setup("log-on-rank-0")
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        if RANK == 0 and step == int(at):
            log_metrics(loss)


class SlowMLP(MLP):
    """An MLP whose forward takes ``delay`` seconds longer on one rank."""

    def __init__(self, slow_rank: int, delay: float) -> None:
        super().__init__()
        self.slow = RANK == slow_rank
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow:
            time.sleep(self.delay)
        return super().forward(x)


def should_stop(step: int) -> bool:
    """Every rank stops at the same step: the stop file's presence is all-reduced."""
    if step % 5:
        return False
    flag = torch.tensor([1.0 if os.path.exists(os.path.join(OUT, "stop")) else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def straggle(slow_rank: str = "1", delay: str = "0.03") -> None:
    """One rank computes slower while the job goes on; it ends cleanly when the test
    creates the stop file."""
    ddp, mon, opt = setup("straggle", SlowMLP(int(slow_rank), float(delay)))
    for step in range(STEPS):
        if should_stop(step):
            break
        train_step(ddp, opt, *batch(step))
    dist.destroy_process_group()


def train_until_frozen() -> None:
    """Trains until the network under it stops delivering (the test freezes it)."""
    ddp, _mon, opt = setup("frozen-net")
    for step in range(STEPS):
        should_stop(step)
        train_step(ddp, opt, *batch(step))


def all_kinds() -> None:
    """Collectives of every kind issued by user code while attached, then detach: writes
    what the recorder saw to result-<rank>.json."""
    import json

    saved = {name: getattr(dist, name) for name in ("all_reduce", "barrier", "broadcast")}
    ddp, mon, opt = setup("collectives", bucket_timing="hook")  # buckets as the hook sees them
    train_step(ddp, opt, *batch(0))
    t = torch.ones(256)  # 1024 bytes
    dist.all_reduce(t)  # user all_reduce
    dist.barrier()  # user barrier
    dist.broadcast(t, src=0)  # user broadcast
    work = dist.all_reduce(t, async_op=True)  # user async all_reduce
    work.wait()
    gathered = [torch.zeros(256) for _ in range(WORLD)]
    dist.all_gather(gathered, t)
    objects = [None] * WORLD
    dist.all_gather_object(objects, {"rank": RANK})
    if RANK == 0:
        dist.send(torch.ones(4), dst=1)
    elif RANK == 1:
        dist.recv(torch.zeros(4), src=0)
    train_step(ddp, opt, *batch(1))
    time.sleep(0.1)  # async completions run on gloo's threads
    snap = mon.snapshot()
    wrapped = {name: getattr(dist, name) is not fn for name, fn in saved.items()}
    mon.detach()
    restored = {name: getattr(dist, name) is fn for name, fn in saved.items()}
    result = {
        "snapshot": snap,
        "wrapped_while_attached": wrapped,
        "restored_after_detach": restored,
        "by_op": {op: list(v) for op, v in mon.recorder.collectives_by_op().items()},
        "gathered_objects": objects,
    }
    with open(os.path.join(OUT, f"result-{RANK}.json"), "w") as f:
        json.dump(result, f, default=str)
    dist.destroy_process_group()


SCENARIOS = {
    f.__name__: f
    for f in (
        stuck,
        die,
        desync,
        straggle,
        train_until_frozen,
        all_kinds,
        unused_layer,
        log_on_rank_0,
    )
}


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank" + str(RANK) + " %(message)s")
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
