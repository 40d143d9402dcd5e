"""One rank of a job that checks ddpmon never synchronizes the GPU while it trains:
``python -m tests.gpu.sync_worker BACKEND BUCKET_TIMING`` under tests/support/harness.py
(the harness sets RANK, WORLD_SIZE, DDPMON_TEST_STORE, DDPMON_TEST_OUT).

torch's sync debug mode makes every synchronizing CUDA call that torch knows of (a stream
or device synchronize, a blocking copy, ``.item()``) warn or raise. The training steps of
an unwatched DDP model run under it first: when torch's own path does not synchronize
(NCCL, once DDP has rebuilt its buckets), the watched model's steps run under ``"error"``
and must not raise; where it does (gloo copies CUDA tensors to the host), both run under
``"warn"`` and the watched model must not add a warning of its own (warnings raised on
gloo's own threads do not reach Python and count for neither). Every step boundary
of the watched model (bucket timing folded in, CUDA events queried) and the scrapes that
run meanwhile are inside the checked span. Data is made on the GPU: copying a host batch
in synchronizes by itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import urllib.request
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpmon
from tests.distributed.worker import MLP

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
WARMUP = 3  # DDP rebuilds its buckets after iteration 0, which synchronizes
STEPS = 30  # past the c10d self-check (20 settled steps)


def make(backend: str) -> DDP:
    torch.manual_seed(0)
    kwargs = {"device_ids": [0]} if backend == "nccl" else {}
    return DDP(MLP(width=256).cuda(), bucket_cap_mb=0.1, **kwargs)


def train(model: DDP, steps: int, scrape_port: int | None = None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator(device="cuda").manual_seed(RANK)
    for step in range(steps):
        x = torch.randn(16, 32, device="cuda", generator=gen)
        y = torch.randn(16, 8, device="cuda", generator=gen)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if scrape_port is not None and step % 10 == 5:  # the exporter reads while the job runs
            with urllib.request.urlopen(f"http://127.0.0.1:{scrape_port}/metrics", timeout=10) as r:
                r.read()


def checked(mode: str, fn: Any) -> tuple[str | None, list[str]]:
    """Run ``fn`` under sync debug ``mode``: (the error it raised, the sync warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            fn()
            error = None
        except RuntimeError as exc:
            error = str(exc)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return error, sorted({str(w.message) for w in caught if "synchroniz" in str(w.message)})


def main() -> None:
    backend, timing = sys.argv[-2:]  # after the harness's scenario name (empty here)
    out = os.environ["DDPMON_TEST_OUT"]
    torch.cuda.set_device(0)
    store = dist.FileStore(os.environ["DDPMON_TEST_STORE"], WORLD)
    dist.init_process_group(backend, store=store, rank=RANK, world_size=WORLD)

    baseline_error = "not tried: gloo synchronizes its own stream to copy CUDA tensors"
    if backend == "nccl":  # one rank: no peer is left waiting if this raises part-way
        plain = make(backend)
        train(plain, WARMUP)
        baseline_error, _ = checked("error", lambda: train(plain, STEPS))
    mode = "error" if baseline_error is None else "warn"
    baseline_warnings: list[str] = []
    if mode == "warn":
        plain = make(backend)
        train(plain, WARMUP)
        _, baseline_warnings = checked("warn", lambda: train(plain, STEPS))

    watched = make(backend)
    mon = ddpmon.attach(
        watched, job="sync", port=0, bucket_timing=timing, state_dir=os.path.join(out, "state")
    )
    train(watched, WARMUP)
    error, watched_warnings = checked(mode, lambda: train(watched, STEPS, mon.port))
    torch.cuda.synchronize()  # the test's own; ddpmon never synchronizes
    time.sleep(1.0)  # c10d reports completions from its watchdog thread, a little later
    mon.step()
    snap = mon.snapshot()
    mon.detach()
    rows = mon.recorder.history_since(0)
    result = {
        "gpu_parts_steps": sum(1 for r in rows if r.gpu_parts),
        "gpu_rows": [dataclasses.asdict(r) for r in rows if r.gpu_parts][-5:],
        "mode": mode,
        "baseline_error": baseline_error,
        "error": error,
        "extra_warnings": [w for w in watched_warnings if w not in baseline_warnings],
        "bucket_timing": snap["bucket_timing"],
        "notes": snap["notes"],
        "errors": snap["errors"],
        "steps": snap["step"],
        "timed_buckets": [b["count"] for b in snap["buckets"]],
    }
    with open(os.path.join(out, f"result-{RANK}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
