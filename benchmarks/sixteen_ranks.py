"""A real 16-rank gloo job on this machine with every feature on: per-bucket timing (the
comm hook), the watchdog, each rank's endpoint (scraped, every rank), the state files and
the history, advice, memory, a capture request, ``ddpmon set``, the node daemon; then
``doctor``, ``report`` and ``top`` over it. It checks that the healthy run has no finding,
that every rank's metrics are served, and prints the files' sizes and the time per step
without ddpmon and with it (the same job run twice, one after the other: on a shared
2-core machine running 16 ranks that ratio is the machine's load as much as ddpmon's
cost; benchmarks/overhead.py measures the cost). Exit 1 when a check fails.

    python benchmarks/sixteen_ranks.py [--ranks 16] [--steps 60]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(steps: int, attached: bool, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(6)]),
        bucket_cap_mb=0.25,
    )
    monitor = None
    if attached:
        import ddpmon

        monitor = ddpmon.attach(model, job="sixteen", bucket_timing="hook", hang_timeout=120.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        x = torch.randn(32, 256, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - start)
        time.sleep(0.1)  # time for the readers to act while it runs
    with open(os.path.join(out, f"times-{rank}.json"), "w") as f:
        json.dump(times, f)
    dist.barrier()
    if monitor is not None:
        monitor.detach()
    dist.destroy_process_group()


def ddpmon_cmd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def launch(ranks: int, steps: int, attached: bool, state_dir: str, out: str) -> subprocess.Popen:
    env = dict(os.environ, DDPMON_STATE_DIR=state_dir, DDPMON_PORT="0", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            os.path.abspath(__file__),
            "--rank-worker",
            "--steps",
            str(steps),
            "--out",
            out,
            *(["--attached"] if attached else []),
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def median_step(out: str) -> float:
    per_rank = []
    for path in glob.glob(os.path.join(out, "times-*.json")):
        with open(path) as f:
            per_rank.append(statistics.median(json.load(f)[5:]))
    return statistics.median(per_rank)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--attached", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_worker:
        worker(args.steps, args.attached, args.out)
        return
    root = tempfile.mkdtemp(prefix="ddpmon-sixteen-")
    plain_out, attached_out = os.path.join(root, "plain"), os.path.join(root, "attached")
    state_dir = os.path.join(root, "state")
    for d in (plain_out, attached_out, state_dir):
        os.makedirs(d)
    started = time.monotonic()
    job = launch(args.ranks, args.steps, False, state_dir, plain_out)
    _, err = job.communicate(timeout=900)
    assert job.returncode == 0, err[-3000:]
    print(f"plain job: {time.monotonic() - started:.0f} s", flush=True)

    daemon = subprocess.Popen(
        [sys.executable, "-m", "ddpmon", "daemon", "--port", "0", "--bind", "127.0.0.1"]
        + ["--state-dir", state_dir, "--serve-state", "--no-gpu", "--node-local"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    started = time.monotonic()
    job = launch(args.ranks, args.steps, True, state_dir, attached_out)
    seen: dict[int, dict] = {}
    while time.monotonic() - started < 600 and job.poll() is None:
        seen = {}
        for path in glob.glob(os.path.join(state_dir, "rank-*.json")):
            try:
                with open(path) as f:
                    s = json.load(f)
                seen[s["rank"]] = s
            except (OSError, ValueError):
                pass
        if len(seen) == args.ranks and min(s.get("step") or 0 for s in seen.values()) >= 10:
            break
        time.sleep(0.5)
    served = 0
    for s in seen.values():
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{s['port']}/metrics", timeout=5).read()
            served += b"ddpmon_steps_total" in body
        except OSError as exc:
            print(f"rank {s['rank']}: its metrics cannot be scraped: {exc}")
    print(f"metrics served by {served} of {args.ranks} ranks", flush=True)
    problems = args.ranks - served
    for cmd in (
        ("set", state_dir, "hang_timeout=90"),
        ("capture", state_dir, "--rank", "3", "--steps", "2", "-o", os.path.join(root, "c.json")),
        ("doctor", state_dir, "--json"),
        ("top", "--once", state_dir),
    ):
        done = ddpmon_cmd(*cmd)
        print(f"ddpmon {cmd[0]}: exit {done.returncode}", flush=True)
        if cmd[0] == "doctor":
            report = json.loads(done.stdout)
            found = [f"{f['kind']} ({f['severity']})" for f in report["findings"]]
            print(f"  verdict {report['verdict']}, findings {found}, {len(report['ranks'])} ranks")
            problems += report["verdict"] != "healthy"
        elif done.returncode:
            print("  " + (done.stderr or done.stdout)[-600:])
            problems += 1
    _, err = job.communicate(timeout=900)
    print(f"attached job: {time.monotonic() - started:.0f} s, exit {job.returncode}", flush=True)
    done = ddpmon_cmd("report", state_dir, "-o", os.path.join(root, "report.html"))
    print(f"ddpmon report: exit {done.returncode} {done.stderr[-300:]}")
    problems += done.returncode != 0 or job.returncode != 0
    daemon.terminate()
    daemon.wait(10)
    sizes = {
        kind: sum(os.path.getsize(p) for p in glob.glob(os.path.join(state_dir, pattern)))
        for kind, pattern in (("state", "rank-*.json"), ("history", "rank-*.history.sqlite*"))
    }
    print(
        f"files: state {sizes['state'] / 1024:.0f} KiB, history {sizes['history'] / 1024:.0f} KiB"
    )
    plain, attached = median_step(plain_out), median_step(attached_out)
    print(
        f"median step: plain {plain * 1e3:.1f} ms, attached {attached * 1e3:.1f} ms "
        f"(ratio {attached / plain:.3f}; the two jobs ran one after the other)"
    )
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
