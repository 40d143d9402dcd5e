"""What ddpmon costs per step, part by part, in CPU time: figures that hold on a loaded machine.

One process, a world of one on gloo (FileStore), the MLP of overhead.py. Two measurements:

- **hooks**: every hook ddpmon registers on the training thread is wrapped with a counter of
  the thread's CPU time (``time.thread_time_ns``; ``--clock wall``: ``perf_counter_ns``); the
  wrapper's own cost, measured on an empty function, is subtracted. Printed per hook in
  microseconds per step.
- **threads**: each part that wakes once a second (the state writer's pass, the watchdog's
  check with its loop-line sample, the advice thread's comparison, a scrape of /metrics) is
  called directly ``--passes`` times and timed on the calling thread's CPU clock: the GIL
  it holds per pass, in microseconds, and per step at ``--step-ms`` a step.

Also the training thread's CPU time per step, attached against plain, blocks alternating.

    python benchmarks/step_cost.py                 # defaults: 400 steps, 20 passes
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

from overhead import build_model  # as in overhead.py

COST: dict[str, list[int]] = defaultdict(list)
CLOCKS = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}
clock_name = "cpu"
"""The hooks' clock: the thread's CPU time (a system call, about 0.5 us), or ``--clock
wall`` (``perf_counter_ns``, 0.1 us; a quiet machine's hooks are rarely preempted)."""


def timed(name: str, fn: Any) -> Any:
    clock = CLOCKS[clock_name]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            COST[name].append(clock() - start)

    return wrapper


HOOKS = [
    ("ddpmon.rank.hooks.step", "StepHooks", "_before_forward"),
    ("ddpmon.rank.hooks.step", "StepHooks", "_after_forward"),
    ("ddpmon.rank.hooks.step", "StepHooks", "_backward_started"),
    ("ddpmon.rank.hooks.step", "StepHooks", "_backward_done"),
    ("ddpmon.rank.hooks.step", "StepHooks", "_synced"),
    ("ddpmon.rank.hooks.optimizer", "OptimizerHooks", "_before_step"),
    ("ddpmon.rank.hooks.optimizer", "OptimizerHooks", "_after_step"),
    ("ddpmon.rank.boundary", "StepBoundary", "end"),
    ("ddpmon.rank.throughput", "Throughput", "forward_started"),
    ("ddpmon.rank.throughput", "Throughput", "_before_forward"),  # (a hook of its own before)
    ("ddpmon.rank.advice.watch", "Advice", "ddp_forward_started"),
    ("ddpmon.rank.advice.watch", "Advice", "ddp_forward_ended"),
    ("ddpmon.rank.advice.watch", "Advice", "_before_inner_forward"),
    ("ddpmon.rank.advice.training", "OptimizerSteps", "_before_step"),
    ("ddpmon.rank.advice.nonfinite", "GradCheck", "__call__"),
    # the parts of the step's end and of the two autograd callbacks (inside the above)
    ("ddpmon.rank.recorder", "Recorder", "close_step"),
    ("ddpmon.rank.throughput", "Throughput", "step_ended"),
    ("ddpmon.rank.boundary", "StepBoundary", "collect_resolved"),
    ("ddpmon.rank.hooks.autograd", "UnusedParameterWatch", "step_ended"),
    ("ddpmon.rank.advice.watch", "Advice", "step_ended"),
    ("ddpmon.rank.timing.untimed", "UntimedBuckets", "backward_done"),
    ("ddpmon.rank.timing.untimed", "UntimedBuckets", "sync_done"),
]


NESTED = {
    "StepBoundary.end",
    "Throughput.forward_started",
    "Advice.ddp_forward_started",
    "Advice.ddp_forward_ended",
    "Recorder.close_step",
    "Throughput.step_ended",
    "StepBoundary.collect_resolved",
    "UnusedParameterWatch.step_ended",
    "Advice.step_ended",
    "UntimedBuckets.backward_done",
    "UntimedBuckets.sync_done",
}
"""Called from inside another hook in the list (the optimizer's post hook, the step hooks'
pre-hook): shown, left out of the sum."""


def wrap_hooks() -> None:
    """Wrap the hook methods at class level, before attach registers them."""
    import importlib

    for module, cls, name in HOOKS:
        try:
            owner = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            continue
        if name in vars(owner):
            setattr(owner, name, timed(f"{cls}.{name}", vars(owner)[name]))


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--block", type=int, default=10)
    p.add_argument(
        "--warmup",
        type=int,
        default=600,
        help="steps before measuring (advice checks every step at first)",
    )
    p.add_argument("--passes", type=int, default=20)
    p.add_argument(
        "--step-ms", type=float, default=24.0, help="step time the per-step figures assume"
    )
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--model", default="mlp")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="the hooks' clock")
    args = p.parse_args()
    global clock_name
    clock_name = args.clock
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    store = dist.FileStore(tempfile.mktemp(prefix="ddpmon-step-cost-"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    wrap_hooks()
    import ddpmon
    from ddpmon.rank.exporter import RankCollector

    torch.manual_seed(0)
    plain = DDP(build_model(args))
    torch.manual_seed(0)
    watched = DDP(build_model(args))
    state_dir = tempfile.mkdtemp(prefix="ddpmon-step-cost-")
    monitor = ddpmon.attach(watched, job="step-cost", port=-1, state_dir=state_dir)
    x = torch.randn(args.batch, args.width)
    y = torch.randint(0, 10, (args.batch,))
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-3) for m in (plain, watched)}

    def block(model: Any) -> float:
        opt = opts[id(model)]
        start = time.thread_time_ns()
        for _ in range(args.block):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return (time.thread_time_ns() - start) / args.block / 1000

    for _ in range(max(1, args.warmup // args.block)):  # past the checks of the first steps
        block(plain), block(watched)
    COST.clear()
    diffs = []
    for i in range(args.steps // args.block):
        if i % 2 == 0:
            a, w = block(plain), block(watched)
        else:
            w, a = block(watched), block(plain)
        diffs.append(w - a)
    steps = args.steps // args.block * args.block

    empty = timed("empty", lambda: None)
    for _ in range(10000):
        empty()
    wrapper_ns = statistics.median(COST.pop("empty"))

    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print(
        f"training thread CPU time, attached minus plain: median {statistics.median(diffs):+.0f} "
        f"us per step over {len(diffs)} pairs of {args.block}-step blocks"
    )
    print(f"hooks (CPU us per step; wrapper's own {wrapper_ns / 1000:.2f} us per call subtracted):")
    total = 0.0
    for name, values in sorted(COST.items(), key=lambda kv: -sum(kv[1])):
        per_step = (sum(values) - wrapper_ns * len(values)) / steps / 1000
        total += 0.0 if name in NESTED else per_step
        print(
            f"  {name:<40} {len(values) / steps:5.1f} calls/step {per_step:8.1f} us/step "
            f"(median call {(statistics.median(values) - wrapper_ns) / 1000:6.1f} us)"
            + (" (inside another)" if name in NESTED else "")
        )
    print(f"  {'(sum, each call counted once)':<40} {'':16} {total:8.1f} us/step")

    # -- the parts that wake about once a second -------------------------------------------
    def per_pass(fn: Any) -> float:
        values = []
        for _ in range(args.passes):
            start = time.thread_time_ns()
            fn()
            values.append(time.thread_time_ns() - start)
        return statistics.median(values) / 1000

    parts = {}
    writer = monitor._writer
    if writer is not None:
        parts["state writer: snapshot"] = per_pass(monitor.recorder.snapshot)
        parts["state writer: whole pass"] = per_pass(writer.write_now)
    if monitor._capture is not None:
        parts["capture: look for a request"] = per_pass(monitor._capture.poll)
    if monitor._watchdog is not None:
        parts["watchdog: check (loop-line sample)"] = per_pass(monitor._watchdog.check)
    if monitor._advice is not None and monitor._advice._peers is not None:
        parts["advice: compare with peers (every 2 s)"] = per_pass(
            lambda: monitor._advice.compare_now(state_dir, monitor.job)
        )
    if monitor._history is not None:
        parts["history: flush"] = per_pass(lambda: monitor._history._writer.flush(False))
    collector = RankCollector(monitor.recorder, "auto", sources=[])
    parts["scrape: metric families (no collectors)"] = per_pass(lambda: list(collector.collect()))
    from ddpmon.rank.sources import rank_sources

    sources, closers = rank_sources("step-cost", 0, "cpu", True, lambda *_: None)
    full = RankCollector(monitor.recorder, "auto", sources=sources)
    parts["scrape: metric families (with collectors)"] = per_pass(lambda: list(full.collect()))
    for close in closers:
        close()
    print(
        f"once-a-second parts (CPU us per pass, the GIL held; per step at {args.step_ms:g} ms "
        "a step and one pass a second):"
    )
    for name, us in parts.items():
        print(f"  {name:<44} {us:8.0f} us/pass {us * args.step_ms / 1000:6.1f} us/step")
    memory_cost(monitor, per_pass, args.step_ms)
    monitor.detach()
    dist.destroy_process_group()
    return 0


def memory_cost(monitor: Any, per_pass: Any, step_ms: float) -> None:
    """The memory watch's thread (rank/memory.py), stopped and called directly: a look at
    the step count with nothing due, a sample (the rank's RSS), the fit of its trends (once
    a state interval). At its fastest it looks every 2 steps and samples every
    ``SAMPLE_STEPS``; none of it runs on the training thread, each holds the GIL."""
    from ddpmon import memory

    watch = monitor._memory
    if watch is None:
        return
    watch.stop()
    rec = monitor.recorder
    look = per_pass(watch.sample)  # the step count stands still here: nothing due
    sample = per_pass(lambda: watch._take(rec.steps, time.time()))
    fit = per_pass(lambda: watch._fit(time.time()))
    every = memory.SAMPLE_STEPS
    print(
        f"memory watch (its own thread, CPU us with the GIL held; per step at {step_ms:g} ms a "
        f"step, sampling every {every} steps):"
    )
    print(
        f"  {'a look, nothing due (every 2 steps)':<44} {look:8.1f} us/pass {look / 2:6.1f} us/step"
    )
    print(
        f"  {'a sample: the RSS of the rank':<44} {sample:8.1f} us/pass {sample / every:6.1f} us/step"
    )
    print(
        f"  {'the trends fitted (once a second)':<44} {fit:8.0f} us/pass "
        f"{fit * step_ms / 1000:6.1f} us/step"
    )


if __name__ == "__main__":
    sys.exit(main())
