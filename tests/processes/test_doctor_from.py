"""``doctor --from`` against daemons that do not answer: every daemon is read at once under
one deadline, so dead nodes cost seconds in all, not seconds each; the answering daemon's
ranks are still diagnosed, and each silent one is named with its reason.

A daemon that does not answer is a listening socket nobody accepts on: the connection is
made (the kernel's backlog) and the request is never answered, as on a node whose daemon
hangs. (Unreachable addresses, packets dropped, are in tests/hosts/test_two_hosts.py.)
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpmon.daemon.node import Daemon
from ddpmon.doctor.load import load_remote
from ddpmon.httpd import serve
from ddpmon.remote.daemons import fetch_each
from ddpmon.webconfig import HttpConfig
from tests.support import states
from tests.support.commands import run_doctor, start_daemon, terminate
from tests.support.states import state, write

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def silent_daemons() -> Iterator[list[str]]:
    """Four addresses whose daemons never answer."""
    socks = []
    for _ in range(4):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        socks.append(s)
    yield [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for s in socks:
        s.close()


def test_silent_daemons_are_waited_for_at_once(silent_daemons: list[str]) -> None:
    started = time.monotonic()
    loaded = load_remote(silent_daemons, timeout=1.5, deadline=5.0)
    took = time.monotonic() - started
    assert took < 3.0, f"{took:.1f} s: the daemons were read one after another (4 x 1.5 s)"
    assert [u.address for u in loaded.unreachable] == silent_daemons
    assert {u.reason for u in loaded.unreachable} == {"no answer within 1.5 s"}
    assert [u.ips for u in loaded.unreachable] == [["127.0.0.1"]] * 4


def test_one_deadline_for_all(silent_daemons: list[str]) -> None:
    started = time.monotonic()
    loaded = load_remote(silent_daemons, timeout=30.0, deadline=1.0)
    took = time.monotonic() - started
    assert took < 2.0, f"{took:.1f} s past a deadline of 1 s"
    assert {u.reason for u in loaded.unreachable} == {
        "did not answer within 1 s (the doctor waits that long for all daemons together)"
    }


def test_doctor_answers_within_10_s_with_four_silent_daemons(
    tmp_path: Path, silent_daemons: list[str]
) -> None:
    write(tmp_path, state(0, silent=30.0))  # on node-b: no process of theirs is checked here
    write(tmp_path, state(1, silent=30.0, in_flight=[states.waiting_in("all_reduce", 5, 30.0)]))
    daemon, port = start_daemon(
        "--state-dir", str(tmp_path), "--serve-state", "--no-gpu", "--node-local"
    )
    try:
        addresses = [f"127.0.0.1:{port}", *silent_daemons]
        started = time.monotonic()
        done = run_doctor(
            *(a for address in addresses for a in ("--from", address)), "--json", "--no-stacks"
        )
        took = time.monotonic() - started
    finally:
        terminate(daemon)
    print(f"doctor --from 1 daemon + 4 that never answer: {took:.1f} s")
    assert took < 10.0
    report = json.loads(done.stdout)
    assert (done.returncode, report["verdict"], report["suspect_ranks"]) == (1, "hang", [0]), (
        done.stderr
    )
    silent = [f["summary"] for f in report["findings"] if f["kind"] == "unreachable_daemon"]
    assert [s.split(" ")[0] for s in silent] == [f"http://{a}/state" for a in silent_daemons]
    assert all("no answer within 3 s" in s for s in silent), silent


def test_from_file_reads_the_daemons_as_from_does(tmp_path: Path) -> None:
    """An address file, with comments and a dead node's daemon, says what --from says."""
    write(tmp_path / "node", state(0, silent=30.0))
    write(
        tmp_path / "node",
        state(1, silent=30.0, in_flight=[states.waiting_in("all_reduce", 5, 30.0)]),
    )
    with socket.socket() as s:  # a port nothing listens on: a dead node's daemon
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    daemon, port = start_daemon(
        "--state-dir", str(tmp_path / "node"), "--serve-state", "--no-gpu", "--node-local"
    )
    listed = tmp_path / "daemons.txt"
    listed.write_text(
        f"# the job's nodes\n127.0.0.1:{port}   # node-b\n\n{dead}\n127.0.0.1:{port}\n"
    )
    try:
        by_file = run_doctor("--from-file", str(listed), "--json", "--no-stacks")
        by_hand = run_doctor("--from", f"127.0.0.1:{port}", "--from", dead, "--json", "--no-stacks")
    finally:
        terminate(daemon)
    assert by_file.returncode == by_hand.returncode == 1, by_file.stderr
    found, expected = json.loads(by_file.stdout), json.loads(by_hand.stdout)
    assert (
        (found["verdict"], found["suspect_ranks"])
        == (expected["verdict"], expected["suspect_ranks"])
        == ("hang", [0])
    )
    assert [f["kind"] for f in found["findings"]] == [f["kind"] for f in expected["findings"]]
    (unreachable,) = [f["summary"] for f in found["findings"] if f["kind"] == "unreachable_daemon"]
    assert unreachable.startswith(f"http://{dead}/state") and "refused" in unreachable
    assert sorted(r["rank"] for r in found["ranks"]) == [
        0,
        1,
    ]  # the daemon listed twice is read once


@pytest.fixture
def silent_and_answering() -> Iterator[tuple[str, str]]:
    """A daemon that never answers and a server that answers at once, as addresses."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Quick(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"[]")

        def log_message(self, *args: object) -> None:
            pass

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    quick = ThreadingHTTPServer(("127.0.0.1", 0), Quick)
    threading.Thread(target=quick.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{hole.getsockname()[1]}", f"127.0.0.1:{quick.server_address[1]}"
    quick.shutdown()
    hole.close()


def test_each_answer_is_read_as_it_comes(silent_and_answering: tuple[str, str]) -> None:
    """A thousand daemons' answers take seconds to parse: the first is in the reader's hands
    while a silent daemon still costs its timeout, not after it."""
    silent, quick = silent_and_answering
    urls = [f"http://{silent}/state", f"http://{quick}/state"]
    started = time.monotonic()
    each = fetch_each(urls, 2.0, 5.0, 1 << 20, HttpConfig())
    i, (_, body, _) = next(each)
    first = time.monotonic() - started
    assert (i, body) == (1, b"[]")
    assert first < 1.5, f"the answer came {first:.1f} s late: after the silent daemon's timeout"
    (i, (_, silence, _)), *_ = list(each)
    assert i == 0 and isinstance(silence, BaseException)


def test_doctor_through_64_daemons_six_black_holed(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """58 real daemons (their routes and HTTP server, in this process) of 8 ranks each, one
    rank stuck and the others waiting for it, and 6 daemons that never answer: the culprit
    is named, every silent daemon too, and every other daemon's ranks read within the
    doctor's deadline (5 s).
    (Not ``tmp_path``: the 464 files are the helpers', and checking each against the schema
    after the test would take longer than the test.)"""
    tmp_path = tmp_path_factory.mktemp("nodes")
    nodes, per_node, stuck = 58, 8, 8 * 20 + 3
    world = nodes * per_node
    endpoints = []
    for node in range(nodes):
        directory = tmp_path / f"node-{node}"
        for rank in range(node * per_node, (node + 1) * per_node):
            waits = [] if rank == stuck else [states.waiting_in("all_reduce", 5, 30.0, size=world)]
            write(
                directory,
                state(rank, world, host=f"node-{node}", silent=30.0, in_flight=waits),
            )
        daemon = Daemon(str(directory), gpus=False, node_local=True)
        routes = {"/state": daemon.routes.state_route, "/launchers": daemon.routes.launchers_route}
        endpoints.append(serve(daemon, 0, "127.0.0.1", routes))  # type: ignore[arg-type]
    holes = []
    for _ in range(6):
        hole = socket.socket()
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        holes.append(hole)
    answering = [f"127.0.0.1:{e.port}" for e in endpoints]
    silent = [f"127.0.0.1:{h.getsockname()[1]}" for h in holes]
    listed = tmp_path / "daemons.txt"
    listed.write_text("\n".join(answering[:29] + silent + answering[29:]) + "\n")
    try:
        started = time.monotonic()
        done = run_doctor("--from-file", str(listed), "--json", "--no-stacks")
        took = time.monotonic() - started
    finally:
        for e in endpoints:
            e.close()
        for h in holes:
            h.close()
    print(f"doctor through 58 daemons and 6 that never answer: {took:.1f} s")
    report = json.loads(done.stdout)
    assert (done.returncode, report["verdict"], report["suspect_ranks"]) == (1, "hang", [stuck]), (
        done.stderr
    )
    assert len(report["ranks"]) == world
    unheard = [f["summary"] for f in report["findings"] if f["kind"] == "unreachable_daemon"]
    assert sorted(s.split(" ")[0] for s in unheard) == sorted(f"http://{a}/state" for a in silent)
    # every daemon's ranks were read within the doctor's 5 s deadline: at once, not in turn
    # (6 silent daemons in turn cost 18 s); the bound leaves room for a loaded machine
    assert took < 20.0, f"{took:.1f} s: far past the deadline of 5 s and the doctor's start"
