"""One rank of a job for the report's tests: ``python -m tests.distributed.report_worker
SCENARIO [ARGS]`` under tests/support/harness.py (FileStore rendezvous, gloo)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .worker import MLP, RANK, batch, init


class SlowForward(nn.Module):
    """An MLP whose forward sleeps ``delay`` seconds on one rank: a known straggler."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.mlp = MLP()
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return self.mlp(x)


def train(steps: int, slow_rank: int, delay: float, end: str) -> dict[str, Any]:
    """``steps`` steps with ddpmon attached; rank ``slow_rank`` sleeps ``delay`` in forward.
    ``end``: ``detach`` (detach, then exit), ``exit`` (exit without detach), ``hold`` (stay
    alive after training until killed; writes ``trained-<rank>`` when done)."""
    import ddpmon

    init()
    torch.manual_seed(0)
    model = DDP(SlowForward(delay if RANK == slow_rank else 0.0), bucket_cap_mb=0.01)
    mon = ddpmon.attach(
        model, job=os.environ.get("DDPMON_TEST_JOB", "report"), bucket_timing="hook"
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    same = os.environ.get("DDPMON_TEST_SAME_DATA") == "1"  # every rank trains on rank 0's batches
    for step in range(steps):
        x, y = batch(step, rank=0) if same else batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    out = Path(os.environ["DDPMON_TEST_OUT"])
    if end == "hold":
        (out / f"trained-{RANK}").write_text("1")
        while True:
            time.sleep(1)
    if end == "detach":
        mon.detach()
    return {"steps": steps, "state_file": mon.state_file}


def main() -> None:
    scenario, args = sys.argv[1], sys.argv[2:]
    assert scenario == "train", f"unknown scenario {scenario!r}"
    result = train(int(args[0]), int(args[1]), float(args[2]), args[3])
    (Path(os.environ["DDPMON_TEST_OUT"]) / f"result-{RANK}.json").write_text(
        json.dumps(result, default=str)
    )


if __name__ == "__main__":
    main()
