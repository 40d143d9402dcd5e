"""One rank of a fault-injection job: ``python -m tests.distributed.fault_worker MODE [STEPS]``.

Every mode trains the same model on the same data for the same number of steps and
returns a digest of the final weights, so the test can check that no fault reaching
ddpmon changes training. Modes:

- ``plain``: no ddpmon at all (the reference weights).
- ``attached``: ddpmon with its defaults (job name and state directory left to it).
- ``attacked``: while rank 0 trains, a client holds 250 half-open connections to its
  metrics endpoint; rank 0 pauses rank 1 (SIGSTOP, SIGCONT) and the state directory turns
  read-only (a tmpfs remounted ro) mid-run; the thread count of rank 0 is sampled.
- ``bench``: step times in alternating blocks, quiet and under the 250 half-open
  connections (for benchmarks/slowloris.py); DDPMON_BENCH_SERVER=prometheus_client uses
  the library's unbounded server instead of ddpmon's, for comparison.
"""

from __future__ import annotations

import hashlib
import os
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

ATTACKER = r"""
import errno, socket, sys, time
port, n, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # a request that never ends
def open_one():  # non-blocking: a full listen queue must not hold the attacker up
    s = socket.socket()
    s.setblocking(False)
    if s.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
        s.close()
        return None
    return [s, False]
def poke(c):  # send the head once connected; False when the server closed it
    s, sent = c
    try:
        if not sent:
            s.send(HEAD)
            c[1] = True
        return s.recv(1, socket.MSG_PEEK) != b""
    except (BlockingIOError, InterruptedError):
        return True
    except OSError as exc:
        return exc.errno in (errno.ENOTCONN, errno.EAGAIN)  # still connecting
conns = [open_one() for _ in range(n)]
print("open", sum(c is not None for c in conns), flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:  # a slowloris: every connection the server drops is reopened
    for i, c in enumerate(conns):
        if c is None or not poke(c):
            if c is not None:
                c[0].close()
            conns[i] = open_one()
    time.sleep(0.5)
"""

def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def attack(port: int, seconds: float, n: int = 250) -> subprocess.Popen:
    # at the lowest priority: what is measured is the endpoint's cost to the job, not the
    # attacker's own CPU (on a real node it runs elsewhere)
    proc = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", ATTACKER, str(port), str(n), str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    proc.opened = int(proc.stdout.readline().split()[1])  # every connection is open
    return proc


def use_unbounded_server() -> None:
    """Serve with prometheus_client's thread-per-connection server (for comparison)."""
    from prometheus_client import CollectorRegistry, start_http_server

    from ddpmon.metrics import exposition

    class Unbounded:
        def __init__(self, collector: Any, port: int, bind: str, *_: Any, **__: Any) -> None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(collector)
            self._server, _ = start_http_server(port, bind, registry=registry)
            self.port, self.bind = self._server.server_port, bind

        def close(self) -> None:
            self._server.shutdown()
            self._server.server_close()

    exposition.serve = Unbounded


def model_and_data(steps: int) -> tuple[DDP, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    g = torch.Generator().manual_seed(RANK)
    data = [(torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g)) for _ in range(steps)]
    return DDP(net, bucket_cap_mb=0.05), data


def digest(model: DDP) -> str:
    h = hashlib.sha256()
    for p in model.module.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def run(mode: str, steps: str = "60") -> dict[str, Any]:
    dist.init_process_group("gloo", store=dist.FileStore(os.environ["DDPMON_TEST_STORE"], WORLD),
                            rank=RANK, world_size=WORLD)
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
        events[n // 3].append(lambda: threading.Timer(2.0, os.kill, (other, signal.SIGCONT)).start())
        events[n // 2].append(lambda: subprocess.run(["mount", "-o", "remount,ro", os.environ["DDPMON_STATE_DIR"]],
                                                     check=True))
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


def bench(pairs: str = "8", block: str = "60") -> dict[str, Any]:
    """Rank 0's step times in blocks that alternate quiet and under a slowloris, in ABBA
    order so that drift of a shared machine cancels: a list of (quiet, attacked) block pairs."""
    dist.init_process_group("gloo", store=dist.FileStore(os.environ["DDPMON_TEST_STORE"], WORLD),
                            rank=RANK, world_size=WORLD)
    n_pairs, n = int(pairs), int(block)
    order = [("quiet", "slowloris") if i % 2 == 0 else ("slowloris", "quiet") for i in range(n_pairs)]
    model, data = model_and_data(2 * n_pairs * n)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if os.environ.get("DDPMON_BENCH_SERVER") == "prometheus_client":
        use_unbounded_server()
    import ddpmon

    mon = ddpmon.attach(model, state_dir="")
    out: dict[str, Any] = {"pairs": [], "threads_peak": {"quiet": 0, "slowloris": 0}, "attack_opened": 0}
    batches = iter(data)
    attacker = None
    for pair in order:
        times: dict[str, list[float]] = {}
        for phase in pair:
            dist.barrier()
            if RANK == 0:
                if phase == "slowloris":
                    attacker = attack(mon.port, 600)
                    out["attack_opened"] = max(out["attack_opened"], attacker.opened)
                elif attacker is not None:
                    attacker.kill()
                    attacker.wait()
                    attacker = None
                    time.sleep(0.5)  # the server sees the connections close
            dist.barrier()
            times[phase] = []
            for i in range(n):
                x, y = next(batches)
                started = time.perf_counter()
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if i >= 5:  # past the switch
                    times[phase].append(time.perf_counter() - started)
                out["threads_peak"][phase] = max(out["threads_peak"][phase], threads())
        out["pairs"].append((times["quiet"], times["slowloris"]))
    if attacker is not None:
        attacker.kill()
        attacker.wait()
    mon.detach()
    return out


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    finish(bench(*args) if mode == "bench" else run(mode, *args))


if __name__ == "__main__":
    main()
