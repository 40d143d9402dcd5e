"""Each hook's cost inside a 2-rank gloo job, and the floor of a design whose hooks only mark.

Runs overhead.py's model (the MLP, batch 64) as a real torchrun job with ddpmon attached,
every hook wrapped as in step_cost.py (``--clock wall``: ``perf_counter_ns``), and prints on
rank 0 each hook's median call and mean per step over ``--steps`` steps past ``--warmup``.
The mean is above the median where a hook is preempted, and at 2 ranks every step waits for
the slower rank's hooks.

``--marks`` is a measurement only: it cuts ddpmon's step and optimizer hooks to a mark each
(a kind and a clock reading appended to a bounded deque), keeps the torch registrations they
need (the output's backward hook, the two autograd callbacks) and switches the advice's hooks
off. Nothing folds the marks and no step is counted: it is what the training thread would pay
in a design whose readers fold marks into steps, before the state the hooks must keep to
decide where a step ends. ``overhead.py --hooks marks`` applies the same cut.

    python benchmarks/hook_floor.py            # the hooks as they are
    python benchmarks/hook_floor.py --marks    # each cut to a mark
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from typing import Any


def cut_to_marks() -> None:
    """Replace the hooks' bodies with a mark each (class level: before attach)."""
    import torch

    from ddpmon.rank import torch_api
    from ddpmon.rank.advice import nonfinite, training, watch
    from ddpmon.rank.hooks import optimizer, step

    marks: collections.deque[tuple[int, float]] = collections.deque(maxlen=10000)
    mark, clock, is_compiling = marks.append, time.perf_counter, step.is_compiling

    def before_forward(self: Any, _m: Any, _args: Any, _kwargs: Any) -> None:
        if not is_compiling():
            mark((1, clock()))

    def after_forward(self: Any, _m: Any, _args: Any, out: Any) -> None:
        if is_compiling():
            return
        mark((2, clock()))
        if type(out) is torch.Tensor and out.requires_grad:
            torch_api.hook_tensor(out, self._backward_started)

    def backward_started(self: Any, _grad: Any) -> None:
        if not self._in_backward:
            self._in_backward = True
            mark((3, clock()))
            self._queue(self._backward_done)

    def backward_done(self: Any) -> None:
        self._in_backward = False
        mark((4, clock()))
        self._queue(self._synced)

    def synced(self: Any) -> None:
        mark((5, clock()))

    def optimizer_started(self: Any, opt: Any, _args: Any, _kwargs: Any) -> None:
        if not is_compiling() and self._holds_model(opt):
            mark((6, clock()))

    def optimizer_finished(self: Any, opt: Any, _args: Any, _kwargs: Any) -> None:
        if not is_compiling() and self._holds_model(opt):
            mark((7, clock()))
            self._recorder.last_progress_unix = time.time()  # (the watchdog's progress)

    hooks = step.StepHooks
    hooks._before_forward = before_forward  # type: ignore[method-assign]
    hooks._after_forward = after_forward  # type: ignore[method-assign]
    hooks._backward_started = backward_started  # type: ignore[method-assign]
    hooks._backward_done = backward_done  # type: ignore[method-assign]
    hooks._synced = synced  # type: ignore[method-assign]
    optimizer.OptimizerHooks._before_step = optimizer_started  # type: ignore[method-assign]
    optimizer.OptimizerHooks._after_step = optimizer_finished  # type: ignore[method-assign]
    training.OptimizerSteps._before_step = lambda self, o, a, k: None  # type: ignore[method-assign]
    nonfinite.NonFiniteWatch._hook = lambda self, on: None  # type: ignore[method-assign]
    watch.Advice._watch_inner = lambda self, on: None  # type: ignore[method-assign]


def worker(args: argparse.Namespace) -> None:
    import step_cost
    import torch
    import torch.distributed as dist
    from overhead import build_model
    from torch.nn.parallel import DistributedDataParallel as DDP

    if args.marks:
        cut_to_marks()
    step_cost.clock_name = "wall"
    step_cost.wrap_hooks()
    import ddpmon

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(build_model(argparse.Namespace(model="mlp", width=512, depth=8)))
    monitor = ddpmon.attach(model, job="hook-floor", port=-1, state_dir=tempfile.mkdtemp())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))

    def train(steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    train(args.warmup)
    step_cost.COST.clear()
    start = time.perf_counter()
    train(args.steps)
    step_ms = (time.perf_counter() - start) / args.steps * 1000
    if dist.get_rank() == 0:
        print(f"rank 0, {args.steps} steps of {step_ms:.2f} ms (microseconds):")
        total = 0.0
        for name, values in sorted(step_cost.COST.items(), key=lambda kv: -sum(kv[1])):
            per_step = sum(values) / args.steps / 1000
            nested = name in step_cost.NESTED
            total += 0.0 if nested else per_step
            print(
                f"  {name:<36} {len(values) / args.steps:4.1f} calls/step, median call "
                f"{statistics.median(values) / 1000:6.1f}, {per_step:6.1f} a step"
                + (" (inside another)" if nested else "")
            )
        print(f"  {'(sum, each call counted once)':<36} {total:6.1f} a step")
    monitor.detach()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=700, help="past the advice's first checks")
    p.add_argument("--marks", action="store_true", help="each hook cut to a mark (see above)")
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_worker:
        worker(args)
    else:
        from overhead import under_torchrun

        under_torchrun(__file__, 2, sys.argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
