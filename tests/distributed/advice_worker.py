"""One rank of the advice job: each silent mistake, and a correct twin of them all, trained in
turn by one process (a model, a state directory and a job name per phase).

    python -m tests.distributed.advice_worker advice_job
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from . import worker
from .worker import MLP, RANK, captured_logs, init, scenario, scrape

STEPS = 30


def dataset(n: int = 320) -> TensorDataset:
    g = torch.Generator().manual_seed(7)  # the same dataset on every rank, as from disk
    return TensorDataset(torch.randn(n, 32, generator=g), torch.randn(n, 8, generator=g))


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


class BatchNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.bn = nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.inp(x))))


class FrozenHead(nn.Module):
    """One head is never used: the same unused parameters every step (a static graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 8)
        self.spare = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


# -- the phases: each trains its own model; a mistake, or none -----------------------------------


def same_data(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(0)  # one seed everywhere, no DistributedSampler
    loader = DataLoader(dataset(), batch_size=8, shuffle=True)
    for i, (x, y) in enumerate(loader):
        if i == STEPS:
            break
        step(model, opt, x, y)


def no_set_epoch(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    loader = DataLoader(
        dataset(64), batch_size=8, sampler=DistributedSampler(dataset(64), shuffle=True)
    )
    for _epoch in range(2):
        for x, y in loader:
            step(model, opt, x, y)


def peek_then_set_epoch(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """PyTorch's DDP tutorial (multigpu_torchrun.py): one batch peeked before the epoch loop,
    then set_epoch at the start of every epoch."""
    sampler = DistributedSampler(dataset(64), shuffle=True)
    loader = DataLoader(dataset(64), batch_size=8, sampler=sampler)
    assert len(next(iter(loader))[0]) == 8
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            step(model, opt, x, y)


def inner_forward(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for i in range(STEPS):
        x, y = worker.batch(i, 8)
        if i == 5 and RANK == 1:  # one training step that bypasses DDP's all-reduce
            opt.zero_grad()
            nn.functional.mse_loss(model.module(x), y).backward()
            opt.step()
        step(model, opt, x, y)


def drifting_buffers(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for i in range(STEPS):
        step(model, opt, *worker.batch(i, 8))


def nan_on_rank_1(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for i in range(STEPS):
        x, y = worker.batch(i, 8)
        if i == 6 and RANK == 1:  # step 7: one bad sample on rank 1
            x[3, 5] = float("nan")
        step(model, opt, x, y)


def accumulation(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for i in range(STEPS // 3):
        opt.zero_grad()
        for micro in range(3):  # no no_sync(): every micro-batch all-reduces
            x, y = worker.batch(3 * i + micro, 8)
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def static_graph(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for i in range(70):
        step(model, opt, *worker.batch(i, 8))


def correct(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Everything right: DistributedSampler with set_epoch, accumulation under no_sync, buffers
    broadcast, evaluation on the inner module under no_grad, 2 epochs."""
    data = dataset(160)
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(loader)
        for i in range(0, len(batches) - 1, 2):
            opt.zero_grad()
            with model.no_sync():
                nn.functional.mse_loss(model(batches[i][0]), batches[i][1]).backward()
            nn.functional.mse_loss(model(batches[i + 1][0]), batches[i + 1][1]).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            model.module(batches[0][0])
        model.train()


PHASES: dict[str, tuple[Callable[[], nn.Module], dict[str, Any], Callable[..., None]]] = {
    "same_data": (MLP, {}, same_data),
    "no_set_epoch": (MLP, {}, no_set_epoch),
    "peek_then_set_epoch": (MLP, {}, peek_then_set_epoch),
    "inner_forward": (MLP, {}, inner_forward),
    "drifting_buffers": (BatchNormMLP, {"broadcast_buffers": False}, drifting_buffers),
    "nan_on_rank_1": (MLP, {}, nan_on_rank_1),
    "accumulation": (MLP, {}, accumulation),
    "static_graph": (FrozenHead, {"find_unused_parameters": True}, static_graph),
    "correct": (BatchNormMLP, {}, correct),
}


@scenario
def advice_job(*names: str) -> dict[str, Any]:
    import ddpmon

    init()
    logs = captured_logs()
    out: dict[str, Any] = {}
    for name in names or PHASES:
        build, options, train = PHASES[name]
        torch.manual_seed(0)
        model = DDP(build(), **options)
        state_dir = os.path.join(os.environ["DDPMON_TEST_OUT"], name)
        mon = ddpmon.attach(model, job=name, state_dir=state_dir, state_interval=0.2)
        first = len(logs)
        train(model, torch.optim.SGD(model.parameters(), lr=0.05))
        mon.step()
        mon._writer.write_now()
        dist.barrier()  # both files written: each rank's comparison with its peer can run
        compared = mon._advice.comparisons
        deadline = time.monotonic() + 10.0  # two comparisons with the peer's final file
        while time.monotonic() < deadline and mon._advice.comparisons < compared + 2:
            time.sleep(0.05)
        metrics = scrape(mon.port)
        mon.detach()
        dist.barrier()
        out[name] = {
            "kinds": sorted(a.kind for a in mon.recorder.advice),
            "steps": {a.kind: a.step for a in mon.recorder.advice},
            "logs": [m for m in logs[first:] if "ddpmon: " in m],
            "advice_metrics": [
                line for line in metrics.splitlines() if line.startswith("ddpmon_advice{")
            ],
            "state_dir": state_dir,
        }
    return out


if __name__ == "__main__":
    worker.main()
