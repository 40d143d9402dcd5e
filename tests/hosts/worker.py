"""One rank of a job whose ranks run on several hosts (tests/support/hosts.py):
``python -m tests.hosts.worker SCENARIO [ARGS]``.

The environment is torchrun's: RANK, LOCAL_RANK, GROUP_RANK (the node), WORLD_SIZE,
MASTER_ADDR and MASTER_PORT (a TCP store on the first host), GLOO_SOCKET_IFNAME. The state
files go to the default directory under the host's own TMPDIR. The job trains until the
test ends it; gloo's timeout (60 s) ends a rank the test failed to end.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpmon
from tests.distributed.worker import MLP, batch

RANK = int(os.environ["RANK"])
JOB = "two-hosts"


def load_batch(step: int, stuck_rank: int, at: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data loader; on ``stuck_rank`` it never returns from step ``at`` on."""
    if RANK == stuck_rank and step >= at:
        while True:
            time.sleep(0.05)
    return batch(step)


def main(scenario: str, *args: str) -> None:
    """``train``: train until ended; ``stall RANK AT``: RANK's data loader never returns
    from step AT on."""
    stuck_rank, at = (int(args[0]), int(args[1])) if scenario == "stall" else (-1, 0)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    ddp = DDP(MLP(), bucket_cap_mb=0.01)
    ddpmon.attach(ddp, job=JOB, hang_timeout=2.0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    step = 0
    while True:
        x, y = load_batch(step, stuck_rank, at)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        step += 1
        time.sleep(0.05)  # leave the machine's cores to the other ranks and the daemons


if __name__ == "__main__":
    main(*sys.argv[1:])
