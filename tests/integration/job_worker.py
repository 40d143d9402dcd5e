"""One rank of the jobs the integration tests watch through a real Prometheus:
``python -m tests.integration.job_worker train_until JOB MAX_SECONDS`` or
``python -m tests.integration.job_worker halt_on_cue JOB RANK HOW``.

``train_until`` trains until the test creates ``<DDPMON_TEST_OUT>/stop`` (or MAX_SECONDS
pass), with two traits the dashboards and alerts must show: rank 1 is a straggler (it
sleeps in its forward) and rank 1 never uses the ``spare`` head (unused parameters on rank
1 only). ``halt_on_cue`` trains until the test creates ``<DDPMON_TEST_OUT>/cue``, then one
rank stops (``halt``). Started by tests.support.harness.start_ranks(..., module=__name__).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed.worker import MLP, RANK, batch, init

STRAGGLER_RANK = 1
STRAGGLER_SLEEP = 0.02  # seconds added to every forward of the straggler
SPARE_USERS = {0}  # ranks whose forward uses the spare head
STOP_CHECK_EVERY = 10  # steps between the ranks' agreement on whether to stop


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.hidden = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.out = nn.Linear(64, 8)
        self.spare = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if RANK == STRAGGLER_RANK:
            time.sleep(STRAGGLER_SLEEP)
        h = self.hidden(torch.relu(self.inp(x)))
        y = self.out(h)
        return y + self.spare(h) if RANK in SPARE_USERS else y


def train_until(job: str, max_seconds: str) -> dict[str, Any]:
    import ddpmon

    init()
    torch.manual_seed(0)
    model = DDP(Model(), bucket_cap_mb=0.01, find_unused_parameters=True)
    # Per-bucket timing on (on gloo the default leaves it off), for the per-bucket panels.
    mon = ddpmon.attach(model, job=job, bind="127.0.0.1", bucket_timing="hook")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stop_file = os.path.join(os.environ["DDPMON_TEST_OUT"], "stop")
    deadline = time.monotonic() + float(max_seconds)
    step = 0
    while True:
        x, y = batch(step % 50)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        step += 1
        if step % STOP_CHECK_EVERY == 0:  # every rank stops after the same step
            flag = torch.tensor([float(os.path.exists(stop_file) or time.monotonic() > deadline)])
            dist.all_reduce(flag)
            if flag.item() > 0:
                break
    mon.step()
    snapshot = mon.snapshot()
    mon.detach()
    return {
        "steps": step,
        "snapshot_step": snapshot["step"],
        "port": mon.port,
        "unused": snapshot.get("unused_parameters"),
    }


HANG_TIMEOUT = 2.0


def halt_on_cue(job: str, rank: str, how: str) -> dict[str, Any]:
    """Train (hang timeout 2 s) until the test creates ``<DDPMON_TEST_OUT>/cue``; then rank
    ``rank`` halts (``halt``) and the others wait for it in their next all-reduce. The test
    ends the job."""
    import ddpmon

    init()
    torch.manual_seed(0)
    model = DDP(MLP(), bucket_cap_mb=0.01)
    ddpmon.attach(model, job=job, bind="127.0.0.1", hang_timeout=HANG_TIMEOUT, state_interval=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cue = os.path.join(os.environ["DDPMON_TEST_OUT"], "cue")
    step = 0
    while True:
        if RANK == int(rank) and os.path.exists(cue):
            halt(how)
        x, y = batch(step % 50)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        step += 1
        time.sleep(0.02)  # leave the machine's cores to Prometheus and the daemon


def halt(how: str) -> None:
    """Stop this rank, after writing the time to ``<DDPMON_TEST_OUT>/halted-<RANK>``:
    ``stall``: its data loader never returns (stuck outside any collective); ``kill``: it is
    killed (SIGKILL: no word from it) while a child it forked keeps its connections open, as
    a data-loader worker forked after the process group does, so its peers wait for it
    rather than fail on a closed connection (on NCCL they wait anyway)."""
    with open(os.path.join(os.environ["DDPMON_TEST_OUT"], f"halted-{RANK}"), "w") as f:
        f.write(repr(time.time()))
    if how == "kill":
        if os.fork() == 0:
            time.sleep(300)  # the test kills the rank's whole session before
            os._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        time.sleep(0.05)


def main() -> None:
    name, args = sys.argv[1], sys.argv[2:]
    result = {"train_until": train_until, "halt_on_cue": halt_on_cue}[name](*args)
    with open(os.path.join(os.environ["DDPMON_TEST_OUT"], f"result-{RANK}.json"), "w") as f:
        json.dump(result, f, default=str)
    sys.stdout.flush()
    sys.stderr.flush()
    dist.barrier()
    dist.destroy_process_group()
    # As tests/distributed/worker.py: skip interpreter finalization, where a gloo rank with
    # futures still held by worker threads can rarely abort. The result is already written.
    os._exit(0)


if __name__ == "__main__":
    main()
