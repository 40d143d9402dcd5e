"""What node daemons serve (``ddpmon daemon --serve-state``), read from another machine:
every daemon at once under one deadline, each answer bounded, so a dead node costs seconds
in all, not seconds each.

``fetch_all`` is the doctor's ``--from`` (``/state``) and the report's; ``fetch_histories``
reads each rank's history page by page from ``/history`` into local copies of the rank's
own file format (``history.HistoryCopy``), which the report then reads as it reads a
directory. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..state import history
from ..webconfig import HttpConfig

Answer = tuple[list[str], bytes | BaseException, float]
"""One daemon's answer: its host's addresses, the body or what went wrong, when received."""


class Unbounded(Exception):
    """An answer that does not end, or ends too late or too large."""


def read_bounded(response: Any, limit: int, until: float) -> bytes:
    """A response body of at most ``limit`` bytes, read before ``until`` (time.monotonic)."""
    chunks: list[bytes] = []
    total = 0
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


def without_credentials(address: str) -> str:
    """``address`` with any ``user:password@`` taken out, to be shown."""
    scheme, sep, rest = address.rpartition("://")
    return scheme + sep + rest.rpartition("@")[2]


@dataclass(frozen=True)
class Server:
    """What an address names, for the wording of its problems."""

    name: str = "a node daemon"
    example: str = "node1:9490"
    config: str = "--http-config"
    """The option that gives its credentials."""
    prefix: bool = False
    """Whether it may sit under a path, on its scheme's own port (a Prometheus behind a proxy)."""


DAEMON = Server()


def address_problem(address: str, server: Server = DAEMON) -> str | None:
    """What is wrong with the address of a node daemon (``HOST:PORT``, ``http://HOST:PORT`` or
    ``https://HOST:PORT``) or another ``server``, or None. It never repeats a password given
    in the address."""
    try:
        parts = urllib.parse.urlsplit(base_url(address))
        port = parts.port
    except ValueError as exc:
        return f"{exc}" if "@" not in address else f"expected HOST:PORT of {server.name}"
    if parts.username is not None or parts.password is not None:
        return (
            "it holds credentials (user:password@): an address is printed, logged and seen in "
            f"process lists; put them in an http_config file's basic_auth ({server.config} FILE)"
        )
    if parts.scheme not in ("http", "https"):
        return f"the scheme is {parts.scheme!r}; {server.name} answers http or https"
    if not parts.hostname or (port is None and not server.prefix):
        return f"expected HOST:PORT of {server.name} (for example {server.example})"
    if (parts.path not in ("", "/") and not server.prefix) or parts.query:
        return f"expected HOST:PORT alone, without a path ({parts.path or '?' + parts.query})"
    return None


def ips(url: str) -> list[str]:
    """The addresses of the URL's host (empty when its name does not resolve)."""
    parts = urllib.parse.urlsplit(url)
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 80, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError):
        return []
    return sorted({str(info[4][0]) for info in infos})


def fetch(
    url: str,
    timeout: float,
    until: float,
    limit: int,
    client: HttpConfig,
    data: bytes | None = None,
) -> Answer:
    """One daemon's answer, asked with ``client``'s TLS and credentials (a POST of ``data``
    when given); a body still coming at ``until`` is cut short."""
    found = ips(url)
    try:
        with client.open(url, timeout, data) as response:
            body: bytes | BaseException = read_bounded(response, limit, until)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the caller says it
        if isinstance(exc, urllib.error.HTTPError):
            exc.detail = exc.read(300).decode(errors="replace").strip()  # type: ignore[attr-defined]
        body = exc
    return found, body, time.time()


def fetch_each(
    urls: Sequence[str],
    timeout: float,
    deadline: float,
    limit: int,
    client: HttpConfig,
    data: bytes | None = None,
) -> Iterator[tuple[int, Answer]]:
    """Every URL read at once (each sent ``data`` as a POST, when given), each in a thread
    of its own; each answer yielded, with its URL's index, as soon as it comes, so the
    caller reads one while the others are still on their way (and while a node that does
    not answer costs its ``timeout``). It stops once every URL has answered, or ``deadline``
    seconds have passed and no answer is waiting to be read; the threads of the others end
    on their own timeout, unwaited."""
    until = time.monotonic() + deadline
    came: queue.SimpleQueue[tuple[int, Answer]] = queue.SimpleQueue()
    cut = until - min(0.5, deadline / 4)  # an answer that does not end is cut short before

    def one(i: int, url: str) -> None:
        came.put((i, fetch(url, timeout, cut, limit, client, data)))

    for i, url in enumerate(urls):
        threading.Thread(target=one, args=(i, url), name=f"ddpmon-from-{i}", daemon=True).start()
    for _ in urls:
        try:
            yield came.get(timeout=max(0.0, until - time.monotonic()))
        except queue.Empty:
            return


def fetch_all(
    urls: Sequence[str],
    timeout: float,
    deadline: float,
    limit: int,
    client: HttpConfig,
    data: bytes | None = None,
) -> list[Answer | None]:
    """Every URL's answer (``fetch_each``), in order; None for those that have not answered
    after ``deadline`` seconds."""
    got = dict(fetch_each(urls, timeout, deadline, limit, client, data))
    return [got.get(i) for i in range(len(urls))]


def why(exc: BaseException, timeout: float) -> str:
    """What went wrong with a request, in a few words."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}: {getattr(exc, 'detail', '') or exc.reason}"
    reason = getattr(exc, "reason", None) or exc
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout:g} s"
    return str(reason) or type(reason).__name__


# -- histories ------------------------------------------------------------------------------------

HISTORY_DEADLINE_SECONDS = 60.0
"""``report --from`` waits this long for every daemon's histories together (a daemon that does
not answer costs ``timeout``, 3 s); a history still being read then is cut where it got to."""
ANSWER_MAX_BYTES = 64 * 2**20  # a page is about history.PAGE_BYTES; an index, a few KiB per rank


@dataclass
class Histories:
    """The histories of one job read from node daemons: local copies (``history.HistoryCopy``)
    and, by name, what could not be read."""

    job: str | None
    copies: dict[str, str] = field(default_factory=dict)
    """Each copy's path -> where it came from (``HOST:PORT/rank-<R>.history.sqlite``)."""
    problems: list[str] = field(default_factory=list)
    other_jobs: list[str] = field(default_factory=list)
    """Jobs the daemons also hold (the job written last is read unless one is asked for)."""


@dataclass
class _Reading:
    """One rank's history being copied from one daemon."""

    address: str
    rank: int
    entry: dict[str, Any]
    copy: history.HistoryCopy
    since: int = 0
    done: bool = False


def fetch_histories(
    addresses: Sequence[str],
    into: str,
    job: str | None = None,
    timeout: float = 3.0,
    deadline: float = HISTORY_DEADLINE_SECONDS,
    client: HttpConfig | None = None,
) -> Histories:
    """Copy the histories of ``job`` (default: the job written last) from the daemons at
    ``addresses`` into the directory ``into``, one subdirectory per daemon: every daemon's list
    (``/history``), then a page of every rank at a time, until each is whole or ``deadline``
    seconds have passed in all. A daemon that does not answer, or serves no history, is named
    in ``problems``; so is a rank cut short by the deadline."""
    until = time.monotonic() + deadline
    out = Histories(job)
    client = client or HttpConfig()
    indexes = _indexes(addresses, timeout, until, deadline, out.problems, client)
    latest: dict[str, float] = {}  # job -> its newest file on any daemon
    for _, index in indexes:
        for e in index:
            mtime = e.get("file_mtime_unix")
            latest[str(e.get("job"))] = max(
                latest.get(str(e.get("job")), 0.0),
                mtime if isinstance(mtime, (int, float)) else 0.0,
            )
    if not latest:
        return out
    if job is None:
        out.job = job = max(latest, key=lambda j: latest[j])
    out.other_jobs = sorted(j for j in latest if j != job)
    if job not in latest:
        out.problems.append(
            f"no daemon holds a history of job {job!r}; jobs there: {', '.join(sorted(latest))}"
        )
        return out
    readings = []
    for i, (address, index) in enumerate(indexes):
        directory = os.path.join(into, str(i))  # a daemon's ranks are one of each
        os.makedirs(directory, exist_ok=True)
        for e in index:
            if str(e.get("job")) != job:
                continue
            if e.get("problem"):
                out.problems.append(f"{address}: {e['problem']}")
                continue
            path = history.path_for(directory, e["rank"])
            where = f"{address}/rank-{e['rank']}{history.SUFFIX}"
            readings.append(_Reading(address, e["rank"], e, history.HistoryCopy(path, where)))
            out.copies[path] = where
    try:
        _pages(readings, timeout, until, deadline, out.problems, client)
    finally:
        for r in readings:
            r.copy.close()
    for r in readings:
        mtime = r.entry.get("file_mtime_unix")
        if isinstance(mtime, (int, float)) and os.path.exists(r.copy.path):
            os.utime(r.copy.path, (mtime, mtime))  # which of two copies of a rank is newer
        elif not os.path.exists(r.copy.path):
            del out.copies[r.copy.path]
    return out


def _indexes(
    addresses: Sequence[str],
    timeout: float,
    until: float,
    deadline: float,
    problems: list[str],
    client: HttpConfig,
) -> list[tuple[str, list[dict[str, Any]]]]:
    """(address, its list of histories) of every daemon that answered with one."""
    urls = [base_url(a) + "/history" for a in addresses]
    out = []
    answers = fetch_all(urls, timeout, until - time.monotonic(), ANSWER_MAX_BYTES, client)
    for address, url, answer in zip(addresses, urls, answers):
        body = _body(
            address, url, answer, timeout, deadline, problems, "its ranks are not in the report"
        )
        if body is None:
            continue
        index = body.get("histories")
        if not isinstance(index, list) or not all(
            isinstance(e, dict) and isinstance(e.get("rank"), int) for e in index
        ):
            problems.append(
                f"{url}: not ddpmon's list of histories; is that address a ddpmon daemon?"
            )
            continue
        out.append((address, index))
    return out


def _pages(
    readings: list[_Reading],
    timeout: float,
    until: float,
    deadline: float,
    problems: list[str],
    client: HttpConfig,
) -> None:
    """Read a page from every daemon at a time (its first unfinished rank's), until every
    rank is whole or time is up. One request at a time per daemon: its one worker answers
    them in turn anyway, and a scrape waits behind one page at most, not behind a queue."""
    pending = list(readings)
    while pending and time.monotonic() < until:
        batch = list({r.address: r for r in reversed(pending)}.values())  # each daemon's first
        urls = [
            f"{base_url(r.address)}/history?"
            f"{history.Ask(job=r.entry.get('job'), rank=r.rank, since=r.since).query()}"
            for r in batch
        ]
        answers = fetch_all(urls, timeout, until - time.monotonic(), ANSWER_MAX_BYTES, client)
        for r, url, answer in zip(batch, urls, answers):
            if answer is None:
                continue  # the deadline: said below
            body = _body(
                r.address,
                url,
                answer,
                timeout,
                deadline,
                problems,
                f"rank {r.rank}'s plots stop at step {r.since}",
            )
            if body is None:
                r.done = True
                continue
            try:
                r.copy.add(body)
            except history.HistoryError as exc:
                problems.append(str(exc))
                r.done = True
                continue
            following = body.get("next_since")
            if following is None:
                r.done = True
            elif not isinstance(following, int) or following <= r.since:
                problems.append(
                    f"{url}: its next page does not move on (next_since={following!r}); "
                    "is that address a ddpmon daemon?"
                )
                r.done = True
            else:
                r.since = following
        pending = [r for r in pending if not r.done]
    for r in pending:
        total = r.entry.get("rows")
        of = f" of {total:,}" if isinstance(total, int) else ""
        problems.append(
            f"{r.copy.where}: {r.copy.rows:,}{of} steps read within {deadline:g} s (the report "
            f"waits that long for all daemons together); its plots stop at step {r.since} "
            "(--deadline waits longer)"
        )


def _body(
    address: str,
    url: str,
    answer: Answer | None,
    timeout: float,
    deadline: float,
    problems: list[str],
    then: str,
) -> dict[str, Any] | None:
    """The JSON object of a /history answer, or None with the problem said in ``problems``,
    and ``then``, what it means for the report."""
    if answer is None:
        problems.append(
            f"{address}: did not answer within {deadline:g} s (the report waits that long for "
            f"all daemons together); {then}"
        )
        return None
    _, body, _ = answer
    if isinstance(body, Unbounded):
        problems.append(f"{url}: {body}; is that address a ddpmon daemon?")
        return None
    if isinstance(body, BaseException):
        problems.append(
            f"{address}: {url} cannot be read ({why(body, timeout)}); {then}. Is "
            "`ddpmon daemon --serve-state` running there, and is the port reachable?"
        )
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict) or "format" not in data:
        problems.append(
            f"{url}: not ddpmon's /history (a daemon of a ddpmon before histories were served? "
            "it answers with metrics): upgrade ddpmon there"
        )
        return None
    if data["format"] != history.PAGE_FORMAT:
        problems.append(
            f"{url}: /history format {data['format']!r}, this ddpmon reads {history.PAGE_FORMAT}: "
            "use the same ddpmon version here and on the node"
        )
        return None
    return data
