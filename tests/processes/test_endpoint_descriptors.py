"""The endpoint's event loop as a whole process sees it: out of file descriptors, it waits
instead of spinning, and serves again once descriptors are free."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def silent(port: int, head: bytes = b"") -> socket.socket:
    """A connection that sends ``head`` (nothing, or a request that never ends) and waits."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if head:
        s.sendall(head)
    return s


OUT_OF_DESCRIPTORS = r"""
import os, resource, sys, time
from prometheus_client.core import GaugeMetricFamily
from ddpmon import httpd
class One:
    def collect(self):
        g = GaugeMetricFamily("ddpmon_rank_info", "help"); g.add_metric([], 1.0); yield g
endpoint = httpd.serve(One(), 0, "127.0.0.1")
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
spent = []
try:
    while True:
        spent.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
print(endpoint.port, flush=True)
sys.stdin.readline()  # "free"
for fd in spent:
    os.close(fd)
sys.stdin.readline()
"""


def test_out_of_file_descriptors_the_loop_waits_instead_of_spinning() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", OUT_OF_DESCRIPTORS],
        cwd=ROOT,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        port = int(proc.stdout.readline())
        waiting = silent(
            port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        )  # in the listen queue: no fd to accept it
        cpu = psutil.Process(proc.pid)
        before = sum(cpu.cpu_times()[:2])
        time.sleep(1.5)
        spent = sum(cpu.cpu_times()[:2]) - before
        assert spent < 0.3, f"{spent:.2f} s of CPU in 1.5 s: the loop spins on accept()"
        proc.stdin.write("free\n")
        proc.stdin.flush()
        waiting.settimeout(5)
        assert waiting.recv(4096).startswith(b"HTTP/1.1 200"), "served once descriptors are free"
        waiting.close()
    finally:
        proc.kill()
        proc.wait()
