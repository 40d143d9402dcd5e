"""ddpmon and TraceML side by side: the same DDP job plain, under ddpmon and under TraceML.

TraceML (``pip install traceml-ai``; https://github.com/traceopt-ai/traceml) times the parts
of a step too. It patches the process as a whole (its ``init(mode="auto")`` instruments
modules, DataLoaders and optimizers for every model), so the two cannot share a process the
way ``overhead.py`` compares two models: each variant here is a job of its own, the same
script under one launcher each, in rounds whose order rotates so that drift cancels:

- ``plain``: torchrun, no tool; ``plain-again`` the same once more (A/A: what two processes
  of one job differ by here, the figures' resolution);
- ``ddpmon``: torchrun, ``ddpmon.attach(model)`` with the defaults, its endpoint scraped
  every second (as Prometheus would);
- ``traceml``: ``traceml run --nproc-per-node N``, the script with TraceML's documented
  plain-PyTorch instrumentation (``traceml.init(mode="auto")``, each step in
  ``traceml.trace_step(model)``).

The job is overhead.py's MLP, batches from a DataLoader of in-memory tensors (both tools
time the wait for data); each rank times its steps with ``perf_counter``, and rank 0 reports
the median of the steps after ``--warmup``. Each variant's ratio is against ``plain`` of the
same round; printed per round and as the median over rounds, with what each tool said of
the job at its end.

    pip install traceml-ai          # into the environment that runs ddpmon
    python benchmarks/vs_traceml.py                 # 2 ranks, CPU, gloo, 5 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

VARIANTS = ("plain", "ddpmon", "traceml", "plain-again")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job(args: argparse.Namespace) -> None:
    """One rank of the job, as the variant in DDPMON_BENCH_VARIANT instruments it."""
    variant = os.environ["DDPMON_BENCH_VARIANT"]
    if variant == "traceml":
        import traceml_ai as traceml

        traceml.init(mode="auto")
    import torch
    import torch.distributed as dist
    from overhead import build_model, scraped
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(build_model(args))
    url = None
    if variant == "ddpmon":
        import ddpmon

        url = ddpmon.attach(model, job="vs-traceml", port=0).metrics_url
    stop = scraped(url)
    data = torch.utils.data.TensorDataset(
        torch.randn(args.batch * 16, args.width), torch.randint(0, 10, (args.batch * 16,))
    )
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def epochs() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from loader

    batches = epochs()
    times: list[float] = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()  # (the wait for the batch is part of the step)
        x, y = next(batches)
        if variant == "traceml":
            with traceml.trace_step(model):
                step(x, y)
        else:
            step(x, y)
        times.append(time.perf_counter() - start)
    stop.set()
    if dist.get_rank() == 0:
        measured = times[args.warmup :]
        print("RESULT " + json.dumps({"step_ms": statistics.median(measured) * 1000}), flush=True)
    dist.destroy_process_group()


def launch(variant: str, args: argparse.Namespace, workdir: str) -> tuple[float, str]:
    """Run the job under ``variant``'s launcher: rank 0's median step (ms), and the tool's
    own words on the job (its verdict or run summary)."""
    argv = [
        os.path.abspath(__file__),
        "--job",
        *("--ranks", str(args.ranks), "--steps", str(args.steps), "--warmup", str(args.warmup)),
        *("--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)),
    ]
    port = str(free_port())
    if variant == "traceml":
        cli = "import sys; from traceml_ai.launcher.cli import main; sys.exit(main())"
        cmd = [sys.executable, "-c", cli, "run", f"--nproc-per-node={args.ranks}"]
        cmd += ["--master-port", port, "--aggregator-port", str(free_port())]
        cmd += ["--logs-dir", tempfile.mkdtemp(dir=workdir), argv[0], "--args", *argv[1:]]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ranks}"]
        cmd += ["--master-addr=127.0.0.1", f"--master-port={port}", *argv]
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(
        os.environ,
        DDPMON_BENCH_VARIANT=variant,
        DDPMON_STATE_DIR=tempfile.mkdtemp(dir=workdir),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        PYTHONPATH=os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p),
    )
    run = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
    )
    out = run.stdout
    found = re.search(r"^RESULT (\{.*\})$", out, re.M)
    if run.returncode or not found:
        sys.exit(f"{variant}: the job failed (exit {run.returncode}):\n{out[-3000:]}")
    said = ""
    if variant == "traceml":
        said = " ".join(m.strip(" |") for m in re.findall(r"^\|\s+(?:Verdict|Why): .*$", out, re.M))
    elif variant == "ddpmon":
        summary = re.search(r"ddpmon: run summary of job \S+ (.*)$", out, re.M)
        said = summary.group(1).strip() if summary else ""
    return json.loads(found.group(1))["step_ms"], re.sub(r"\s+", " ", said)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="rounds of every variant")
    p.add_argument("--steps", type=int, default=400, help="steps measured per job")
    p.add_argument(
        "--warmup", type=int, default=600, help="steps before (the advice's checks thin out)"
    )
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(model="mlp")  # (overhead.py's build_model)
    args = p.parse_args()
    if args.job:
        job(args)
        return 0
    variants = args.variants.split(",")
    if "plain" not in variants:
        p.error("--variants must include plain: the ratios are against it")
    if "traceml" in variants:
        try:
            import traceml_ai
        except ImportError:
            p.error("TraceML is not installed here: pip install traceml-ai")
        print(f"TraceML {traceml_ai.__version__}", flush=True)
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    said: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="ddpmon-vs-traceml-") as workdir:
        for r in range(args.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            load = os.getloadavg()[0]
            step_ms = {}
            for variant in order:
                step_ms[variant], words = launch(variant, args, workdir)
                said[variant] = words or said.get(variant, "")
            for v in variants:
                ratios[v].append(step_ms[v] / step_ms["plain"])
            print(
                f"round {r + 1} (load {load:.1f}): "
                + ", ".join(f"{v} {step_ms[v]:.2f} ms ({ratios[v][-1]:.3f})" for v in order),
                flush=True,
            )
    print(
        f"{args.ranks} ranks, gloo, CPU, MLP {args.depth}x{args.width}, batch {args.batch}; "
        f"median step of {args.steps} after {args.warmup}; ratio against plain, same round:"
    )
    for v in variants:
        values = ", ".join(f"{x:.3f}" for x in ratios[v])
        print(f"  {v:<12} median {statistics.median(ratios[v]):.3f}  ({values})")
    for v in ("ddpmon", "traceml"):
        if said.get(v):
            print(f"{v} said: {said[v]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
