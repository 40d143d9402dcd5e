"""What ``ddpmon capture`` costs a rank: while no capture is asked for (the step boundary's
check, the state writer's look for a request), and while one records (the profiler's cost
on the steps it records). One process, no DDP: a Recorder, its StepBoundary and the capture
part, as a rank has them.

    python benchmarks/capture_cost.py                       # this checkout
    PYTHONPATH=<an older checkout> python benchmarks/capture_cost.py --boundary-only

``--boundary-only`` times ``StepBoundary.end`` alone, so that a checkout from before
captures existed can be timed the same way (an A/B of the step boundary).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import timeit


def boundary_cost(repeat: int, number: int) -> list[float]:
    """Microseconds per ``StepBoundary.end`` (closing a step in the recorder included)."""
    from ddpmon.fuses import Fuse
    from ddpmon.rank.boundary import StepBoundary
    from ddpmon.rank.recorder import Recorder
    from ddpmon.state.schema import Identity

    rec = Recorder(Identity(rank=0), world_size=2)
    boundary = StepBoundary(rec, Fuse("step_hooks"), lambda: None)
    # between runs a reader folds the recorder's events, as the state writer does every second
    runs = timeit.repeat(
        lambda: boundary.end(time.perf_counter()), setup=rec.state, repeat=repeat, number=number
    )
    return [r / number * 1e6 for r in runs]


def check_cost(number: int) -> float:
    """Nanoseconds of the one test a step's end gains: ``boundary.capture is not None``."""

    class B:
        capture = None

    b = B()
    return (
        min(timeit.repeat(lambda: b.capture is not None, repeat=7, number=number)) / number * 1e9
        - min(timeit.repeat(lambda: None, repeat=7, number=number)) / number * 1e9
    )


def poll_cost(number: int) -> float:
    """Microseconds per look for a request file that is not there (once a second on a rank)."""
    from ddpmon.fuses import Fuse
    from ddpmon.rank.boundary import StepBoundary
    from ddpmon.rank.capture import Capture
    from ddpmon.rank.recorder import Recorder
    from ddpmon.state.schema import Identity

    rec = Recorder(Identity(rank=0), world_size=2)
    with tempfile.TemporaryDirectory() as d:
        part = Capture(
            d,
            rec,
            StepBoundary(rec, Fuse("step_hooks"), lambda: None),
            lambda: None,
            Fuse("capture"),
            "cpu",
        )

        def look() -> None:
            part._next_look = 0.0  # every call looks (a rank looks at most once a second)
            part.poll()

        return min(timeit.repeat(look, repeat=5, number=number)) / number * 1e6


def recording_cost(steps: int, rounds: int) -> tuple[float, float, list[float]]:
    """Median step time (ms) of a small MLP's training step outside and inside a capture,
    and how long the step's end that starts the profiler takes (ms), capture by capture."""
    import torch
    from torch import nn

    from ddpmon.fuses import Fuse
    from ddpmon.rank.boundary import StepBoundary
    from ddpmon.rank.capture import Capture
    from ddpmon.rank.recorder import Recorder
    from ddpmon.state import captures
    from ddpmon.state.schema import Identity

    torch.manual_seed(0)
    model = nn.Sequential(
        *[m for _ in range(8) for m in (nn.Linear(512, 512), nn.ReLU())], nn.Linear(512, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    x, y = torch.randn(64, 512), torch.randn(64, 10)
    rec = Recorder(Identity(rank=0, job="bench", pid=os.getpid()), world_size=1)
    boundary = StepBoundary(rec, Fuse("step_hooks"), lambda: None)
    outside: list[float] = []
    inside: list[float] = []
    starts: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        part = Capture(d, rec, boundary, lambda: None, Fuse("capture"), "cpu")
        for _ in range(rounds):
            for _ in range(steps + captures.WARMUP_STEPS + 1):  # as many steps without a capture
                t = time.perf_counter()
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                boundary.end(time.perf_counter())
                outside.append(time.perf_counter() - t)
            now = time.time()
            captures.write_request(
                d,
                captures.Request(
                    os.urandom(8).hex(),
                    0,
                    "bench",
                    os.getpid(),
                    rec.started_unix,
                    steps,
                    None,
                    now,
                    now + 60,
                ),
            )
            part._next_look = 0.0
            part.poll()
            n = 0
            while boundary.capture is not None:
                t = time.perf_counter()
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                ended = time.perf_counter()
                boundary.end(ended)
                if n <= captures.WARMUP_STEPS:  # starting the profiler, then its recording
                    starts.append((time.perf_counter() - ended) * 1e3)
                if n > captures.WARMUP_STEPS:  # a recorded step (not the start, not the warm-up)
                    inside.append(time.perf_counter() - t)
                n += 1
            while part._plan is not None:  # the trace being written
                time.sleep(0.01)
                part.poll()
    return statistics.median(outside) * 1e3, statistics.median(inside) * 1e3, starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--boundary-only", action="store_true")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=5, help="steps per capture")
    parser.add_argument("--rounds", type=int, default=5, help="captures")
    args = parser.parse_args()
    runs = boundary_cost(args.repeat, args.number)
    print(
        f"StepBoundary.end: median {statistics.median(runs):.2f} us, min {min(runs):.2f} us "
        f"({args.repeat} x {args.number} calls)"
    )
    if args.boundary_only:
        return
    print(f"the test it gains (boundary.capture is not None): {check_cost(1_000_000):.0f} ns")
    print(f"an idle look for a request (once a second): {poll_cost(2000):.1f} us")
    plain, recorded, starts = recording_cost(args.steps, args.rounds)
    print(
        f"training step (8x512 MLP, batch 64): {plain:.2f} ms outside a capture, {recorded:.2f} ms "
        f"recorded ({recorded / plain:.2f}x)"
    )
    print(
        "the step's ends that start the profiler, then its recording: "
        + ", ".join(f"{a:.1f} + {b:.1f}" for a, b in zip(starts[::2], starts[1::2]))
        + " ms (capture by capture; the first initialises torch's profiler)"
    )


if __name__ == "__main__":
    main()
