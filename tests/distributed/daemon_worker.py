"""A rank that trains slowly until it is killed: ``python -m tests.distributed.daemon_worker``.

Started by tests/distributed/test_daemon.py with the harness's rank environment. It feeds
its steps from a DataLoader with one persistent worker process (a child to count). When
its peer is killed, gloo raises where NCCL would hang; the survivor then stays alive and
idle, as a rank stuck in a collective does, so its liveness can be checked.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import ddpmon
from tests.distributed.worker import MLP, RANK, init


class Synthetic(Dataset):
    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(32, generator=g), torch.randn(8, generator=g)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{RANK} %(message)s")
    init()
    torch.manual_seed(0)
    model = DDP(MLP())
    ddpmon.attach(model, job="daemon-test")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Synthetic(), batch_size=16, num_workers=1, persistent_workers=True)
    try:
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            time.sleep(0.05)
    except RuntimeError as exc:
        logging.warning("training stopped: %s", exc)
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main()
