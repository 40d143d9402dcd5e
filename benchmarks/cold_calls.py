"""What a call costs right after the model's own work, against the same call warm.

Every hook ddpmon runs on the training thread is the first Python to run after a forward, a
backward or an optimizer step of the model, which has pushed ddpmon's code and objects out
of the CPU's caches. This times a few calls there (after 8 matmuls of 512x512 and a ReLU,
one thread) and again at once (warm), median of ``--repeats``:

- an empty Python function;
- ``Tensor.register_hook`` on a fresh output (torch's way: a removable handle, an import);
- ``torch_api.hook_tensor``, ddpmon's way for the output's backward hook (no handle);
- ``Node.register_prehook`` on the output's ``grad_fn`` (public, also with a handle).

    python benchmarks/cold_calls.py [--repeats 400]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from ddpmon.rank import torch_api


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=400)
    args = p.parse_args()
    torch.set_num_threads(1)
    weights = [torch.randn(512, 512, requires_grad=True) for _ in range(8)]
    x = torch.randn(64, 512)

    def model() -> torch.Tensor:
        h = x
        for w in weights:
            h = torch.relu(h @ w)
        return h.sum()

    def hook(_grad: torch.Tensor) -> None:
        pass

    def nothing(_out: torch.Tensor) -> None:
        pass

    calls: dict[str, Callable[[torch.Tensor], object]] = {
        "an empty function": nothing,
        "Tensor.register_hook": lambda out: out.register_hook(hook),
        "torch_api.hook_tensor": lambda out: torch_api.hook_tensor(out, hook),
        "grad_fn.register_prehook": lambda out: out.grad_fn.register_prehook(hook),  # type: ignore[union-attr]
    }
    cold: dict[str, list[int]] = defaultdict(list)
    warm: dict[str, list[int]] = defaultdict(list)
    clock = time.perf_counter_ns
    for _ in range(args.repeats):
        for name, call in calls.items():
            out = model()
            start = clock()
            call(out)
            cold[name].append(clock() - start)
            again = out * 1  # (a fresh output, just made: the call's code is warm now)
            start = clock()
            call(again)
            warm[name].append(clock() - start)
            again.backward()
    print(f"torch {torch.__version__}; median of {args.repeats}, microseconds")
    print(f"{'call':<28} {'cold':>8} {'warm':>8}")
    for name in calls:
        print(
            f"{name:<28} {statistics.median(cold[name]) / 1000:8.2f} "
            f"{statistics.median(warm[name]) / 1000:8.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
