"""One rank of the throughput job: ``python -m tests.distributed.throughput_worker flops``.

An MLP trained twice from the same start on the same batches, without ddpmon and then with
it (its FLOPs counted at step ``COUNT_STEP``), the parameters kept after every step for the
test to compare bit for bit; then a small language model whose first input is token ids.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed.worker import RANK, init, main, scenario, scrape

STEPS = 12
MICRO = 16  # samples per micro-batch; 2 micro-batches per optimizer step
LAYERS = ((32, 64), (64, 64), (64, 64), (64, 64), (64, 8))
VOCAB, SEQUENCES, LENGTH, WIDTH = 50, 4, 12, 16


def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for n_in, n_out in LAYERS:
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def micro_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * RANK + 10 * step + micro)
    return torch.randn(MICRO, 32, generator=g), torch.randn(MICRO, 8, generator=g)


def train(model: DDP) -> tuple[list[list[torch.Tensor]], list[float], list[int]]:
    """STEPS optimizer steps of two micro-batches (the first under no_sync): the parameters
    after each step, each step's seconds as this loop saw them (optimizer step to optimizer
    step), and the torch dispatch modes left on after each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    params, seconds, modes = [], [], []
    last = time.perf_counter()
    for step in range(STEPS):
        opt.zero_grad()
        with model.no_sync():
            x, y = micro_batch(step, 0)
            nn.functional.mse_loss(model(x), y).backward()
        x, y = micro_batch(step, 1)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        now = time.perf_counter()
        seconds.append(now - last)
        last = now
        params.append([p.detach().clone() for p in model.parameters()])
        modes.append(torch._C._len_torch_dispatch_stack())
    return params, seconds, modes


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


@scenario
def flops() -> dict[str, Any]:
    import ddpmon
    from ddpmon.rank.throughput import COUNT_STEP

    init()
    torch.manual_seed(0)
    start = mlp().state_dict()
    plain = DDP(mlp())
    plain.module.load_state_dict(start)
    plain_params, _, _ = train(plain)

    counted = DDP(mlp())
    counted.module.load_state_dict(start)
    global_hooks = len(torch.nn.modules.module._global_forward_pre_hooks)
    mon = ddpmon.attach(counted, job="flops", bucket_timing="hook")
    counted_params, seconds, modes = train(counted)
    time.sleep(0.05)
    out: dict[str, Any] = {
        "count_step": COUNT_STEP,
        "same": [
            all(torch.equal(a, b) for a, b in zip(pa, pb))
            for pa, pb in zip(plain_params, counted_params)
        ],
        "loop_seconds": seconds,
        "dispatch_modes": modes,
        "global_hooks_added": len(torch.nn.modules.module._global_forward_pre_hooks) - global_hooks,
        "throughput": mon.snapshot()["throughput"],
        "errors": mon.snapshot()["errors"],
        "metrics": scrape(mon.port),
        "state_dir": os.path.dirname(mon.state_file),
    }
    mon.detach()

    lm = DDP(TinyLM())
    with ddpmon.attach(
        lm, job="tokens", state_dir=os.path.join(os.environ["DDPMON_TEST_OUT"], "tokens")
    ) as lm_mon:
        opt = torch.optim.SGD(lm.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(RANK)
        for _ in range(8):
            ids = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=g)
            opt.zero_grad()
            logits = lm(ids)
            nn.functional.cross_entropy(
                logits.flatten(0, 1), torch.roll(ids, -1, 1).flatten()
            ).backward()
            opt.step()
        out["lm"] = lm_mon.snapshot()["throughput"]
        out["lm_metrics"] = scrape(lm_mon.port)
    return out


if __name__ == "__main__":
    main()
