"""One NCCL rank on cuda:0 that trains with ddpmon attached and then ends its life one way:
``python -m tests.gpu.life_worker END [HANG_ACTION]`` under tests/support/harness.py.

END is ``finish`` (returns normally, no detach, no destroy_process_group), ``raise`` (an
uncaught exception in the loop), ``stall`` (the data loader never returns: a Python sleep,
outside any collective), ``gpu_stall`` (a GPU kernel that runs for minutes is queued before
the step's work, and the loop logs ``loss.item()``, which waits for it) or ``serve`` (trains
until DDPMON_TEST_OUT/stop exists, for ``ddpmon capture``). Just before it ends that way the
rank writes ``ending.json`` (wall time) to DDPMON_TEST_OUT, so that the test can time what
follows. Hang timeout 3 s, state written every 0.2 s.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpmon
from tests.distributed.worker import MLP

OUT = os.environ["DDPMON_TEST_OUT"]
HANG_TIMEOUT = 3.0
END_AT = 30  # steps before the end


def mark(what: str) -> None:
    with open(os.path.join(OUT, "ending.json"), "w") as f:
        json.dump({"end": what, "unix": time.time()}, f)


def load_batch(step: int, end: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The data loader; in ``stall`` it never returns from step END_AT on."""
    if end == "stall" and step == END_AT:
        mark(end)
        while True:
            time.sleep(0.05)
    gen = torch.Generator(device="cuda").manual_seed(step)
    return torch.randn(16, 32, device="cuda", generator=gen), torch.randn(
        16, 8, device="cuda", generator=gen
    )


def main(end: str, hang_action: str = "report") -> None:
    torch.cuda.set_device(0)
    store = dist.FileStore(os.environ["DDPMON_TEST_STORE"], 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = DDP(MLP(width=256).cuda(), device_ids=[0], bucket_cap_mb=0.1)
    ddpmon.attach(
        model,
        job=f"life-{end}",
        hang_timeout=HANG_TIMEOUT,
        hang_action=hang_action,
        state_interval=0.2,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while True:
        if end in ("finish", "raise") and step == END_AT:
            mark(end)
            if end == "raise":
                raise RuntimeError("the training loop failed on purpose")
            return
        if end == "serve" and step % 10 == 0 and os.path.exists(os.path.join(OUT, "stop")):
            return
        if end == "gpu_stall" and step == END_AT:
            mark(end)
            torch.cuda._sleep(int(1.2e11))  # a minute or more of spinning: the GPU "hangs"
        x, y = load_batch(step, end)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if end == "gpu_stall":
            loss.item()  # the logging a training loop does: waits for the GPU
        if end == "serve":
            time.sleep(0.01)
        step += 1


if __name__ == "__main__":
    main(*sys.argv[1:])
    sys.stdout.flush()
