"""A job that never reaches its first step, on two hosts made of Linux namespaces
(tests/support/hosts.py): each host runs ``ddpmon run --nnodes=2 --node-rank=N`` as a user
would, gloo on the ``job`` network, a daemon on each host serving its state files and its
launcher's record, and the doctor on host-a asking both (``--from``). A rank that is late,
a node given a wrong master address, a master port already taken, a node that never
starts: each is named with where it is or why it cannot connect, within 10 s of asking.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import hosts
from tests.support.hosts import DAEMON_PORT, doctor, finding, sources

pytestmark = pytest.mark.timeout(240)

SCRIPT = str(Path(__file__).resolve().parents[1] / "distributed" / "late_train.py")
PORT = "29610"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[hosts.Cluster]:
    reason = hosts.unavailable()
    if reason:
        pytest.skip(f"hosts from Linux namespaces: {reason}")
    with hosts.Cluster(tmp_path) as c:
        for h in c.hosts:
            hosts.start_daemon(h, DAEMON_PORT)
        yield c


def launch(host: hosts.Host, master: str, late: bool = False) -> None:
    """``ddpmon run`` of node ``host.index`` of two, one rank each, its master ``master``;
    ``late``: rank 1 prepares its data until late_train.py gives up (60 s), as its file to
    wait for never comes."""
    host.start(
        [
            sys.executable,
            "-m",
            "ddpmon",
            "run",
            "--job",
            "launch",
            "--port",
            "-1",
            "--nnodes=2",
            f"--node-rank={host.index}",
            "--nproc-per-node=1",
            f"--master-addr={master}",
            f"--master-port={PORT}",
            SCRIPT,
            "/nonexistent/go" if late else SCRIPT,
        ],
        "launch",
        GLOO_SOCKET_IFNAME=hosts.IFACE["job"],
    )


def ask_until(
    c: hosts.Cluster, kind: str, text: str = "", timeout: float = 120.0
) -> tuple[int, dict, float]:
    """The doctor on host-a, asking both daemons, until a finding of ``kind`` (saying
    ``text``) comes."""
    a, b = c.hosts
    deadline = time.monotonic() + timeout
    answers: list[Any] = []
    while time.monotonic() < deadline:
        code, report, took = doctor(a, *sources(a.addr(), b.addr()))
        answers.append((report["verdict"], [f["kind"] for f in report["findings"]]))
        if any(f["kind"] == kind and text in f["summary"] for f in report["findings"]):
            return code, report, took
        time.sleep(1.0)
    logs = "\n".join(f"=== {h.name}\n{h.log('launch')}" for h in c.hosts)
    raise AssertionError(f"no {kind} finding; answers: {answers[-5:]}\n{logs}")


def test_a_node_given_a_wrong_master_address_is_named_with_it(cluster: hosts.Cluster) -> None:
    a, b = cluster.hosts
    wrong = "10.77.0.99"  # on the job network, and no host has it
    launch(a, a.addr("job"))
    launch(b, wrong)
    code, report, took = ask_until(cluster, "master_unreachable")
    assert code == 1 and report["verdict"] == "not_started", report
    found = finding(report, "master_unreachable")
    assert found["summary"].startswith(
        f"node 1 (host-b) cannot reach the rendezvous endpoint it was given, {wrong}:{PORT}: "
    ), found
    assert any(e in found["summary"] for e in ("no route", "timed out")), found
    assert f"node 0 (host-a) serves it at {a.addr('job')}:{PORT}" in found["summary"], found
    assert "--master-addr" in found["fix"]
    assert "node_missing" not in [f["kind"] for f in report["findings"]]
    assert took < 10, took


def test_a_master_port_in_use_names_the_process_that_holds_it(cluster: hosts.Cluster) -> None:
    a, b = cluster.hosts
    holder = a.start(
        [
            sys.executable,
            "-c",
            "import socket, time\n"
            f"s = socket.socket(); s.bind(('0.0.0.0', {PORT})); s.listen(); time.sleep(600)",
        ],
        "holder",
    )
    time.sleep(1.0)
    launch(a, a.addr("job"))
    launch(b, a.addr("job"))
    code, report, took = ask_until(cluster, "port_in_use")
    assert code == 1 and report["verdict"] == "not_started", report
    found = finding(report, "port_in_use")
    assert found["summary"].startswith(
        f"node 0 (host-a) cannot serve the rendezvous store at {a.addr('job')}:{PORT}: "
        f"port {PORT} is already in use by pid {holder.pid}: "
    ), found
    assert report["findings"][0]["kind"] == "port_in_use"
    assert took < 10, took


def test_a_node_that_never_starts_is_named(cluster: hosts.Cluster) -> None:
    a, b = cluster.hosts
    launch(a, a.addr("job"))  # host-b's node is never started
    code, report, took = ask_until(cluster, "node_missing")
    assert code == 1 and report["verdict"] == "not_started", report
    found = finding(report, "node_missing")
    assert found["summary"].startswith(
        f"node 0 (host-a) waits at {a.addr('job')}:{PORT} for 2 nodes ("
    ), found
    assert "; node 1 never arrived: no launcher of its is seen" in found["summary"], found
    assert took < 10, took


def test_a_late_rank_on_the_far_host_is_named_with_its_function(cluster: hosts.Cluster) -> None:
    a, b = cluster.hosts
    launch(a, a.addr("job"))
    launch(b, a.addr("job"), late=True)
    # (while its process imports torch, it is in late_train.py's imports: said so)
    code, report, took = ask_until(cluster, "not_arrived", "prepare_dataset")
    assert code == 1 and report["verdict"] == "not_started" and report["suspect_ranks"] == [1]
    summary = finding(report, "not_arrived")["summary"]
    assert "rank 0 waits in" in summary and f"{a.addr('job')}:{PORT}" in summary, summary
    assert "rank 1 has not arrived: in prepare_dataset, " in summary, summary
    assert "late_train.py:16, starting for" in summary, summary
    assert took < 10, took
