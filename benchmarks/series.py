"""Series per rank and per job in each ``metrics_detail`` mode, counted from real scrapes.

A real 2-rank gloo job (bucket timing on, so the bucket series exist) runs once per mode;
each rank scrapes its own endpoint over HTTP after 30 steps. A node daemon then reads the
job's state files and is scraped too. Series are counted by kind: the rank's own, those
per bucket (``bucket`` not ``all``; divided by the bucket count), the daemon's per rank
and per node. The table for 8, 1,000 and 10,000 ranks multiplies these measured counts:

    per rank = own + per_bucket x buckets (full; auto above 128 buckets and summary fold
               them into bucket="all", counted in own)
    per job  = ranks x (per rank + daemon per rank + 5 Prometheus series per rank target
                        + recorded per rank)
               + nodes x (daemon per node + 5) + recorded per job (per phase, per bucket)

    python benchmarks/series.py [--buckets 30] [--ranks-per-node 8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("full", "summary")
PROMETHEUS_PER_TARGET = 5
"""up, scrape_duration_seconds, scrape_samples_scraped, scrape_samples_post_metric_relabeling,
scrape_series_added: what Prometheus adds for every target it scrapes."""


def rank_main(mode: str, store: str, out: str) -> None:
    """One rank: train 30 steps attached, scrape its own endpoint, write what it saw."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpmon

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.manual_seed(rank)  # each rank its own data (no advice series)
    model = DDP(
        nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)), nn.Linear(64, 4)),
        bucket_cap_mb=0.02,
    )
    state_dir = os.path.join(out, "state")
    monitor = ddpmon.attach(
        model,
        job="series",
        port=0,
        bind="127.0.0.1",
        state_dir=state_dir,
        bucket_timing="hook",
        metrics_detail=mode,
        hang_timeout=60,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(30):
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(8, 64)), torch.randn(8, 4)).backward()
        opt.step()
    time.sleep(2.5)  # the watchdog's first pass: its activity series
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor.port}/metrics", timeout=10) as r:
        body = r.read().decode()
    Path(out, f"scrape-{rank}.txt").write_text(body)
    deadline = time.monotonic() + 120  # alive while the parent scrapes the node daemon
    while not Path(out, "done").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    dist.barrier()
    monitor.detach()
    dist.destroy_process_group()


def series(body: str) -> list[tuple[str, dict[str, str]]]:
    """(name, labels) of every sample line of a text exposition."""
    out = []
    for line in body.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', rest.partition("}")[0])) if rest else {}
        out.append((name.split(" ")[0], labels))
    return out


def run_job(
    mode: str, workdir: Path, world: int = 2
) -> tuple[list[str], list[tuple[str, dict[str, str]]]]:
    """The job's ranks' scrapes, and its node daemon's series, scraped while it runs."""
    workdir.mkdir(parents=True)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank-of", mode, str(workdir / "store"), str(workdir)],
            env={
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(world),
            },
        )
        for r in range(world)
    ]
    scrapes = [workdir / f"scrape-{r}.txt" for r in range(world)]
    deadline = time.monotonic() + 300
    while not all(p.exists() for p in scrapes):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit(f"the {mode} job ended before its scrapes")
        time.sleep(0.5)
    daemon = daemon_series(workdir / "state")
    (workdir / "done").touch()
    for p in procs:
        if p.wait(timeout=60) != 0:
            raise SystemExit(f"a rank of the {mode} job failed ({p.returncode})")
    return [p.read_text() for p in scrapes], daemon


def daemon_series(state_dir: Path) -> list[tuple[str, dict[str, str]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpmon", "daemon", "--state-dir", str(state_dir)]
        + ["--port", str(port), "--bind", "127.0.0.1"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    found = series(r.read().decode())
                if any(n == "ddpmon_rank_up" for n, _ in found):
                    return found
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the daemon did not export its ranks")
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(10)


PHASES = 7
"""ddpmon_step_phase_seconds_total's phases (data_wait, h2d, forward, backward, exposed_comm,
optimizer, other): a ``job_phase:`` record has one series per phase."""


def recorded() -> Counter[str]:
    """The shipped recording rules by level (job, job_rank, job_phase, job_bucket): each
    adds one series per job, rank, phase or bucket; a sparse one (``catalog.Record``) none
    in a healthy job."""
    import yaml

    sys.path.insert(0, str(ROOT))
    from ddpmon.metrics.catalog import RECORDS

    sparse = {r.name for r in RECORDS if r.sparse}
    rules = yaml.safe_load((ROOT / "deploy/prometheus/ddpmon-rules.yml").read_text())
    return Counter(
        r["record"].split(":")[0]
        for g in rules["groups"]
        for r in g["rules"]
        if "record" in r and r["record"] not in sparse
    )


def main() -> None:
    if sys.argv[1:2] == ["--rank-of"]:
        rank_main(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets", type=int, default=30, help="buckets in the table's jobs")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    args = parser.parse_args()
    measured: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="ddpmon-series-") as tmp:
        for mode in MODES:
            bodies, daemon = run_job(mode, Path(tmp, mode))
            rank0 = series(bodies[0])
            buckets = {lab["bucket"] for _, lab in rank0 if lab.get("bucket", "all") != "all"}
            per_bucket = sum(1 for _, lab in rank0 if lab.get("bucket", "all") != "all")
            measured[mode] = {
                "own": len(rank0) - per_bucket,
                "per_bucket": per_bucket / len(buckets) if buckets else 0.0,
                "buckets": len(buckets),
                "ranks": [len(series(b)) for b in bodies],
            }
            if mode == "full":
                by_rank = Counter(lab.get("rank") for _, lab in daemon if lab.get("rank"))
                measured["daemon"] = {
                    "per_rank": max(by_rank.values()),
                    "per_node": len(daemon) - sum(by_rank.values()),
                }
    rec = recorded()
    print(json.dumps({**measured, "recorded": rec}))
    d = measured["daemon"]
    print(
        f"\nmeasured: full {measured['full']['own']:g} own + {measured['full']['per_bucket']:g} "
        f"per bucket ({measured['full']['buckets']} buckets); summary "
        f"{measured['summary']['own']:g} (its ranks: {measured['summary']['ranks']}); daemon "
        f"{d['per_rank']:g} per rank + {d['per_node']:g} per node; recorded {dict(rec)}\n"
    )
    print("| mode | series per rank | ranks | series per job |")
    print("|---|---|---|---|")
    for mode in MODES:
        m = measured[mode]
        buckets = args.buckets if mode == "full" else 1  # summary: bucket="all"
        per_rank = m["own"] + (m["per_bucket"] * args.buckets if mode == "full" else 0)
        for ranks in (8, 1000, 10000):
            nodes = -(-ranks // args.ranks_per_node)
            job = (
                ranks * (per_rank + d["per_rank"] + PROMETHEUS_PER_TARGET + rec["job_rank"])
                + nodes * (d["per_node"] + PROMETHEUS_PER_TARGET)
                + rec["job"]
                + PHASES * rec["job_phase"]
                + buckets * rec["job_bucket"]
            )
            print(f"| {mode} | {per_rank:,.0f} | {ranks:,} | {job:,.0f} |")


if __name__ == "__main__":
    main()
