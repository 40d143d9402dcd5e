"""One CUDA rank for tests/gpu: ``python -m tests.gpu.gpu_worker OUT_DIR``.

A world of one (NCCL, FileStore) on cuda:0 as CUDA_VISIBLE_DEVICES maps it, with ddpmon
attached. It trains a few steps, scrapes its own endpoint, writes what it saw and torch's
own allocator figures to OUT_DIR/result.json, then stays alive until OUT_DIR/stop exists
(so the node daemon can see it on the GPU).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpmon


def main() -> None:
    out = sys.argv[1]
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", store=dist.FileStore(os.path.join(out, "store"), 1), rank=0, world_size=1
    )
    model = DDP(
        nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)).cuda(),
        device_ids=[0],
    )
    mon = ddpmon.attach(model, job="gpu-test", port=0, state_dir=os.path.join(out, "state"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    keep = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 256 MiB held throughout
    for _ in range(5):
        x = torch.randn(64, 1024, device="cuda")
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize()  # the test's own check; ddpmon never synchronizes
    time.sleep(0.5)
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{mon.port}/metrics", timeout=10).read().decode()
    )
    result = {
        "metrics": text,
        "allocated": torch.cuda.memory_allocated(0),
        "reserved": torch.cuda.memory_reserved(0),
        "peak": torch.cuda.max_memory_allocated(0),
        "pid": os.getpid(),
    }
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)
    while not os.path.exists(os.path.join(out, "stop")):
        time.sleep(0.1)
    del keep
    mon.detach()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
