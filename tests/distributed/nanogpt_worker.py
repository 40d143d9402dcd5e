"""Rank processes for tests/distributed/test_attribution.py: nanoGPT's training loop, whose
next batch is fetched between forward and backward, on a tiny character model.

``python -m tests.distributed.nanogpt_worker SLOW_RANK DELAY``: rank SLOW_RANK's
``get_batch`` takes DELAY seconds more (a slow disk on that node). The ranks train until
``stop`` exists in DDPMON_TEST_OUT (checked through an all-reduce every 10 iterations) and
each writes result-<rank>.json.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed.worker import RANK, finish, init

MAX_SECONDS = 120.0
BLOCK_SIZE = 16
BATCH_SIZE = 8
VOCAB = 64
GRADIENT_ACCUMULATION_STEPS = 2


class TinyGPT(nn.Module):
    """An embedding and a head: nanoGPT's ``model(X, Y)`` returning (logits, loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 64)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.lm_head = nn.Linear(64, VOCAB)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx)
        logits = self.lm_head(x + self.mlp(x))
        loss = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


train_data = torch.randint(0, VOCAB, (10_000,))
slow_seconds = 0.0


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(train_data) - BLOCK_SIZE, (BATCH_SIZE,))
    x = torch.stack([train_data[i : i + BLOCK_SIZE] for i in ix])
    y = torch.stack([train_data[i + 1 : i + 1 + BLOCK_SIZE] for i in ix])
    if slow_seconds:
        time.sleep(slow_seconds)  # the slow rank's disk
    return x, y


def main(slow_rank: str, delay: str) -> dict[str, object]:
    import ddpmon

    global slow_seconds
    init()
    torch.manual_seed(0)
    slow_seconds = float(delay) if RANK == int(slow_rank) else 0.0
    model = DDP(TinyGPT())
    out = os.environ["DDPMON_TEST_OUT"]
    monitor = ddpmon.attach(
        model, job="nanogpt", state_dir=os.path.join(out, "state"), port=-1, state_interval=0.5
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    flag = torch.zeros(1)
    started = time.monotonic()
    X, Y = get_batch("train")
    iter_num = 0
    while True:
        # nanoGPT's train.py, on a CPU
        for micro_step in range(GRADIENT_ACCUMULATION_STEPS):
            model.require_backward_grad_sync = micro_step == GRADIENT_ACCUMULATION_STEPS - 1
            logits, loss = model(X, Y)
            loss = loss / GRADIENT_ACCUMULATION_STEPS
            X, Y = get_batch("train")
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        time.sleep(0.005)  # a light load: the machine is shared
        if iter_num % 10 == 0:
            flag.fill_(
                float(
                    os.path.exists(os.path.join(out, "stop"))
                    or time.monotonic() - started > MAX_SECONDS
                )
            )
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
    monitor.detach()
    return {"iterations": iter_num}


if __name__ == "__main__":
    finish(main(*sys.argv[1:]))
