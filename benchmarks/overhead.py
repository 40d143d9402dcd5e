"""Step-time overhead of ddpmon: the same DDP job with and without attach, in one run.

Two identical DDP models (on NCCL each on a process group of its own, so that c10d timing
reaches only one); one has ddpmon attached (its endpoint scraped every second, state file
written every second). After a warm-up (``--warmup`` steps of each), blocks of steps
alternate between them in ABBA order so drift cancels; the printed ratio is the median over
pairs of (attached block time / plain block time), with its spread. Which of the two is
built first moves the ratio too (``--attach-to``); ``--runs N`` alternates it over N runs
and prints the median of their medians.

    python benchmarks/overhead.py                  # 2 ranks, CPU, gloo (spawns torchrun)
    python benchmarks/overhead.py --rounds 150 --runs 6   # the figure docs/performance.md gives
    python benchmarks/overhead.py --ranks 2 --device cuda --backend gloo   # on one GPU
    python benchmarks/overhead.py --ranks 1 --device cuda --backend nccl --model transformer \
        --width 1024 --depth 24 --dtype bfloat16      # a 0.34B-parameter transformer in bf16
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def build_model(args: argparse.Namespace):
    """The MLP (``depth`` layers ``width`` wide, 10 classes), or a pre-norm transformer
    language model (``depth`` blocks of ``width``, 16 heads, a ``vocab``-token head)."""
    import torch
    from torch import nn

    if args.model == "mlp":
        layers = []
        for _ in range(args.depth):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(args.width, 10))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.width)
            block = nn.TransformerEncoderLayer(
                args.width,
                16,
                4 * args.width,
                dropout=0.0,
                batch_first=True,
                norm_first=True,
                activation="gelu",
            )
            self.blocks = nn.TransformerEncoder(block, args.depth, enable_nested_tensor=False)
            self.head = nn.Linear(args.width, args.vocab)
            self.register_buffer(
                "causal", nn.Transformer.generate_square_subsequent_mask(args.seq), persistent=False
            )

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.blocks(
                self.embed(tokens), mask=self.causal.to(self.embed.weight.dtype), is_causal=True
            )
            return self.head(h).flatten(0, 1)

    return LM()


def median_interval(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median: how far the printed median may be from what
    more rounds would give on this machine."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def scraped(url: str | None, every: float = 1.0) -> threading.Event:
    """Scrape ``url`` every ``every`` seconds from a thread of its own, as Prometheus would,
    until the returned event is set (nothing without a URL)."""
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(every):
            try:
                urllib.request.urlopen(url, timeout=5).read()
            except OSError:
                pass

    if url and every > 0:
        threading.Thread(target=scrape, daemon=True, name="benchmark-scrape").start()
    return stop


def under_torchrun(script: str, ranks: int, argv: list[str], **env: str) -> str:
    """Run ``script --rank-worker`` with ``argv`` on ``ranks`` local ranks under torchrun
    (one intra-op thread each unless OMP_NUM_THREADS says otherwise); its output, also
    printed."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **env)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        os.path.abspath(script),
        "--rank-worker",
        *argv,
    ]
    lines = []
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as run:
        for line in run.stdout:  # type: ignore[union-attr]
            print(line, end="", flush=True)
            lines.append(line)
    if run.returncode:
        raise SystemExit(f"torchrun exited with {run.returncode}")
    return "".join(lines)


def runs(args: argparse.Namespace) -> None:
    """``--runs N``: N runs, the attached model built second and first in turn (which of two
    identical models is built first moves the ratio by about 1% here, either way), and the
    median of their medians."""
    argv = sys.argv[1:]
    for flag in ("--runs", "--attach-to"):  # (each run gets its own)
        while flag in argv:
            del argv[argv.index(flag) : argv.index(flag) + 2]
    ratios, costs = [], []
    for i in range(args.runs):
        order = ("second", "first")[i % 2]
        print(f"run {i + 1} of {args.runs}, attached to the model built {order}:", flush=True)
        out = under_torchrun(
            __file__,
            args.ranks,
            [*argv, "--attach-to", order],
            DDPMON_STATE_DIR=tempfile.mkdtemp(prefix="ddpmon-bench-"),
        )
        ratios.append(float(re.search(r"attached/plain = ([\d.]+)", out).group(1)))  # type: ignore[union-attr]
        costs.append(float(re.search(r"([-+][\d.]+) ms per step", out).group(1)))  # type: ignore[union-attr]
    print(
        f"median of {args.runs} runs: ratio {statistics.median(ratios):.4f} "
        f"({', '.join(f'{r:.3f}' for r in ratios)}), "
        f"{statistics.median(costs):+.3f} ms per step"
    )


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpmon

    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(
        f"cuda:{local % max(1, torch.cuda.device_count())}" if args.device == "cuda" else "cpu"
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    kwargs: dict = (
        {"device_ids": [device.index]} if device.type == "cuda" and args.backend == "nccl" else {}
    )
    if args.gradient_as_bucket_view:
        kwargs["gradient_as_bucket_view"] = True
    # On NCCL a process group each: c10d timing (bucket_timing=c10d) is switched on per group
    # and must not reach the plain model. On gloo both share the job's group, as a real
    # job's model does (on two new gloo groups the default measured 1.05 to 1.07, not 1.04).
    if args.backend == "nccl":
        kwargs_plain = dict(kwargs, process_group=dist.new_group())
        kwargs_watched = dict(kwargs, process_group=dist.new_group())
    else:
        kwargs_plain = kwargs_watched = kwargs
    dtype = getattr(torch, args.dtype)
    built = []
    for kw in (kwargs_plain, kwargs_watched):
        torch.manual_seed(0)
        built.append(DDP(build_model(args).to(device, dtype), **kw))
    # Which of the two identical models is the attached one: the one built second by
    # default; --attach-to first swaps them, to tell ddpmon's cost from the models' order.
    plain, watched = built if args.attach_to == "second" else built[::-1]
    params = sum(p.numel() for p in plain.parameters())
    options = dict(job="overhead", port=0, nvml=True)
    for item in args.option:  # as DDPMON_<NAME> variables: parsed and checked by ddpmon
        key, _, value = item.partition("=")
        options.pop(key, None)
        os.environ["DDPMON_" + key.upper()] = value
    if args.baseline == "python-hook":  # the plain model runs torch's own Python all-reduce hook
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            allreduce_hook,
        )

        plain.register_comm_hook(None, allreduce_hook)
    if args.hooks == "marks":  # a measurement only (hook_floor.py)
        from hook_floor import cut_to_marks

        cut_to_marks()
    monitor = ddpmon.attach(
        watched if not args.no_attach else DDP(nn.Linear(8, 8).to(device), **kwargs), **options
    )
    stop = scraped(monitor.metrics_url)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-3) for m in (plain, watched)}
    if args.model == "mlp":
        x = torch.randn(args.batch, args.width, device=device, dtype=dtype)
        y = torch.randint(0, 10, (args.batch,), device=device)
    else:
        x = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
        y = torch.randint(0, args.vocab, (args.batch * args.seq,), device=device)

    def block(model) -> float:
        opt = opts[id(model)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.block):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.block

    # Warm-up: bucket rebuild, allocator, and the steady state of the advice's sampled
    # checks (every step at first, every 50th past step 500: rank/advice/cadence.py).
    for _ in range(max(1, args.warmup // args.block)):
        block(plain), block(watched)
    ratios, plain_times = [], []
    for i in range(args.rounds):
        if i % 2 == 0:
            p, w = block(plain), block(watched)
        else:
            w, p = block(watched), block(plain)
        ratios.append(w / p)
        plain_times.append(p)
    stop.set()
    snap = monitor.snapshot()
    monitor.detach()
    if rank == 0:
        q = statistics.quantiles(ratios, n=4)
        low, high = median_interval(ratios)
        print(
            f"overhead vs {args.baseline} ({' '.join(args.option) or 'default options'}{', A/A' if args.no_attach else ''}"
            f"{', gradient_as_bucket_view' if args.gradient_as_bucket_view else ''}"
            f"{', attached to the model built first' if args.attach_to == 'first' else ''}"
            f"{', hooks cut to marks' if args.hooks == 'marks' else ''}): {args.ranks} ranks, {args.backend}, {device.type}, {args.model} {args.depth}x{args.width} "
            f"({params / 1e6:.0f}M parameters, {args.dtype}), batch {args.batch}, {len(snap['buckets'])} buckets, step {statistics.median(plain_times) * 1000:.2f} ms plain\n"
            f"median step-time ratio attached/plain = {statistics.median(ratios):.4f} "
            f"(95% interval of the median {low:.4f}..{high:.4f}; quartiles {q[0]:.4f}..{q[2]:.4f}, "
            f"min {min(ratios):.4f}, max {max(ratios):.4f}; "
            f"{args.rounds} pairs of {args.block}-step blocks); "
            f"{(statistics.median(ratios) - 1) * statistics.median(plain_times) * 1000:+.3f} ms per step",
            flush=True,
        )
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=2, help="processes (ranks) to start")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    p.add_argument("--dtype", default="float32", help="the models' parameter dtype (bfloat16, ...)")
    p.add_argument("--seq", type=int, default=512, help="transformer: tokens per sample")
    p.add_argument("--vocab", type=int, default=32000, help="transformer: vocabulary size")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--block", type=int, default=10, help="steps per block")
    p.add_argument("--rounds", type=int, default=40, help="pairs of blocks")
    p.add_argument(
        "--warmup", type=int, default=600, help="steps of each model before the measured rounds"
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an attach() option for the attached model, e.g. track_collectives=0",
    )
    p.add_argument(
        "--baseline",
        choices=("plain", "python-hook"),
        default="plain",
        help="the model compared with: DDP as is, or with torch's Python allreduce_hook",
    )
    p.add_argument(
        "--gradient-as-bucket-view",
        action="store_true",
        help="DDP(gradient_as_bucket_view=True) for both models",
    )
    p.add_argument(
        "--hooks",
        choices=("as-is", "marks"),
        default="as-is",
        help="marks: ddpmon's hooks cut to a mark each, a measurement only (hook_floor.py)",
    )
    p.add_argument(
        "--no-attach",
        action="store_true",
        help="an A/A run: ddpmon runs beside both models but times neither (the noise floor)",
    )
    p.add_argument(
        "--attach-to",
        choices=("first", "second"),
        default="second",
        help="attach to the model built first or second (an A/A run compares the two)",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="runs of the whole benchmark, alternating --attach-to, and their median",
    )
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_worker:
        worker(args)
    elif args.runs > 1:
        runs(args)
    else:
        under_torchrun(
            __file__,
            args.ranks,
            sys.argv[1:],
            DDPMON_STATE_DIR=tempfile.mkdtemp(prefix="ddpmon-bench-"),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
