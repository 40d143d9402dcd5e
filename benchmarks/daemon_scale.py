"""The doctor through N node daemons: N real daemons (``ddpmon/daemon/``'s routes and the one
HTTP server, ``httpd.serve``, as ``ddpmon daemon --serve-state`` wires them), each over a
directory of 8 synthetic state files (a node of 8 ranks), served from a few processes; a
tenth of them black-holed (a listening socket nobody accepts on: the kernel completes the
connection and no answer ever comes, as from a node whose daemon hangs); one rank stuck
outside any collective, every other waiting in the all-reduce. The real ``ddpmon doctor
--from-file FILE --json`` is timed end to end (Python start-up included), with its peak RSS
and its CPU time, and its verdict checked.

    python benchmarks/daemon_scale.py --daemons 256 1024

The servers share this machine with the doctor (on a cluster each is on its own node): each
daemon's answers are produced once, by its real routes, before the doctor starts, and then
served from memory by the real HTTP server, so the doctor's time is not the daemons' 35 ms
of CPU each times a thousand on two cores. The routes are asked as the daemon's own caller
(``reader=None``): asked from loopback without credentials, a daemon would scan this host's
socket table, thousands of sockets here, where a doctor on another host costs no scan.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.doctor_scale import rank_state  # noqa: E402
from ddpmon.daemon.node import Daemon  # noqa: E402
from ddpmon.httpd import serve  # noqa: E402
from ddpmon.state import files as statefile  # noqa: E402

RANKS_PER_NODE = 8


def write_nodes(root: str, nodes: int, stuck: int) -> list[str]:
    """One directory of 8 state files per node; rank ``stuck`` stuck, the others waiting."""
    world = nodes * RANKS_PER_NODE
    now = time.time()
    waiting = json.dumps(rank_state(0, world, now))
    culprit = json.dumps(rank_state(world // 3, world, now))
    directories = []
    for node in range(nodes):
        directory = os.path.join(root, f"node-{node}")
        os.makedirs(directory)
        for local in range(RANKS_PER_NODE):
            rank = node * RANKS_PER_NODE + local
            state = json.loads(culprit if rank == stuck else waiting)
            state.update(
                rank=rank,
                local_rank=local,
                host=f"node-{node}",
                pid=10000 + rank,
                port=9500 + local,
                now_unix=now,
                last_progress_unix=now - 120,
                started_unix=now - 3600,
            )
            state["hang"].update(detected_unix=now - 60, last_progress_unix=now - 120)
            path = statefile.path_for(directory, rank)
            statefile.write_atomic(path, state)
        directories.append(directory)
    return directories


def serve_nodes(directories: list[str], ports: Any, ready: Any) -> None:
    """Serve each directory as a node daemon does, until this process is ended: the real
    daemon's routes, each answer produced once beforehand (on a cluster each daemon has a
    node of its own to produce it; here a thousand share two cores)."""
    endpoints = []
    for directory in directories:
        daemon = Daemon(directory, gpus=False, node_local=True)
        for name in os.listdir(directory):  # as its live ranks would: written a moment ago
            os.utime(os.path.join(directory, name))
        state = daemon.routes.state_route()
        launchers = daemon.routes.launchers_route()
        endpoints.append(
            serve(
                daemon,
                0,
                "127.0.0.1",
                {
                    "/state": lambda query, reader, a=state: a,
                    "/launchers": lambda query, reader, a=launchers: a,
                    "/history": lambda query, reader, r=daemon.routes: r.history_route(query),
                },
                quick_routes={"/healthz": daemon.health_route},
            )
        )
    ports.send([e.port for e in endpoints])
    ready.wait()
    signal.pause()


def raise_descriptor_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(daemons: int, black_holed: float, processes: int, profile: str = "") -> dict[str, Any]:
    raise_descriptor_limit()
    root = tempfile.mkdtemp(prefix=f"ddpmon-daemons-{daemons}-")
    silent = round(daemons * black_holed)
    answering = daemons - silent
    stuck = (answering // 3) * RANKS_PER_NODE + 5  # on an answering node
    directories = write_nodes(root, answering, stuck)
    holes = []
    for _ in range(silent):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        holes.append(s)
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    servers, addresses = [], []
    for i in range(processes):
        mine = directories[i::processes]
        receive, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=serve_nodes, args=(mine, send, ready), daemon=True)
        p.start()
        servers.append((p, receive, len(mine)))
    for _, receive, _ in servers:
        addresses += [f"127.0.0.1:{port}" for port in receive.recv()]
    ready.set()
    addresses += [f"127.0.0.1:{s.getsockname()[1]}" for s in holes]
    listing = os.path.join(root, "daemons.txt")
    with open(listing, "w") as f:
        f.write("\n".join(addresses) + "\n")
    out = os.path.join(root, "doctor.json")
    started = time.perf_counter()
    with open(out, "w") as stdout:
        doctor = subprocess.Popen(
            [
                sys.executable,
                *(["-m", "cProfile", "-o", profile] if profile else []),
                "-m",
                "ddpmon",
                "doctor",
                "--from-file",
                listing,
                "--json",
            ],
            stdout=stdout,
            stderr=subprocess.DEVNULL,
        )
        _, status, usage = os.wait4(doctor.pid, 0)
    took = time.perf_counter() - started
    doctor.returncode = os.waitstatus_to_exitcode(status)
    for p, _, _ in servers:
        p.terminate()
        p.join(5)
    for s in holes:
        s.close()
    with open(out) as f:
        answer = json.load(f)
    shutil.rmtree(root, ignore_errors=True)
    unreachable = [
        f for f in answer["findings"] if "unreachable" in f["kind"] or "daemon" in f["kind"]
    ]
    return {
        "daemons": daemons,
        "black_holed": silent,
        "ranks": answering * RANKS_PER_NODE,
        "seconds": took,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "system_seconds": usage.ru_stime,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "exit": doctor.returncode,
        "verdict": answer["verdict"],
        "suspects": answer["suspect_ranks"],
        "stuck": stuck,
        "kinds": sorted({f["kind"] for f in answer["findings"]}),
        "unreachable_findings": len(unreachable),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--daemons", type=int, nargs="*", default=[256, 1024])
    p.add_argument("--black-holed", type=float, default=0.1, help="the share that never answers")
    p.add_argument("--processes", type=int, default=4, help="server processes")
    p.add_argument("--profile", metavar="FILE", default="", help="the doctor's cProfile stats")
    args = p.parse_args()
    for n in args.daemons:
        r = run(n, args.black_holed, args.processes, args.profile)
        right = r["verdict"] == "hang" and r["suspects"] == [r["stuck"]]
        print(
            f"{r['daemons']:>5} daemons ({r['black_holed']} black-holed), {r['ranks']} ranks: "
            f"doctor {r['seconds']:5.2f} s wall, {r['cpu_seconds']:5.2f} s CPU ({r['system_seconds']:.2f} s "
            f"in the kernel), peak RSS "
            f"{r['peak_rss_mib']:.0f} MiB; exit {r['exit']}, verdict {r['verdict']}, suspects "
            f"{r['suspects'][:8]}{'...' if len(r['suspects']) > 8 else ''} ({'right' if right else 'WRONG: stuck is ' + str(r['stuck'])}); "
            f"findings {r['kinds']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
