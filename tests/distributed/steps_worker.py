"""Rank processes for tests/distributed/test_steps.py: step counting and step parts of real
gloo DDP jobs, and stragglers of every part. Run as ``python -m tests.distributed.steps_worker
SCENARIO ARGS``; each scenario writes result-<rank>.json into DDPMON_TEST_OUT."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpmon.steps import SUSTAIN_SECONDS
from tests.distributed.worker import MLP, RANK, accumulate, batch, init


def readme_example() -> dict[str, Any]:
    """README's loop: 64 iterations with one attach line, then time after the loop, an
    evaluation forward and detach. Then the same without torch.optim (a hand-written SGD),
    gradient accumulation, and a compiled model."""
    import ddpmon

    init()
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    model = DDP(MLP())
    monitor = ddpmon.attach(model, job="readme")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(64):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    out["after_loop"] = monitor.snapshot()["step"]
    time.sleep(0.5)  # after the loop: no step
    with torch.no_grad():
        monitor.recorder.fold()
        before = monitor.recorder.last_progress_unix
        model(batch(0)[0])  # evaluation: a heartbeat, no step
        monitor.recorder.fold()  # what a reader does before it reads
        out["eval_heartbeat"] = monitor.recorder.last_progress_unix > before
    out["after_eval"] = monitor.snapshot()["step"]
    monitor.detach()
    out["after_detach"] = monitor.snapshot()
    out["rows"] = [dataclasses.asdict(r) for r in monitor.recorder.history_since(0)]

    # Without an optimizer: the synchronised end of backward ends a step.
    model = DDP(MLP())
    monitor = ddpmon.attach(model, job="no-optimizer")
    for step in range(64):
        x, y = batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
    time.sleep(0.5)
    monitor.detach()
    out["manual_sgd"] = monitor.snapshot()
    out["manual_sgd_rows"] = [dataclasses.asdict(r) for r in monitor.recorder.history_since(0)]

    # Gradient accumulation: 3 micro-steps (2 under no_sync) per optimizer step.
    model = DDP(MLP())
    monitor = ddpmon.attach(model, job="accumulation")
    accumulate(model, torch.optim.Adam(model.parameters(), lr=0.001), 5)
    out["accumulation"] = monitor.snapshot()
    monitor.detach()

    # A compiled model: the module hooks step aside, the optimizer step still ends steps.
    model = DDP(MLP())
    monitor = ddpmon.attach(model, job="compiled")
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(compiled(x), y).backward()
        opt.step()
    out["compiled"] = monitor.snapshot()["step"]
    monitor.detach()
    return out


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``delay`` seconds on the slow rank."""

    delay = 0.0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if SlowBackward.delay:
            time.sleep(SlowBackward.delay)
        return grad


class Net(nn.Module):
    """The MLP with a sleep in forward and one in backward, for the slow rank."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()
        self.forward_delay = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_delay:
            time.sleep(self.forward_delay)
        return SlowBackward.apply(self.mlp(x))


class SlowSGD(torch.optim.SGD):
    """The user's own optimizer: its step sleeps ``delay`` seconds on the slow rank."""

    delay = 0.0

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.delay:
            time.sleep(self.delay)
        return super().step(closure)


def stragglers(
    slow: str, delay: str, steps: str, kinds: str, doctor_after: str = ""
) -> dict[str, Any]:
    """Segments of ``steps`` steps; in each, rank ``slow`` is slower by ``delay`` seconds in
    one part (data_wait, forward, backward, optimizer, other), or every rank jitters
    (``jitter``: a random 0..2 x delay before each forward). After each segment every rank
    reports its step parts; after the segment named ``doctor_after`` (as long as a straggler
    must last to be named) rank 0 runs the doctor on the live job."""
    import ddpmon

    init()
    torch.manual_seed(0)
    net = Net()
    model = DDP(net)
    state_dir = os.path.join(os.environ["DDPMON_TEST_OUT"], "state")
    monitor = ddpmon.attach(model, job="stragglers", state_dir=state_dir, port=-1)
    opt = SlowSGD(model.parameters(), lr=0.001)
    me_slow = RANK == int(slow)
    d = float(delay)
    rng = random.Random(RANK)
    segments = []
    for kind in kinds.split(","):
        net.forward_delay = d if me_slow and kind == "forward" else 0.0
        SlowBackward.delay = d if me_slow and kind == "backward" else 0.0
        SlowSGD.delay = d if me_slow and kind == "optimizer" else 0.0
        count = int(steps)
        if kind == doctor_after:  # the doctor names a straggler once its gap lasted
            count = max(count, math.ceil((SUSTAIN_SECONDS + 1.0) / d))
        for step in range(count):
            if kind == "jitter":
                time.sleep(rng.uniform(0.0, 2 * d))
            elif kind == "data_wait" and me_slow:
                time.sleep(d)  # the data loader
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if kind == "other" and me_slow:
                time.sleep(d)  # logging on one rank
            opt.step()
        snap = monitor.snapshot()
        segments.append({"kind": kind, "step": snap["step"], "parts": snap["timings"]["parts"]})
        if kind == doctor_after:
            monitor._writer.write_now()
            dist.barrier()
            if RANK == 0:
                run = subprocess.run(
                    [sys.executable, "-m", "ddpmon", "doctor", "--json", "--no-stacks", state_dir],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                segments[-1]["doctor"] = {
                    "code": run.returncode,
                    "report": json.loads(run.stdout or "null"),
                    "stderr": run.stderr[-2000:],
                }
            dist.barrier()
    monitor.detach()
    return {"segments": segments}


SCENARIOS = {"readme_example": readme_example, "stragglers": stragglers}

if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](*sys.argv[2:])
    with open(os.path.join(os.environ["DDPMON_TEST_OUT"], f"result-{RANK}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as tests/distributed/worker.py: no interpreter finalization after gloo
