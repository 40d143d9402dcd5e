"""One rank of a memory job: ``python -m tests.distributed.memory_worker SCENARIO``.

``host``: steps of about 15 ms at the default state interval (1 s); rank 1 keeps 4 MiB more
every step (a list of filled buffers), rank 2's memory rises once by 300 MB at step 75
(mid-window) and stays flat, rank 0 is healthy. ``workers``: every rank
reads its batches through two persistent DataLoader workers; rank 1's workers each keep
4 MiB more every step (8 MiB a batch, each worker giving every other batch); PSS is read
every state interval there (by default each process's PSS takes at most 0.1% of the time). ``gpu`` (one
rank on cuda:0, NCCL; tests/gpu): the rank keeps a 4 MiB CUDA tensor every step. Each rank
runs ``STEPS`` steps, lets its memory watch take its last sample, and returns what it
published: the state file's ``memory`` and the metrics' slopes.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed.worker import MLP, RANK, init, main, read_state, scenario, scrape

STEPS = 140  # 130 past the warm-up: about 30 samples, twice the 12 a trend needs, under load too
LEAK = 4 << 20
STEP_PAUSE = 0.03
FAST_STEP_PAUSE = 0.012  # with the step itself, about 15 ms a step
INTERVAL = 0.2  # the state interval of the workers' job
ONCE = 300 << 20
RISE_STEP = 75  # the middle of the window (steps 10 to 140)
KEPT: list[bytes] = []


def filled(n: int) -> bytes:
    """``n`` bytes whose pages are all resident (``bytes(n)`` may map zero pages lazily)."""
    return b"\x01" * n


class Batches(torch.utils.data.Dataset):
    """Random regression samples; on a leaking rank each sample keeps LEAK/8 bytes in the
    worker that made it (16 samples a batch: 8 MiB a batch)."""

    def __init__(self, leak: bool) -> None:
        self.leak = leak

    def __len__(self) -> int:
        return 16 * (STEPS + 8)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.leak:
            KEPT.append(filled(LEAK // 8))
        g = torch.Generator().manual_seed(i)
        return torch.randn(32, generator=g), torch.randn(8, generator=g)


def run(
    batches: Any,
    on_step: Any,
    device: str = "cpu",
    interval: float = INTERVAL,
    pause: float = STEP_PAUSE,
) -> dict[str, Any]:
    import ddpmon

    if device == "cpu":
        init()
    else:
        import os

        store = torch.distributed.FileStore(os.environ["DDPMON_TEST_STORE"], 1)
        torch.distributed.init_process_group("nccl", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = DDP(MLP().to(device))
    mon = ddpmon.attach(model, job="memory", port=0, state_interval=interval)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    began = time.perf_counter()
    for step, (x, y) in zip(range(1, STEPS + 1), batches):
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
        on_step(step)
        time.sleep(pause)
    step_seconds = (time.perf_counter() - began) / STEPS
    time.sleep(3 * interval)  # the watch's last trend, of samples up to step STEPS
    text = scrape(mon.port)
    mon._writer.write_now()
    state = read_state(mon.state_file)
    mon.detach()
    return {
        "memory": state["memory"],
        "step": state["step"],
        "metrics": text,
        "errors": state["errors"],
        "step_seconds": step_seconds,
    }


def _host_step(step: int) -> None:
    if RANK == 1:
        KEPT.append(filled(LEAK))
    if RANK == 2 and step == RISE_STEP:
        KEPT.append(filled(ONCE))


@scenario
def host() -> dict[str, Any]:
    def forever() -> Any:
        g = torch.Generator().manual_seed(RANK)
        while True:
            yield torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)

    return run(forever(), _host_step, interval=1.0, pause=FAST_STEP_PAUSE)


@scenario
def workers() -> dict[str, Any]:
    from ddpmon.rank import memory

    memory.PSS_SHARE = 1.0  # PSS every state interval: this job is too short for 0.1% of it
    loader = torch.utils.data.DataLoader(
        Batches(leak=RANK == 1), batch_size=16, num_workers=2, persistent_workers=True
    )
    # An interval shorter than a sample's 4 steps: PSS at every sample, about 35 in the run
    # (at 0.2 s, every other one: 11 or 12 of the 12 a trend needs, as the machine's load
    # had it)
    out = run(iter(loader), lambda step: None, interval=0.1)
    return out


@scenario
def gpu() -> dict[str, Any]:
    kept: list[torch.Tensor] = []

    def forever() -> Any:
        while True:
            yield torch.randn(16, 32), torch.randn(16, 8)

    def keep(step: int) -> None:
        kept.append(torch.ones(LEAK // 4, device="cuda:0"))  # float32: LEAK bytes

    return run(forever(), keep, "cuda:0")


if __name__ == "__main__":
    main()
