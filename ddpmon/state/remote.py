"""What node daemons serve (``ddpmon daemon --serve-state``), read from another machine:
every daemon at once under one deadline, each answer bounded, so a dead node costs seconds
in all, not seconds each. The doctor's ``--from`` reads ``/state`` with ``fetch_all``.
Nothing here imports torch.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

Answer = tuple[list[str], bytes | BaseException, float]
"""One daemon's answer: its host's addresses, the body or what went wrong, when received."""


class Unbounded(Exception):
    """An answer that does not end, or ends too late or too large."""


def read_bounded(response: Any, limit: int, until: float) -> bytes:
    """A response body of at most ``limit`` bytes, read before ``until`` (time.monotonic)."""
    chunks, total = [], 0
    while True:
        chunk = response.read(1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise Unbounded(f"the answer is larger than {limit >> 20} MiB")
        if time.monotonic() > until:
            raise Unbounded("the answer did not end in time")


def base_url(address: str) -> str:
    """``http://HOST:PORT`` of an address given as ``HOST:PORT`` or a URL."""
    return f"http://{address}" if "://" not in address else address.rstrip("/")


def ips(url: str) -> list[str]:
    """The addresses of the URL's host (empty when its name does not resolve)."""
    parts = urllib.parse.urlsplit(url)
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 80, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError):
        return []
    return sorted({str(info[4][0]) for info in infos})


def fetch(url: str, timeout: float, until: float, limit: int) -> Answer:
    """One daemon's answer; a body still coming at ``until`` is cut short."""
    found = ips(url)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body: bytes | BaseException = read_bounded(response, limit, until)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the caller says it
        if isinstance(exc, urllib.error.HTTPError):
            exc.detail = exc.read(300).decode(errors="replace").strip()  # type: ignore[attr-defined]
        body = exc
    return found, body, time.time()


def fetch_all(urls: list[str], timeout: float, deadline: float, limit: int) -> list[Answer | None]:
    """Every URL read at once, each in a thread of its own; None for those that have not
    answered after ``deadline`` seconds (their threads end on their own timeout, unwaited)."""
    until = time.monotonic() + deadline
    answers: dict[int, Answer] = {}

    def one(i: int, url: str) -> None:  # an answer that does not end is cut short before the deadline
        answers[i] = fetch(url, timeout, until - min(0.5, deadline / 4), limit)

    threads = [threading.Thread(target=one, args=(i, url), name=f"ddpmon-from-{i}", daemon=True)
               for i, url in enumerate(urls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, until - time.monotonic()))
    got = dict(answers)
    return [got.get(i) for i in range(len(urls))]


def why(exc: BaseException, timeout: float) -> str:
    """What went wrong with a request, in a few words."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}: {getattr(exc, 'detail', '') or exc.reason}"
    reason = getattr(exc, "reason", None) or exc
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout:g} s"
    return str(reason) or type(reason).__name__
