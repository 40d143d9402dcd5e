"""What a Python comm hook costs by itself, without ddpmon: several identical DDP models on one
process group, one per variant, blocks of steps in alternating order, each variant's median
step-time ratio against plain DDP in the same run.

    python benchmarks/hook_cost.py --rounds 150
    python benchmarks/hook_cost.py --variants plain,passthrough,scaled,builtin,plain

Variants: ``plain`` (DDP as is; listed twice it is the A/A noise floor), ``passthrough``
(a Python hook: all-reduce and a ``then`` callback, no scaling; wrong gradients, for timing
only), ``scaled`` (the same after scaling by 1/world size: what DDP's default computes),
``scaled_after`` (scaling inside the callback instead), ``builtin`` (DDP's C++ ALLREDUCE hook),
``ddpmon`` (ddpmon attached with ``bucket_timing="hook"``, no endpoint or state file) and
``ddpmon-read`` (the same while, during its blocks, another thread reads its snapshot and
metrics every millisecond: whether readers hold up the hooks).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from overhead import build_model, median_interval, under_torchrun  # as in overhead.py


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(args.backend)
    world = dist.get_world_size()

    def first(fut):  # type: ignore[no-untyped-def]
        value = fut.value()
        return value[0] if isinstance(value, list) else value

    def passthrough(state, bucket):  # type: ignore[no-untyped-def]
        return dist.group.WORLD.allreduce([bucket.buffer()]).get_future().then(first)

    def scaled(state, bucket):  # type: ignore[no-untyped-def]
        bucket.buffer().mul_(1.0 / world)
        return dist.group.WORLD.allreduce([bucket.buffer()]).get_future().then(first)

    def scaled_after(state, bucket):  # type: ignore[no-untyped-def]
        return (
            dist.group.WORLD.allreduce([bucket.buffer()])
            .get_future()
            .then(lambda fut: first(fut).mul_(1.0 / world))
        )

    def build() -> DDP:
        torch.manual_seed(0)
        return DDP(
            build_model(args.width, args.depth),
            gradient_as_bucket_view=args.gradient_as_bucket_view,
        )

    hooks = {"passthrough": passthrough, "scaled": scaled, "scaled_after": scaled_after}
    variants = args.variants.split(",")
    models = []
    readers = []
    for name in variants:
        model = build()
        if name in ("ddpmon", "ddpmon-read"):
            import ddpmon

            monitor = ddpmon.attach(
                model,
                bucket_timing="hook",
                port=-1,
                state_dir="",
                job=f"hook-cost-{len(models)}",
                hang_timeout=0,
            )
            if name == "ddpmon-read":
                readers.append(monitor)
        elif name in hooks:
            model.register_comm_hook(None, hooks[name])
        elif name == "builtin":
            model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        elif name != "plain":
            raise SystemExit(f"unknown variant {name!r}")
        models.append((model, torch.optim.SGD(model.parameters(), lr=1e-3)))
    x = torch.randn(args.batch, args.width)
    y = torch.randint(0, 10, (args.batch,))
    stop_reading = threading.Event()
    reading = threading.Event()

    def read_forever(monitor) -> None:  # type: ignore[no-untyped-def]
        from ddpmon.rank.exporter import RankCollector

        collector = RankCollector(monitor.recorder)
        while not stop_reading.is_set():
            if reading.wait(0.1):
                monitor.snapshot()
                list(collector.collect())
                time.sleep(0.001)

    for monitor in readers:
        threading.Thread(target=read_forever, args=(monitor,), daemon=True).start()

    def block(i: int, steps: int) -> float:
        model, opt = models[i]
        if variants[i] == "ddpmon-read":
            reading.set()
        start = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        reading.clear()
        return (time.perf_counter() - start) / steps

    for i in range(len(models)):
        block(i, 3)  # warm-up: bucket rebuild, allocator
    times: list[list[float]] = [[] for _ in models]
    for r in range(args.rounds):
        order = range(len(models)) if r % 2 == 0 else reversed(range(len(models)))
        for i in order:
            times[i].append(block(i, args.block))
    if dist.get_rank() == 0:
        print(
            f"{world} ranks, {args.backend}, MLP {args.depth}x{args.width}, batch {args.batch}"
            f"{', gradient_as_bucket_view' if args.gradient_as_bucket_view else ''}: "
            f"plain step {statistics.median(times[0]) * 1000:.2f} ms; {args.rounds} rounds of {args.block}-step blocks"
        )
        for name, series in list(zip(variants, times))[1:]:
            ratios = [a / b for a, b in zip(series, times[0])]
            q = statistics.quantiles(ratios, n=4)
            low, high = median_interval(ratios)
            print(
                f"  {name:<13} median ratio to plain {statistics.median(ratios):.4f} "
                f"(95% interval {low:.3f}..{high:.3f}; quartiles {q[0]:.3f}..{q[2]:.3f})"
            )
    stop_reading.set()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--variants", default="plain,passthrough,scaled,plain")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument(
        "--gradient-as-bucket-view",
        action="store_true",
        help="DDP(gradient_as_bucket_view=True) for every model",
    )
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_worker:
        worker(args)
        return 0
    under_torchrun(__file__, args.ranks, sys.argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
