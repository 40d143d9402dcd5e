"""A slowloris against one endpoint on 127.0.0.1, for the fault suite and the benchmark:
``python -m tests.distributed.attacker PORT [--half-open N] [--trickle M] [--seconds S]
[--grace G] [--scrape PATH]``.

N connections send the start of a request that never ends and hold; M more send one byte
of an endless header every second; every connection the server closes is reopened, for S
seconds. Then it stops sending and opening, keeps what it holds, and waits up to G seconds
for the server to close all of it. It prints ``open N`` once the first connections are
made, and at the end one JSON line: connections opened, held when it stopped, still open
after the wait, and how long the server took to close the last one. With ``--scrape`` (and
no attack: ``--half-open 0 --trickle 0``) it is a client that GETs PATH every second on a
new connection instead, and reports the scrapes' count, failures and slowest time.
Loopback only.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import signal
import socket
import threading
import time

HEAD = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # a request that never ends
TRICKLE = HEAD + b"X-Trickle: "  # ... then one "a" a second, forever


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(
            resource.RLIMIT_NOFILE,
            (needed if hard == resource.RLIM_INFINITY else min(needed, hard), hard),
        )


def stopper() -> threading.Event:
    """Set by SIGTERM, or once the process that started this one is gone: the caller ends
    early and still reports."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    parent = os.getppid()

    def orphaned() -> None:
        while not stop.wait(0.5):
            if os.getppid() != parent:
                stop.set()

    threading.Thread(target=orphaned, daemon=True).start()
    return stop


class Conn:
    """One attacking connection; ``sent`` counts the bytes of its request sent so far."""

    def __init__(self, port: int, trickle: bool) -> None:
        self.trickle = trickle
        self.sent = 0
        self.sock: socket.socket | None = socket.socket()
        self.sock.setblocking(False)
        if self.sock.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
            self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def open(self) -> bool:
        """False once the server closed it (or it never connected)."""
        if self.sock is None:
            return False
        try:
            return self.sock.recv(4096) != b""  # (a server may answer before it closes)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as exc:
            return exc.errno == errno.ENOTCONN  # still connecting

    def send(self, n: int) -> None:
        """Send the next ``n`` bytes of its request (if connected)."""
        if self.sock is None:
            return
        request = TRICKLE if self.trickle else HEAD
        data = request[self.sent : self.sent + n] or (b"a" * n if self.trickle else b"")
        if not data:
            return
        try:
            self.sent += self.sock.send(data)
        except OSError:  # still connecting, or closed: found at the next sweep
            pass


def attack(
    port: int, half_open: int, trickle: int, seconds: float, grace: float
) -> dict[str, float]:
    """Until ``seconds`` pass (then the wait) or SIGTERM comes (no wait)."""
    stop = stopper()
    raise_fd_limit(half_open + trickle + 64)
    conns = [Conn(port, False) for _ in range(half_open)] + [
        Conn(port, True) for _ in range(trickle)
    ]
    opened = len(conns)
    print("open", sum(c.sock is not None for c in conns), flush=True)
    started = time.monotonic()
    next_byte = started
    while time.monotonic() < started + seconds and not stop.is_set():
        tick = time.monotonic() >= next_byte
        if tick:
            next_byte += 1.0
        for i, c in enumerate(conns):
            if not c.open():  # the server closed it: a slowloris comes back at once
                c.close()
                c = conns[i] = Conn(port, c.trickle)
                opened += 1
            if c.trickle:
                if tick:
                    c.send(1)
            elif c.sent < len(HEAD):
                c.send(len(HEAD))
        time.sleep(0.2)
    stopped = time.monotonic()
    held = sum(c.open() for c in conns)
    still = held
    while still and time.monotonic() < stopped + grace and not stop.is_set():
        time.sleep(0.05)
        still = sum(c.open() for c in conns)
    report = {
        "opened": opened,
        "held_at_stop": held,
        "still_open": still,
        "closed_all_after_seconds": round(time.monotonic() - stopped, 2),
    }
    for c in conns:
        c.close()
    return report


def scrape(port: int, path: str, seconds: float) -> dict[str, float]:
    """Until ``seconds`` pass or SIGTERM comes."""
    stop = stopper()
    times, failed = [], 0
    end = time.monotonic() + seconds
    while time.monotonic() < end and not stop.is_set():
        started = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(
                    f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
                )
                answer = b""
                while chunk := s.recv(65536):
                    answer += chunk
            failed += answer[:12] not in (b"HTTP/1.1 200", b"HTTP/1.0 200")
        except OSError:
            failed += 1
        times.append(time.monotonic() - started)
        stop.wait(max(0.0, 1.0 - times[-1]))
    return {
        "scrapes": len(times),
        "failed": failed,
        "slowest_seconds": round(max(times, default=0.0), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("port", type=int)
    p.add_argument("--half-open", type=int, default=1000)
    p.add_argument("--trickle", type=int, default=50)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--grace", type=float, default=4.0)
    p.add_argument("--scrape", metavar="PATH")
    args = p.parse_args()
    if args.scrape:
        print("open 0", flush=True)
        print(json.dumps(scrape(args.port, args.scrape, args.seconds)), flush=True)
        return
    print(
        json.dumps(attack(args.port, args.half_open, args.trickle, args.seconds, args.grace)),
        flush=True,
    )


if __name__ == "__main__":
    main()
