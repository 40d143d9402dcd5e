"""One process of ``ddpmon preflight``, started by torchrun on every node (as the job's ranks
would be): ``python -m ddpmon.preflight.node``. The one module of preflight that imports
torch: a job of its own, sharing nothing with a training process.

Node leaders (``LOCAL_RANK`` 0) check their node, measure their clock against node 0's
through the store (``ddpmon/clocks.py``), then the links: pairs of leaders in rounds where each node is
in one pair (``verdict.rounds``), a ping-pong of small messages (latency) and of
``--message-bytes`` (bandwidth) with the job's backend. Every rank then joins an all-reduce
(bus bandwidth). Rank 0 judges (``verdict.judge``) and hands the report to every leader
through the store, so every node's ``ddpmon preflight`` exits with the same status.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import clocks
from .checks import check_node, watch_xids
from .verdict import Link, judge, rounds

CLOCK_WARN_SECONDS = 1.0
LATENCY_PINGS = 10
BANDWIDTH_REPS = 3
"""Transfers of ``--message-bytes`` each way per pair at least; the fastest counts."""
BANDWIDTH_SECONDS = 0.2
BANDWIDTH_MAX_REPS = 30
"""More transfers while they fit in ``BANDWIDTH_SECONDS``: on a fast link, one of many is
spared by the scheduler of a busy host (a slow link takes its three in 1 s or more)."""
ALLREDUCE_REPS = 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    mark = time.monotonic()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    node, nodes = (
        int(os.environ.get("GROUP_RANK", "0")),
        int(os.environ.get("GROUP_WORLD_SIZE", "1")),
    )
    host = socket.gethostname()
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    timeout = timedelta(seconds=args.timeout)
    base, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"ddpmon-preflight/{restart}/", base)
    store.set_timeout(timeout)
    dist.init_process_group(
        backend, store=dist.PrefixStore("pg/", store), rank=rank, world_size=world, timeout=timeout
    )
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        phases[name] = round(now - mark, 4)
        mark = now

    try:
        leader = local == 0
        phase("rendezvous")  # torchrun's store, the process group
        if leader:
            xids, stop_xids = watch_xids(host)
            check = check_node(host, node, args.checkpoint_dir, args.min_free_disk)
            phase("checks")
            store.set(f"leader/{node}", json.dumps({"rank": rank, "host": host}))
            check.clock_offset_seconds = _clock(store, node, nodes, args.timeout)
            if (
                check.clock_offset_seconds is not None
                and abs(check.clock_offset_seconds) > CLOCK_WARN_SECONDS
            ):
                check.warnings.append(
                    f"clock {check.clock_offset_seconds:+.2f} s from node 0's: times written "
                    "on different hosts disagree; run chrony or ntpd on every node"
                )
            phase("clocks")
            leaders = {n: json.loads(store.get(f"leader/{n}")) for n in range(nodes)}
            for pairs in rounds(nodes):
                for a, b in pairs:
                    if node in (a, b):
                        partner = leaders[b if node == a else a]["rank"]
                        measured = _link(partner, node == a, args.message_bytes, device)
                        if node == a:
                            store.set(f"link/{a}/{b}", json.dumps(measured))
            phase("links")
            stop_xids()
            check.problems.extend(xids)
            store.set(f"check/{node}", json.dumps(check.to_json()))
        allreduce = _allreduce(args.message_bytes, device, world)
        phase("allreduce")
        if rank == 0:
            report = _report(store, nodes, world, backend, args, allreduce)
            report["phases_seconds"] = phases
            store.set("report", json.dumps(report))
        if leader:
            report_text = store.get("report").decode()
            if args.result:
                tmp = f"{args.result}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    f.write(report_text)
                os.replace(tmp, args.result)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _clock(store: Any, node: int, nodes: int, timeout: float) -> float | None:
    """This node's clock minus node 0's (``clocks``: node 0 answers, the others ask)."""
    clock_store = dist.PrefixStore("clock/", store)
    deadline = time.monotonic() + timeout
    if node == 0:
        clocks.serve(clock_store, nodes - 1, deadline)
        return 0.0
    measured = clocks.measure(clock_store, node, deadline)
    return measured.offset_seconds if measured is not None else None


def _link(partner: int, first: bool, size: int, device: torch.device) -> dict[str, float]:
    """Ping-pong with ``partner``: the fastest round trip of small messages halved (latency),
    and twice ``size`` over the fastest round trip of ``size`` bytes (bandwidth, both ways):
    a busy host's scheduler only ever adds time, so the fastest is the link's own."""
    small = torch.zeros(1, device=device)
    big = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)

    def trip(tensor: torch.Tensor) -> float:
        started = time.perf_counter()
        if first:
            dist.send(tensor, partner)
            dist.recv(tensor, partner)
        else:
            dist.recv(tensor, partner)
            dist.send(tensor, partner)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    trip(small)  # the pair's first message waits for the partner (and sets up NCCL's)
    pings = [trip(small) for _ in range(LATENCY_PINGS)]
    times: list[float] = []
    more = torch.zeros(1, device=device)
    until = time.perf_counter() + BANDWIDTH_SECONDS
    while True:  # the first decides, and tells the other, whether another transfer follows
        if first:
            go = len(times) < BANDWIDTH_REPS or (
                len(times) < BANDWIDTH_MAX_REPS and time.perf_counter() < until
            )
            more.fill_(1.0 if go else 0.0)
            dist.send(more, partner)
        else:
            dist.recv(more, partner)
            go = bool(more.item())
        if not go:
            break
        times.append(trip(big))
    return {
        "latency_seconds": min(pings) / 2,
        "bandwidth_bytes_per_second": 2 * big.numel() * 4 / min(times),
    }


def _allreduce(size: int, device: torch.device, world: int) -> dict[str, Any] | None:
    """Every rank's all-reduce of ``size`` bytes: the fastest of a few, as bus bandwidth
    (NCCL tests' busbw: the algorithm bandwidth times 2 (n - 1) / n)."""
    if world < 2:
        return None
    buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
    times = []
    for _ in range(ALLREDUCE_REPS + 1):  # the first sets up (NCCL's buffers)
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    best = min(times[1:])
    nbytes = buf.numel() * 4
    return {
        "bytes": nbytes,
        "ranks": world,
        "seconds": best,
        "bus_bandwidth_bytes_per_second": nbytes / best * 2 * (world - 1) / world,
    }


def _report(
    store: Any,
    nodes: int,
    world: int,
    backend: str,
    args: argparse.Namespace,
    allreduce: dict[str, Any] | None,
) -> dict[str, Any]:
    checks = [json.loads(store.get(f"check/{n}")) for n in range(nodes)]
    names = [c["host"] for c in checks]
    hosts = {
        c["node"]: c["host"] if names.count(c["host"]) == 1 else f"{c['host']}#{c['node']}"
        for c in checks
    }
    links = [
        Link(a, b, **json.loads(store.get(f"link/{a}/{b}")))
        for pairs in rounds(nodes)
        for a, b in pairs
    ]
    links.sort(key=lambda link: (link.a, link.b))
    verdict = judge(links, hosts, {c["node"]: c["problems"] for c in checks}, args.min_bandwidth)
    return {
        "healthy": verdict.healthy,
        "slow_hosts": verdict.slow_hosts,
        "bad_hosts": verdict.bad_hosts,
        "slow_links": [list(p) for p in verdict.slow_links],
        "reasons": verdict.reasons,
        "links": [
            {
                "hosts": [hosts[link.a], hosts[link.b]],
                "nodes": [link.a, link.b],
                "bandwidth_bytes_per_second": link.bandwidth_bytes_per_second,
                "latency_seconds": link.latency_seconds,
                "slow": link.slow,
            }
            for link in links
        ],
        "allreduce": allreduce,
        "checks": {hosts[c["node"]]: {**c, "host": hosts[c["node"]]} for c in checks},
        "backend": backend,
        "nodes": nodes,
        "world_size": world,
        "message_bytes": args.message_bytes,
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddpmon.preflight.node")
    p.add_argument("--result", help="where this node's leader writes the report (JSON)")
    p.add_argument("--checkpoint-dir", default=".")
    p.add_argument("--min-free-disk", type=int, default=2**30)
    p.add_argument("--message-bytes", type=int, default=2**20)
    p.add_argument("--min-bandwidth", type=float, default=None)
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    p.add_argument("--timeout", type=float, default=120.0)
    return p


if __name__ == "__main__":
    sys.exit(main())
