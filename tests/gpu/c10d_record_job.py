"""Record what the c10d clock is told in a real DDP job:
``python -m tests.gpu.c10d_record_job BACKEND`` under tests/support/harness.py; the
recording (tests/support/c10d.py) goes to result-<rank>.json.

``nccl``: c10d's own completion hook on a GPU (tests/gpu/test_c10d_recorded.py). ``gloo``:
gloo has no completion hook, so it is stood in for as in worker.py's c10d_wiring, a
WorkInfo-shaped record per all-reduce from the thread that completes it; this made
tests/fixtures/workinfo/gloo-standin.json. The loop has what a training loop has around
DDP's buckets: a loss all-reduce after each backward, and gradient accumulation (two
microbatches, the first under no_sync) in some steps.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.c10d import record

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
STEPS = 24
ACCUMULATE = range(10, 14)  # steps of two microbatches


def main() -> None:
    import ddpmon
    from ddpmon.rank.timing import c10d as completion
    from tests.distributed.worker import MLP

    backend = sys.argv[-1]
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group(
        backend,
        store=dist.FileStore(os.environ["DDPMON_TEST_STORE"], WORLD),
        rank=RANK,
        world_size=WORLD,
    )
    listeners: list[Any] = []
    seq = [0]

    def report(started: datetime.datetime, begun: float) -> None:
        seq[0] += 1
        info = types.SimpleNamespace(
            op_type=torch._C._distributed_c10d.OpType.ALLREDUCE,
            seq=seq[0],
            time_started=started,
            active_duration=datetime.timedelta(seconds=time.perf_counter() - begun),
        )
        for fn in tuple(listeners):
            fn(info)

    if not cuda:  # stand in for ProcessGroupNCCL's completion hook
        completion.unavailable_reason = lambda group, device="cpu": None  # type: ignore[assignment]
        completion.listen = lambda group, fn: listeners.append(fn) or (lambda: listeners.remove(fn))  # type: ignore[assignment]
    torch.manual_seed(0)
    model = DDP(MLP().to(device), bucket_cap_mb=0.01, **({"device_ids": [0]} if cuda else {}))
    mon = ddpmon.attach(model, job="record", port=-1)
    events: list[list[Any]] = []
    listen_too = record(mon._timing.clock, events)
    stop = completion.listen(model.process_group, listen_too)

    if not cuda:

        def standin(state, bucket):  # type: ignore[no-untyped-def]  # (DDP checks real annotations)
            tensor = bucket.buffer().mul_(1.0 / WORLD)
            started, begun = datetime.datetime.now(), time.perf_counter()

            def done(fut: torch.futures.Future) -> torch.Tensor:
                report(started, begun)
                return fut.value()[0]

            return dist.group.WORLD.allreduce([tensor]).get_future().then(done)

        model.register_comm_hook(None, standin)

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator(device=device).manual_seed(RANK)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(2 if step in ACCUMULATE else 1):
            x, y = (
                torch.randn(16, 32, device=device, generator=gen),
                torch.randn(16, 8, device=device, generator=gen),
            )
            last = micro == (1 if step in ACCUMULATE else 0)
            if last:
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
            else:
                with model.no_sync():
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
        started, begun = datetime.datetime.now(), time.perf_counter()
        dist.all_reduce(loss.detach())  # the user's loss average, after backward
        if not cuda:
            report(started, begun)
        opt.step()
        time.sleep(0.03)  # steps of a real size: earlier steps settle while later ones run
    if cuda:
        torch.cuda.synchronize()
    time.sleep(1.0)
    mon.step()
    clock = mon._timing.clock
    result = {
        "backend": backend,
        "used_map_allreduce": False,
        "events": events,
        "matched": clock.matched_steps,
        "unmatched": clock.unmatched_steps,
        "mode": mon.snapshot()["bucket_timing"],
        "torch": torch.__version__,
    }
    mon.detach()
    stop()
    with open(os.path.join(os.environ["DDPMON_TEST_OUT"], f"result-{RANK}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as worker.py: skip a gloo finalization that can abort


if __name__ == "__main__":
    main()
