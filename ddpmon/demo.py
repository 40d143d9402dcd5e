"""``python -m ddpmon.demo``: a real 2-rank CPU DDP training run (torchrun, gloo, synthetic
data) with ddpmon attached. It says where the endpoints and state files are while it runs and
prints a per-rank summary at the end. ``--rank-worker`` is what each torchrun rank runs."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request


def _worker(steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpmon

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    class Model(nn.Module):
        """A small MLP with an auxiliary head that only rank 0 uses (unused on rank 1)."""

        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(
                *[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(6)]
            )
            self.head = nn.Linear(256, 10)
            self.aux_head = nn.Linear(256, 10)

        def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
            h = self.body(x)
            return self.head(h) + (self.aux_head(h) if use_aux else 0)

    model = DDP(Model(), bucket_cap_mb=0.5, find_unused_parameters=True)
    monitor = ddpmon.attach(model, job="demo")
    print(
        f"rank {rank}: metrics at {monitor.metrics_url}  state file {monitor.state_file}",
        flush=True,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x, use_aux=(rank == 0)), y).backward()
        opt.step()
        if rank == 0 and step == steps // 2 and monitor.metrics_url:
            body = urllib.request.urlopen(monitor.metrics_url, timeout=5).read().decode()
            lines = [
                line
                for line in body.splitlines()
                if line.startswith(("ddpmon_steps_total", "ddpmon_allreduce_seconds_count"))
            ]
            print("rank 0: a live scrape of its endpoint:\n  " + "\n  ".join(lines[:4]), flush=True)
    monitor.step()
    monitor.detach()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        _worker(args.steps)
        return 0

    from .cli import top

    state_dir = tempfile.mkdtemp(prefix="ddpmon-demo-")
    env = dict(os.environ, DDPMON_STATE_DIR=state_dir, OMP_NUM_THREADS="1")
    env.setdefault("DDPMON_PORT", "0")  # ephemeral ports: the demo never collides
    # gloo has no cheap per-bucket timing source, so by default ddpmon leaves DDP's C++
    # all-reduce alone there; the demo shows what a Python comm hook's timing gives.
    env.setdefault("DDPMON_BUCKET_TIMING", "hook")
    print(
        f"ddpmon demo: 2-rank CPU DDP (gloo) for {args.steps} steps; state files in {state_dir}\n"
        f"  per-bucket timing: DDPMON_BUCKET_TIMING={env['DDPMON_BUCKET_TIMING']} (on gloo the default "
        "is off: any Python comm hook costs a few percent of step time)",
        flush=True,
    )
    start = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "ddpmon.demo",
        "--rank-worker",
        "--steps",
        str(args.steps),
    ]
    code = subprocess.call(cmd, env=env)
    states, problems = top.load(state_dir)
    print(
        f"\nddpmon demo: training finished in {time.monotonic() - start:.1f} s (exit {code}). "
        f"Summary from the state files ({state_dir}):\n"
    )
    print(top.render(states, problems, buckets=True))
    print(f"\nSee it again with: ddpmon top --once --buckets {state_dir}")
    return code


if __name__ == "__main__":
    sys.exit(main())
