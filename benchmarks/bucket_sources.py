"""Per-bucket all-reduce times from each bucket-timing source, side by side, on NCCL.

The same model (an MLP, ``--depth`` layers ``--width`` wide, 25 MB buckets) trains
``--steps`` steps once per source (``c10d``: the completion hook, the default on NCCL;
``hook``: CUDA events around ddpmon's comm hook; ``flight_recorder``: torch's recorder read
back every 5 s; and the default with the program's own comm hook, torch's
``fp16_compress_hook``, given to ``attach``), each in a process of its own on one rank. For each bucket it prints the
mean time each source gave, and how far ``c10d`` and ``flight_recorder`` are from ``hook``.
Then, in the flight recorder's process, the cost of one dump of the recorder as it is then
(its ring buffer holding the job's collectives), timed ``--dumps`` times.

    python benchmarks/bucket_sources.py              # needs a GPU and NCCL
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SOURCES = ("c10d", "hook", "flight_recorder")
USER_HOOK = (
    "user_hook"  # the default (auto) with the program's own hook (torch's fp16_compress_hook)
)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpmon
    from ddpmon.rank import torch_api

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", store=dist.FileStore(os.path.join(args.tmp, args.source), 1), rank=0, world_size=1
    )
    torch.manual_seed(0)
    layers = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = DDP(nn.Sequential(*layers).cuda(), device_ids=[0])
    hook = {}
    if (
        args.source == USER_HOOK
    ):  # given to attach, as DDP takes one hook (registered first: refused)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        hook = {"comm_hook": fp16_compress_hook}
    timing = "auto" if args.source in ("c10d", USER_HOOK) else args.source
    mon = ddpmon.attach(
        model,
        job="sources",
        port=-1,
        bucket_timing=timing,
        **hook,
        state_dir=os.path.join(args.tmp, "state-" + args.source),
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width, device="cuda")
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
    time.sleep(6.0 if args.source == "flight_recorder" else 1.0)  # the recorder is read every 5 s
    mon.step()
    snap = mon.snapshot()
    dumps: list[float] = []
    entries = 0
    if args.source == "flight_recorder":
        for _ in range(args.dumps):
            begun = time.perf_counter()
            entries = len(torch_api.flight_recorder_dump("nccl").get("entries") or [])
            dumps.append(time.perf_counter() - begun)
    mon.detach()
    print(
        json.dumps(
            {
                "source": snap["bucket_timing"],
                "notes": snap["notes"],
                "buckets": snap["buckets"],
                "dump_seconds": dumps,
                "entries": entries,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "torch": torch.__version__,
            }
        )
    )
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--dumps", type=int, default=10)
    p.add_argument("--source", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.source:
        worker(args)
        return 0
    tmp = tempfile.mkdtemp(prefix="ddpmon-sources-")
    got = {}
    for source in (*SOURCES, USER_HOOK):
        out = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                *sys.argv[1:],
                "--source",
                source,
                "--tmp",
                tmp,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not lines:
            print(f"{source}: failed\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
            return 1
        got[source] = json.loads(lines[-1])
        timed = [b["count"] for b in got[source]["buckets"]]
        print(
            f"{source}: reported source {got[source]['source']}, buckets timed {timed}, "
            f"notes {got[source]['notes'] or 'none'}"
        )
    first = got["hook"]
    print(
        f"torch {first['torch']}, NCCL {first['nccl']}; {args.steps} steps, MLP {args.depth}x{args.width}, "
        f"batch {args.batch}"
    )
    print(
        "bucket  MB      count(c10d/hook/fr)  mean ms: c10d    hook      fr     c10d-hook  fr-hook"
    )
    diffs: dict[str, list[float]] = {"c10d": [], "flight_recorder": []}
    for b in first["buckets"]:
        row = {
            s: next((x for x in got[s]["buckets"] if x["index"] == b["index"]), {}) for s in SOURCES
        }
        mean = {s: row[s].get("mean_seconds") for s in SOURCES}
        counts = "/".join(str(row[s].get("count", 0)) for s in SOURCES)
        cells = "  ".join(
            f"{mean[s] * 1e3:8.4f}" if mean[s] is not None else "       -" for s in SOURCES
        )
        delta = []
        for s in ("c10d", "flight_recorder"):
            if mean[s] is not None and mean["hook"] is not None:
                diffs[s].append(mean[s] - mean["hook"])
                delta.append(f"{(mean[s] - mean['hook']) * 1e3:+9.4f}")
            else:
                delta.append("        -")
        print(
            f"{b['index']:6d}  {b['bytes'] / 2**20:6.1f}  {counts:>19}  {cells}  {'  '.join(delta)}"
        )
    for s, d in diffs.items():
        if d:
            print(
                f"{s} minus hook, per bucket: median {statistics.median(d) * 1e3:+.4f} ms, "
                f"largest {max(d, key=abs) * 1e3:+.4f} ms over {len(d)} buckets"
            )
    fr = got["flight_recorder"]
    if fr["dump_seconds"]:
        print(
            f"flight recorder dump ({fr['entries']} entries): median {statistics.median(fr['dump_seconds']) * 1e3:.2f} ms, "
            f"max {max(fr['dump_seconds']) * 1e3:.2f} ms over {len(fr['dump_seconds'])} dumps"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
