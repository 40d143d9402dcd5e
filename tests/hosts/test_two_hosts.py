"""A job on two hosts made of Linux namespaces (tests/support/hosts.py): host-a and host-b,
two ranks each (torchrun's numbering: host-b holds ranks 2 and 3, GROUP_RANK 1), gloo over
a bridge, no shared file system (each host's state files under its own TMPDIR), a daemon
on each (``--serve-state``), and the doctor run on host-a with ``--from`` both, as a user
on the first node would. A stall on the far host, a lost node, a cut link, and daemons
that do not answer; and a Prometheus on host-a with the shipped rules paging for the ranks
of a lost node alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration import promserver
from tests.support import hosts
from tests.support.hosts import DAEMON_PORT, doctor, finding, sources

pytestmark = pytest.mark.timeout(180)

RANK_PORTS = (9500, 9501)  # ddpmon's default base port + LOCAL_RANK


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[hosts.Cluster]:
    reason = hosts.unavailable()
    if reason:
        pytest.skip(f"two hosts from Linux namespaces: {reason}")
    with hosts.Cluster(tmp_path) as c:
        yield c


def logs(c: hosts.Cluster) -> str:
    return "\n".join(f"=== {h.name}\n{h.log('rank')}{h.log('daemon')}" for h in c.hosts)


def wait_for(what: str, check: Callable[[], Any], c: hosts.Cluster, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}:\n{logs(c)}")


def steps(c: hosts.Cluster, state_dir: Path | None = None) -> dict[int, int]:
    """Each rank's step, from the state files on the hosts' own disks (or ``state_dir``)."""
    paths = (
        list(state_dir.glob("rank-*.json"))
        if state_dir
        else [p for h in c.hosts for p in h.tmp.glob("ddpmon-*/two-hosts/rank-*.json")]
    )
    out = {}
    for p in paths:
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        out[data["rank"]] = data["step"]
    return out


def training(c: hosts.Cluster, state_dir: Path | None = None) -> Callable[[], bool]:
    return lambda: (s := steps(c, state_dir)) and sorted(s) == [0, 1, 2, 3] and min(s.values()) >= 5


def test_stall_on_the_far_host(cluster: hosts.Cluster) -> None:
    """Rank 3, on host-b, never returns from its data loader: the doctor on host-a names it,
    on its host, with the stack from its hang report; the others wait for it."""
    a, b = cluster.hosts
    for h in cluster.hosts:
        hosts.start_daemon(h, DAEMON_PORT)
    hosts.start_job(cluster, "stall", "3", "8")

    blamed = []

    def stuck_rank() -> dict[str, Any] | None:
        _, report, _ = doctor(a, *sources(a.addr(), b.addr()))
        blamed.append(report["suspect_ranks"])  # before rank 3's own watchdog reports, it may
        kinds = [f["kind"] for f in report["findings"]]  # look like it runs on (not_joining)
        statuses = [r["status"] for r in sorted(report["ranks"], key=lambda r: r["rank"])]
        every_watchdog = statuses == [
            "waiting",
            "waiting",
            "waiting",
            "stuck",
        ]  # each one's hang report
        return (
            report
            if report["verdict"] == "hang" and "stuck_rank" in kinds and every_watchdog
            else None
        )

    report = wait_for("the doctor to see rank 3 stuck and the others wait", stuck_rank, cluster)
    assert report["suspect_ranks"] == [3]
    assert all(b in ([], [3]) for b in blamed), blamed
    stuck = finding(report, "stuck_rank")
    assert stuck["summary"].startswith("rank 3 is stuck outside any collective")
    assert any(line.startswith("rank 3 (host host-b, pid ") for line in stuck["evidence"])
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert [ranks[r]["host"] for r in range(4)] == ["host-a", "host-a", "host-b", "host-b"]
    assert ranks[3]["stack"]["source"].startswith("its hang report")
    assert [f["function"] for f in ranks[3]["stack"]["frames"]][-2:] == ["main", "load_batch"]
    assert not [
        f for f in report["findings"] if f["kind"] in ("unreachable_daemon", "missing_ranks")
    ]


def test_lost_node_is_named_not_the_survivor(cluster: hosts.Cluster) -> None:
    """Every process of host-b is killed, its daemon too. host-a's ranks fail at once with
    "Connection reset by peer" from host-b: the doctor blames host-b's ranks, names the node
    and its address, within 15 s of its death, and never blames a survivor on the way."""
    a, b = cluster.hosts
    for h in cluster.hosts:
        hosts.start_daemon(h, DAEMON_PORT)
    hosts.start_job(cluster, "train")
    wait_for("every rank to train", training(cluster), cluster)
    job_net = sources(a.addr("job"), b.addr("job"))  # the addresses gloo names in its errors

    b.kill_all()
    died = time.monotonic()
    answers = []

    def named() -> dict[str, Any] | None:
        _, report, _ = doctor(a, *job_net)
        answers.append(
            (round(time.monotonic() - died, 1), report["verdict"], report["suspect_ranks"])
        )
        return (
            report
            if report["suspect_ranks"] == [2, 3] and report["verdict"] == "dead_rank"
            else None
        )

    wait_for("the doctor to name host-b's ranks", named, cluster, timeout=30)
    took = time.monotonic() - died
    # a moment after the death a survivor may yet have to reach the collective that fails
    report = wait_for(
        "both survivors to fail",
        lambda: (
            (r := named())
            and len(r["ranks"]) == 2
            and all(x["status"] == "crashed" for x in r["ranks"])
            and r
        ),
        cluster,
        timeout=30,
    )
    print(f"lost node named {took:.1f} s after its death; answers: {answers}")
    assert took < 15.0
    assert answers[-1][1:] == ("dead_rank", [2, 3])
    assert not [x for x in answers if {0, 1} & set(x[2])], answers
    lost = finding(report, "lost_node")
    assert lost["ranks"] == [2, 3]
    assert lost["summary"] == (
        f"node 1 (GROUP_RANK 1) at {b.addr('job')}:{DAEMON_PORT} is lost: its daemon "
        "does not answer and ranks 2, 3 left no state file that can be read from here; "
        "ranks 0, 1 failed on connections to it"
    )
    assert (
        f"the daemon {b.addr('job')}:{DAEMON_PORT} does not answer: [Errno 111] Connection refused"
        in lost["evidence"]
    )
    assert any(
        line.endswith(
            f"lost its connection to {b.addr('job')}, the address of the unreachable daemon "
            f"{b.addr('job')}:{DAEMON_PORT}"
        )
        for line in lost["evidence"]
    ), lost["evidence"]
    assert [r["status"] for r in report["ranks"]] == ["crashed", "crashed"]
    assert all(
        "Connection reset by peer" in r["exit"]["exception"]
        or "closed by peer" in r["exit"]["exception"]
        for r in report["ranks"]
    )
    assert "missing_ranks" not in [f["kind"] for f in report["findings"]]
    assert finding(report, "unreachable_daemon")["summary"].startswith(
        f"http://{b.addr('job')}:{DAEMON_PORT}/state"
    )


def test_lost_node_in_a_shared_directory(cluster: hosts.Cluster, tmp_path: Path) -> None:
    """The same job writing to one directory both hosts share: host-b's ranks are killed;
    their files stay, no longer rewritten. They are named within seconds, not once their
    files are 10 s old."""
    a, b = cluster.hosts
    shared = tmp_path / "shared"
    hosts.start_job(cluster, "train", DDPMON_STATE_DIR=str(shared))
    wait_for("every rank to train", training(cluster, shared), cluster)

    b.kill_all()
    died = time.monotonic()
    answers = []

    def named() -> dict[str, Any] | None:
        _, report, _ = doctor(a, str(shared))
        answers.append(
            (round(time.monotonic() - died, 1), report["verdict"], report["suspect_ranks"])
        )
        return (
            report
            if report["suspect_ranks"] == [2, 3] and report["verdict"] == "dead_rank"
            else None
        )

    wait_for("the doctor to name host-b's ranks", named, cluster, timeout=30)
    took = time.monotonic() - died
    report = wait_for(
        "both survivors to fail",
        lambda: (r := named()) and all(x["status"] == "crashed" for x in r["ranks"][:2]) and r,
        cluster,
        timeout=30,
    )
    print(f"lost node (shared directory) named {took:.1f} s after its death; answers: {answers}")
    assert took < 15.0
    assert not [x for x in answers if {0, 1} & set(x[2])], answers
    lost = finding(report, "lost_node")
    assert lost["summary"] == (
        "host host-b is lost: ranks 2, 3 stopped writing their state files together; "
        "ranks 0, 1 failed on connections to it"
    )
    assert [(r["host"], r["status"]) for r in report["ranks"]] == [
        ("host-a", "crashed"),
        ("host-a", "crashed"),
        ("host-b", "silent"),
        ("host-b", "silent"),
    ]
    assert (
        max(r["file_age_seconds"] for r in report["ranks"]) < 10.0
    )  # not stale yet: silent all the same


def test_cut_link(cluster: hosts.Cluster) -> None:
    """host-b's link on the job's network is cut (its frames dropped, both ends up): every
    rank waits in the same all-reduce and none is behind. Read from host-a through the
    management network, that is a hang in communication. Once host-b's management link is
    cut too, the doctor on host-a cannot tell a dead node from a cut link: the ranks it sees
    only wait, so it is a hang with host-b's ranks unseen, not a lost node."""
    a, b = cluster.hosts
    for h in cluster.hosts:
        hosts.start_daemon(h, DAEMON_PORT)
    hosts.start_job(cluster, "train")
    wait_for("every rank to train", training(cluster), cluster)

    cluster.cut(b, "job")

    def hung() -> (
        dict[str, Any] | None
    ):  # every rank's file caught up with the stall (a loaded machine lags)
        _, report, _ = doctor(a, *sources(a.addr(), b.addr()))
        waiting = [r["status"] for r in report["ranks"]] == ["waiting"] * 4
        return report if report["verdict"] == "hang" and waiting else None

    report = wait_for("the doctor to see every rank wait", hung, cluster)
    assert report["suspect_ranks"] == []
    assert finding(report, "comm_hang")["ranks"] == [0, 1, 2, 3]
    assert [r["status"] for r in report["ranks"]] == ["waiting"] * 4

    cluster.cut(b, "mgmt")
    code, report, took = doctor(a, *sources(a.addr(), b.addr()))
    assert (code, report["verdict"], report["suspect_ranks"]) == (1, "hang", [2, 3])
    assert [f["kind"] for f in report["findings"]][:2] == ["missing_rank", "unreachable_daemon"]
    assert "no answer within 3 s" in finding(report, "unreachable_daemon")["summary"]
    assert took < 10.0


def test_lost_node_pages_for_its_ranks_alone(cluster: hosts.Cluster, tmp_path: Path) -> None:
    """A Prometheus on host-a (the shipped rules, their ``for:`` 8 s) scrapes every rank and
    both daemons over the management network. host-b is lost without a word: both its links
    are cut (its frames dropped, as when a node loses power or its switch port; a node whose
    kernel lives on closes the connections and the survivors fail at once instead). host-a's
    ranks wait in the all-reduce and report hangs; DDPHangCulprit fires for ranks 2 and 3
    alone, silent, on host-b, and neither the survivors' DDPHangSuspected nor the lost ranks'
    DDPRankEndpointDown does."""
    if promserver.binary() is None:
        pytest.skip(promserver.MISSING)
    a, b = cluster.hosts
    for h in cluster.hosts:
        hosts.start_daemon(h, DAEMON_PORT)
    hosts.start_job(cluster, "train")
    (tmp_path / "prometheus").mkdir()
    shortened = {
        name: "8s" for name in ("DDPHangCulprit", "DDPHangSuspected", "DDPRankEndpointDown")
    }
    prom = promserver.Prometheus(
        tmp_path / "prometheus",
        promserver.rules_with_for(tmp_path / "rules.yml", shortened),
        enter=a.enter(),
        daemon_auth=hosts.DAEMON_AUTH,
    )
    try:
        prom.start()
        promserver.write_targets(
            prom.ranks_sd, [f"{h.addr()}:{p}" for h in cluster.hosts for p in RANK_PORTS]
        )
        promserver.write_targets(
            prom.daemons_sd, [f"{h.addr()}:{DAEMON_PORT}" for h in cluster.hosts]
        )
        prom.wait_for(
            "every rank stepping, by its own word and its daemon's",
            lambda: all(
                len(prom.vector(f'{m}{{job="two-hosts", activity="stepping"}} == 1')) == 4
                for m in ("ddpmon_activity", "ddpmon_rank_activity")
            ),
            timeout=60,
            interval=1.0,
        )
        cluster.cut(b, "job")
        cluster.cut(b, "mgmt")
        lost = time.monotonic()
        seen: list[tuple[float, str, str, str | None]] = []

        def culprits() -> list[dict[str, Any]]:
            alerts = [x for x in prom.alerts() if x["labels"].get("job") == "two-hosts"]
            seen.extend(
                (
                    round(time.monotonic() - lost, 1),
                    x["labels"]["alertname"],
                    x["state"],
                    x["labels"].get("rank"),
                )
                for x in alerts
            )
            return [
                x
                for x in alerts
                if x["labels"]["alertname"] == "DDPHangCulprit" and x["state"] == "firing"
            ]

        firing = prom.wait_for("DDPHangCulprit to fire", culprits, timeout=40, interval=0.5)
        took = time.monotonic() - lost
        for _ in range(6):  # a few seconds more: nothing else fires
            culprits()
            time.sleep(0.5)
        print(
            f"lost node: DDPHangCulprit fired {took:.1f} s after host-b was cut off; alerts seen: "
            f"{sorted({s[1:] for s in seen})}"
        )
        assert sorted(
            (x["labels"]["rank"], x["labels"]["host"], x["labels"]["activity"], float(x["value"]))
            for x in firing
        ) == [("2", "host-b", "silent", 2.0), ("3", "host-b", "silent", 2.0)]
        assert took < 2.0 + 8.0 + 6.0, seen  # hang timeout, for:, a scrape timeout and intervals
        assert {s[3] for s in seen if s[1] == "DDPHangCulprit"} == {"2", "3"}, seen
        assert not [
            s for s in seen if s[1] in shortened and s[1] != "DDPHangCulprit" and s[2] == "firing"
        ], seen
        waiting = prom.by('ddpmon_activity{job="two-hosts", activity="waiting"} == 1', "rank")
        assert waiting == {"0": 1.0, "1": 1.0}
        assert set(prom.by('ddpmon_hang_suspected{job="two-hosts"} == 1', "rank")) == {
            "0",
            "1",
        }  # quieted
    finally:
        prom.stop()


@pytest.mark.parametrize("dead", [4, 16])
def test_doctor_answers_within_10_s_whatever_the_number_of_dead_daemons(
    cluster: hosts.Cluster, dead: int
) -> None:
    """Daemons at addresses whose packets go nowhere (host-a knows a link-layer address for
    each that no one has: every packet is dropped on the bridge, the connection times out)."""
    a, b = cluster.hosts
    for h in cluster.hosts:
        hosts.start_daemon(h, DAEMON_PORT)
    nowhere = [f"{hosts.NETS['mgmt']}.{100 + i}" for i in range(dead)]
    for i, address in enumerate(nowhere):
        a.ip(
            "neigh",
            "add",
            address,
            "lladdr",
            f"02:00:00:00:01:{i:02x}",
            "dev",
            hosts.IFACE["mgmt"],
            "nud",
            "permanent",
        )
    code, report, took = doctor(a, *sources(a.addr(), b.addr(), *nowhere))
    print(f"doctor with {dead} daemons whose packets are dropped: {took:.1f} s")
    assert took < 10.0
    assert (
        code == 2 and report["verdict"] == "no_data"
    )  # no job: the two live daemons serve nothing
    silent = [f["summary"] for f in report["findings"] if f["kind"] == "unreachable_daemon"]
    assert [s.split("/state")[0] for s in silent] == [f"http://{x}:{DAEMON_PORT}" for x in nowhere]
    assert all("no answer within 3 s" in s for s in silent), silent


def test_report_from_both_hosts(cluster: hosts.Cluster) -> None:
    """No shared file system: `report --from` on host-a reads every rank's step history through
    both daemons, with the figures of the two hosts' directories read together; a daemon
    whose packets are dropped is named, and the report goes on with the others."""
    a, b = cluster.hosts
    for h in cluster.hosts:
        hosts.start_daemon(h, DAEMON_PORT)
    ranks = hosts.start_job(cluster, "train")
    wait_for("every rank to train", training(cluster), cluster)
    time.sleep(2.5)  # the history writers' next passes
    for p in ranks:  # the histories stop changing (each rank keeps its committed batches)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
    nowhere = f"{hosts.NETS['mgmt']}.100"
    a.ip(
        "neigh",
        "add",
        nowhere,
        "lladdr",
        "02:00:00:00:02:00",
        "dev",
        hosts.IFACE["mgmt"],
        "nud",
        "permanent",
    )
    started = time.monotonic()
    far = a.run(
        [sys.executable, "-m", "ddpmon", "report", *sources(a.addr(), b.addr(), nowhere), "--json"],
        timeout=90,
    )
    took = time.monotonic() - started
    assert far.returncode == 0, far.stderr + logs(cluster)
    s = json.loads(far.stdout)
    assert (s["job"], s["ranks"], s["hosts"]) == ("two-hosts", 4, ["host-a", "host-b"])
    assert [r["history"] for r in s["per_rank"]] == [
        f"{h.addr()}:{DAEMON_PORT}/rank-{r}.history.sqlite"
        for h, r in ((a, 0), (a, 1), (b, 2), (b, 3))
    ]
    assert all(r["history_rows"] >= 5 for r in s["per_rank"]), s["per_rank"]
    assert (
        f"ddpmon report: {nowhere}:{DAEMON_PORT}: http://{nowhere}:{DAEMON_PORT}/history cannot be read "
        "(no answer within 3 s); its ranks are not in the report"
    ) in far.stderr
    assert took < 30.0

    dirs = [str(d) for h in cluster.hosts for d in h.tmp.glob("ddpmon-*/two-hosts")]
    near = subprocess.run(
        [sys.executable, "-m", "ddpmon", "report", *dirs, "--json"],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=hosts.ROOT,
        env=a.env(),
        check=False,
    )
    assert near.returncode == 0, near.stderr
    local = json.loads(near.stdout)
    # the status is the doctor's, which sees host-a's processes from host-a; so are the steps
    # missing past a killed rank's history (counted once the doctor sees the rank ended)
    history_only = ("history", "status", "missing_steps")
    assert [{k: v for k, v in r.items() if k not in history_only} for r in local["per_rank"]] == [
        {k: v for k, v in r.items() if k not in history_only} for r in s["per_rank"]
    ]
    for key in ("steps", "median_step_seconds", "parts", "buckets", "slowest_rank"):
        assert local[key] == s[key], key
