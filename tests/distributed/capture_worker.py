"""Rank processes for tests/distributed/test_capture.py: a 2-rank gloo job that trains until
the test says stop, for ``ddpmon capture`` to profile while it runs.

``python -m tests.distributed.capture_worker SLOW_RANK [profiler]``: rank SLOW_RANK runs an
extra matrix product in its forward (``Net.forward``); with ``profiler``, rank 1 trains under
a torch.profiler of its own (the program's profiler, which a capture must leave alone). The
ranks stop together once ``stop`` exists in DDPMON_TEST_OUT (checked through an all-reduce
every 10 steps), and each writes result-<rank>.json.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed.worker import MLP, RANK, batch, finish, init

MAX_SECONDS = 90.0


class Net(nn.Module):
    def __init__(self, slow: bool) -> None:
        super().__init__()
        self.mlp = MLP()
        self.slow = slow
        self.register_buffer("a", torch.randn(512, 512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow:
            self.extra = torch.mm(self.a, self.a)  # the slow rank's extra work
        return self.mlp(x)


def main(slow_rank: str, *options: str) -> dict[str, object]:
    import ddpmon

    init()
    torch.manual_seed(0)
    model = DDP(Net(RANK == int(slow_rank)))
    out = os.environ["DDPMON_TEST_OUT"]
    port = int(os.environ.get("DDPMON_TEST_PORT", "-1"))  # the metrics endpoint: off unless asked
    monitor = ddpmon.attach(model, job="capture", state_dir=os.path.join(out, "state"), port=port)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    user = None
    if "profiler" in options and RANK == 1:
        user = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        user.start()
    flag = torch.zeros(1)
    started = time.monotonic()
    step = 0
    while True:
        x, y = batch(step % 50)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        step += 1
        time.sleep(0.01)  # a light load: the machine is shared
        if step % 10 == 0:
            flag.fill_(
                float(
                    os.path.exists(os.path.join(out, "stop"))
                    or time.monotonic() - started > MAX_SECONDS
                )
            )
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
    result: dict[str, object] = {"steps": step}
    if user is not None:
        result["user_profiler_on"] = bool(torch.autograd._profiler_enabled())
        user.stop()
        # the program's own trace is whole (torch's raw events: its per-event parse would be slow)
        result["user_profiler_ops"] = sum(
            1 for e in user.profiler.kineto_results.events() if e.name() == "aten::addmm"
        )
    monitor.detach()
    return result


if __name__ == "__main__":
    finish(main(*sys.argv[1:]))
