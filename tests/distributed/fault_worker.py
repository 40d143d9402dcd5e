"""One rank of a fault-injection job: ``python -m tests.distributed.fault_worker MODE [STEPS]``.

Every mode trains the same model on the same data for the same number of steps and
returns a digest of the final weights, so the test can check that no fault reaching
ddpmon changes training. Modes:

- ``plain``: no ddpmon at all (the reference weights).
- ``attached``: ddpmon with its defaults (job name and state directory left to it).
- ``attacked``: while rank 0 trains, a client holds 1,000 half-open and 50 trickling
  connections to its metrics endpoint; rank 0 pauses rank 1 (SIGSTOP, SIGCONT) and the state directory turns
  read-only (a tmpfs remounted ro) mid-run; the thread count of rank 0 is sampled.
- ``serving``: trains, about 50 steps a second, until the test writes ``stop`` in the
  output directory: a rank of a real job for the test to attack (DDPMON_TEST_NOFILE first
  lowers the rank's file-descriptor limit, e.g. to the common default of 1,024).
- ``bench``: step times in alternating blocks, quiet and under that attack, /metrics
  scraped every second throughout (for benchmarks/slowloris.py);
  DDPMON_BENCH_SERVER=prometheus_client uses the library's thread-per-connection server
  instead of ddpmon's, for comparison; DDPMON_BENCH_DECOY=1 attacks a decoy endpoint in a
  process of its own instead of rank 0's (the attack's cost to the machine alone).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed.worker import finish

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
OUT = os.environ["DDPMON_TEST_OUT"]


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def endpoint_cpu() -> float:
    """CPU seconds the endpoint's threads (its loop and worker) have used so far."""
    total = 0
    for t in threading.enumerate():
        if t.name.startswith("ddpmon-endpoint") and t.native_id:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def attack(port: int, seconds: float) -> subprocess.Popen:
    """tests/distributed/attacker.py: 1,000 half-open connections and 50 trickling ones, at
    the lowest priority: what is measured is the endpoint's cost to the job, not the
    attacker's own CPU (on a real node it runs elsewhere)."""
    proc = subprocess.Popen(
        [
            "nice",
            "-n",
            "19",
            sys.executable,
            "-m",
            "tests.distributed.attacker",
            str(port),
            "--seconds",
            str(seconds),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    proc.opened = int(proc.stdout.readline().split()[1])  # every connection is open
    return proc


DECOY = """
import os, time
from ddpmon.httpd import serve
class Nothing:
    def collect(self):
        return iter(())
parent = os.getppid()
print(serve(Nothing(), 0, "127.0.0.1").port, flush=True)
while os.getppid() == parent:  # gone with the rank that started it
    time.sleep(0.5)
"""


def decoy() -> tuple[subprocess.Popen, int]:
    """ddpmon's endpoint in a process of its own (this one's descriptor limit): attacked
    instead of the rank's, it shows what the attack costs the machine rather than the rank."""
    proc = subprocess.Popen([sys.executable, "-c", DECOY], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def stop_attack(attacker: subprocess.Popen) -> int:
    """End the attack; the connections it opened."""
    attacker.terminate()
    return json.loads(attacker.communicate()[0] or "{}").get("opened", 0)


def scraper(port: int, seconds: float) -> subprocess.Popen:
    """A client that scrapes /metrics every second (at normal priority), until SIGTERM."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.distributed.attacker",
            str(port),
            "--scrape",
            "/metrics",
            "--seconds",
            str(seconds),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    proc.stdout.readline()
    return proc


def use_unbounded_server() -> None:
    """Serve with prometheus_client's thread-per-connection server (for comparison)."""
    from prometheus_client import CollectorRegistry, start_http_server

    from ddpmon import httpd

    class Unbounded:
        def __init__(self, collector: Any, port: int, bind: str, *_: Any, **__: Any) -> None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(collector)
            self._server, _ = start_http_server(port, bind, registry=registry)
            self.port, self.bind = self._server.server_port, bind

        def close(self) -> None:
            self._server.shutdown()
            self._server.server_close()

    httpd.serve = Unbounded


def model_and_data(steps: int) -> tuple[DDP, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)
    )
    g = torch.Generator().manual_seed(RANK)
    data = [
        (torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g)) for _ in range(steps)
    ]
    return DDP(net, bucket_cap_mb=0.05), data


def digest(model: DDP) -> str:
    h = hashlib.sha256()
    for p in model.module.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def run(mode: str, steps: str = "60") -> dict[str, Any]:
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.environ["DDPMON_TEST_STORE"], WORLD),
        rank=RANK,
        world_size=WORLD,
    )
    n = int(steps)
    model, data = model_and_data(n)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out: dict[str, Any] = {"pid": os.getpid()}
    mon = None
    if mode != "plain":
        if os.environ.get("DDPMON_BENCH_SERVER") == "prometheus_client":
            use_unbounded_server()
        if mode == "attacked":
            # The program's own faulthandler (to stderr): ddpmon then keeps no .fault file
            # open in the state directory, which `mount -o remount,ro` would refuse as busy.
            import faulthandler

            faulthandler.enable()
        import ddpmon

        mon = ddpmon.attach(model)
        out.update(job=mon.job, state_file=mon.state_file, port=mon.port)
    with open(os.path.join(OUT, f"pid-{RANK}"), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()

    events = {5: [], n // 3: [], n // 2: []}
    attacker = None
    if mode == "attacked" and RANK == 0:
        events[5].append(lambda: out.update(threads_before=threads()))
        events[5].append(lambda: out.update(attacker=attack(mon.port, 60)))
        with open(os.path.join(OUT, "pid-1")) as f:
            other = int(f.read())
        # rank 1 stops for 2 s (this rank waits in its all-reduce); a thread wakes it
        events[n // 3].append(lambda: os.kill(other, signal.SIGSTOP))
        events[n // 3].append(
            lambda: threading.Timer(2.0, os.kill, (other, signal.SIGCONT)).start()
        )
        events[n // 2].append(
            lambda: subprocess.run(
                ["mount", "-o", "remount,ro", os.environ["DDPMON_STATE_DIR"]], check=True
            )
        )
    peak, times = 0, []
    for step, (x, y) in enumerate(data):
        for action in events.get(step, []):
            action()
        started = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - started)
        if mode == "attacked" and RANK == 0:
            peak = max(peak, threads())
            time.sleep(0.02)
    if mode == "attacked" and RANK == 0:
        attacker = out.pop("attacker")
        out["attack_opened"] = attacker.opened
        attacker.kill()
        attacker.wait()
        out["threads_peak"] = peak
    if mon is not None:
        mon.detach()
    out.update(digest=digest(model), step_times=times)
    return out


def serving(limit: str = "120") -> dict[str, Any]:
    """Train until OUT/stop exists (at most ``limit`` seconds); every rank stops at the same step."""
    nofile = os.environ.get("DDPMON_TEST_NOFILE")
    if nofile:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (int(nofile), resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.environ["DDPMON_TEST_STORE"], WORLD),
        rank=RANK,
        world_size=WORLD,
    )
    model, data = model_and_data(50)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    import ddpmon

    mon = ddpmon.attach(model)
    deadline = time.monotonic() + float(limit)
    stop, steps = torch.zeros(1), 0
    while True:
        stop[0] = float(os.path.exists(os.path.join(OUT, "stop")) or time.monotonic() > deadline)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
        x, y = data[steps % len(data)]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        steps += 1
        time.sleep(0.02)
    port = mon.port
    mon.detach()
    return {"steps": steps, "port": port}


def bench(pairs: str = "8", block: str = "2500") -> dict[str, Any]:
    """Rank 0's step times in blocks that alternate quiet and under a slowloris, in ABBA
    order so that drift of a shared machine cancels: a list of (quiet, attacked) block pairs."""
    nofile = os.environ.get("DDPMON_TEST_NOFILE")
    if nofile:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (int(nofile), resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.environ["DDPMON_TEST_STORE"], WORLD),
        rank=RANK,
        world_size=WORLD,
    )
    n_pairs, n = int(pairs), int(block)
    order = [
        ("quiet", "slowloris") if i % 2 == 0 else ("slowloris", "quiet") for i in range(n_pairs)
    ]
    model, data = model_and_data(64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if os.environ.get("DDPMON_BENCH_SERVER") == "prometheus_client":
        use_unbounded_server()
    import ddpmon

    mon = ddpmon.attach(model, state_dir="")
    out: dict[str, Any] = {
        "pairs": [],
        "threads_peak": {"quiet": 0, "slowloris": 0},
        "attack_opened": 0,
        "endpoint_cpu": {"quiet": [0.0, 0.0], "slowloris": [0.0, 0.0]},
    }  # CPU s, wall s
    client = scraper(mon.port, 3600) if RANK == 0 else None
    elsewhere, target = (
        decoy() if RANK == 0 and os.environ.get("DDPMON_BENCH_DECOY") else (None, mon.port)
    )
    attacker = None
    step = 0
    for pair in order:
        times: dict[str, list[float]] = {}
        for phase in pair:
            dist.barrier()
            if RANK == 0:
                if phase == "slowloris":
                    if attacker is None:  # (ABBA: two attacked blocks in a row share one)
                        attacker = attack(target, 3600)
                elif attacker is not None:
                    out["attack_opened"] = max(out["attack_opened"], stop_attack(attacker))
                    attacker = None
                    time.sleep(3.0)  # the server closes what the attacker held (a 2 s deadline)
            dist.barrier()
            times[phase] = []
            cpu, wall = endpoint_cpu(), time.monotonic()
            for i in range(n):
                x, y = data[step % len(data)]
                step += 1
                started = time.perf_counter()
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if i >= 5:  # past the switch
                    times[phase].append(time.perf_counter() - started)
                out["threads_peak"][phase] = max(out["threads_peak"][phase], threads())
            out["endpoint_cpu"][phase][0] += endpoint_cpu() - cpu
            out["endpoint_cpu"][phase][1] += time.monotonic() - wall
        out["pairs"].append((times["quiet"], times["slowloris"]))
    if attacker is not None:
        out["attack_opened"] = max(out["attack_opened"], stop_attack(attacker))
    if elsewhere is not None:
        elsewhere.kill()
        elsewhere.wait()
    if client is not None:
        client.terminate()
        out["scrapes"] = json.loads(client.communicate()[0])
    mon.detach()
    return out


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    finish(
        bench(*args)
        if mode == "bench"
        else serving(*args)
        if mode == "serving"
        else run(mode, *args)
    )


if __name__ == "__main__":
    main()
