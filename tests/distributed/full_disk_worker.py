"""One rank of a job whose state directory fills up:
``python -m tests.distributed.full_disk_worker MODE [STEPS]`` under tests/support/harness.py.

Both modes train the same small model on the same data, step by step, and all-reduce a stop
flag at the start of every step, so that both ranks stop at the same step:

- ``attached``: ddpmon attached (job ``full``); rank 0 raises the flag once the test writes
  ``stop`` in the output directory. Writes ``port-<rank>`` (its metrics port) first.
- ``plain``: no ddpmon (the reference weights), run beside the attached job: it trains on
  until the test writes the attached job's steps to ``steps`` in the output directory, and
  keeps the digest of its weights at every step, so that it gives the one at that step
  whether it was ahead or behind.

The result holds the steps done, a digest of the final weights, and when the first step
began and the last one ended (this process's clock).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
OUT = Path(os.environ["DDPMON_TEST_OUT"])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(RANK * 1_000_003 + step)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


PACE = 0.002
"""Seconds each step waits after its optimizer step: the job needs steps, not a whole core
per rank, and the suite runs timing-sensitive jobs beside it (stragglers, starved ranks)."""


GIVE_UP = 300.0
"""Seconds the plain run trains at most while it waits for the attached job's steps."""


def digest(model: DDP) -> str:
    h = hashlib.sha256()
    for p in model.module.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def steps_to_match(path: Path) -> int:
    """The attached job's steps, once the test has written them (0 until then)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def train(mode: str) -> dict[str, Any]:
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.environ["DDPMON_TEST_STORE"], WORLD),
        rank=RANK,
        world_size=WORLD,
    )
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = None
    if mode == "attached":
        import ddpmon

        mon = ddpmon.attach(model, job="full")
        (OUT / f"port-{RANK}").write_text(str(mon.port))
    stop = OUT / "stop"
    flag = torch.zeros(1)
    first = None
    step = steps = 0
    digests = {0: digest(model)}
    give_up = time.monotonic() + GIVE_UP
    while True:
        if mode == "attached":
            flag.fill_(1.0 if RANK == 0 and stop.exists() else 0.0)
        else:  # rank 0 reads how many steps the attached job took; every rank gets them
            flag.fill_(float(steps_to_match(OUT / "steps")) if RANK == 0 else 0.0)
        dist.all_reduce(flag)
        if mode == "attached" and flag.item():
            break
        if mode == "plain" and (0 < flag.item() <= step or time.monotonic() > give_up):
            steps = int(flag.item())
            break
        first = first if first is not None else time.time()
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        step += 1
        if mode == "plain":
            digests[step] = digest(model)
        time.sleep(PACE)
    last = time.time()
    if mon is not None:
        mon.detach()
    dist.destroy_process_group()
    return {
        "steps": steps if mode == "plain" else step,
        "digest": digests.get(steps) if mode == "plain" else digest(model),
        "first_step_unix": first,
        "last_step_unix": last,
    }


def main() -> None:
    mode = sys.argv[1]
    assert mode in ("attached", "plain"), f"unknown mode {mode!r}"
    result = train(mode)
    (OUT / f"result-{RANK}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
