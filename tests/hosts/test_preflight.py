"""``ddpmon preflight`` on three hosts made of Linux namespaces (tests/support/hosts.py):
host-a, host-b and host-c on one bridge, one process each, gloo over the job network. With
host-c's link shaped to 20 Mbit/s (``tc ... tbf``) every node's report names host-c, and only
it; with no link shaped, nobody is named. Each runs once here; ``python -m
tests.hosts.test_preflight RUNS`` runs both RUNS times and counts (the figures in
docs/preflight.md).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import hosts

pytestmark = pytest.mark.timeout(120)

NAMES = ("host-a", "host-b", "host-c")
SHAPED_RATE = "20mbit"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[hosts.Cluster]:
    reason = hosts.unavailable() or (None if shutil.which("tc") else "needs tc on PATH")
    if reason:
        pytest.skip(f"three hosts from Linux namespaces: {reason}")
    with hosts.Cluster(tmp_path, NAMES) as c:
        yield c


def preflight(
    cluster: hosts.Cluster, port: int, timeout: float = 60.0
) -> tuple[list[int], list[dict[str, Any]], float]:
    """``ddpmon preflight --json`` on every host at once, as a user would start it on each
    node; (exit codes, reports, seconds until the last one ended)."""
    master = cluster.hosts[0].addr("job")
    started = time.monotonic()
    procs = [
        h.start(
            [sys.executable, "-m", "ddpmon", "preflight", "--json", "--timeout", "40"]
            + ["--nnodes=3", "--nproc-per-node=1", f"--node-rank={h.index}"]
            + [f"--master-addr={master}", f"--master-port={port}"],
            f"preflight-{port}",
            GLOO_SOCKET_IFNAME=hosts.IFACE["job"],
        )
        for h in cluster.hosts
    ]
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(1.0, timeout - (time.monotonic() - started))))
        except subprocess.TimeoutExpired:
            for h in cluster.hosts:
                h.kill_all()
            raise AssertionError(
                f"preflight did not end in {timeout:g} s:\n{_logs(cluster, port)}"
            ) from None
    took = time.monotonic() - started
    reports = []
    for h in cluster.hosts:
        out = (h.tmp.parent / f"preflight-{port}.out").read_text()
        assert out, _logs(cluster, port)
        reports.append(json.loads(out))
    return codes, reports, took


def _in_time(report: dict[str, Any], took: float) -> None:
    """Under 30 s in all on an idle machine; here three hosts start torch six times on two
    shared cores, so the bound on what preflight does once started is the tight one."""
    assert sum(report["phases_seconds"].values()) < 10, report["phases_seconds"]
    assert took < 60, took


def _logs(cluster: hosts.Cluster, port: int) -> str:
    return "\n".join(f"=== {h.name}\n{h.log(f'preflight-{port}')}" for h in cluster.hosts)


def test_names_the_host_whose_link_is_slow(cluster: hosts.Cluster) -> None:
    cluster.hosts[2].shape(SHAPED_RATE)
    codes, reports, took = preflight(cluster, 29510)
    assert codes == [1, 1, 1], _logs(cluster, 29510)
    for report in reports:  # every node has the same verdict
        assert report["slow_hosts"] == ["host-c"], report
        assert report["slow_links"] == [] and report["bad_hosts"] == []
        assert report["reasons"]["host-c"][0].startswith("every link of host-c is slow")
    links = {tuple(link["hosts"]): link for link in reports[0]["links"]}
    assert sorted(links) == [("host-a", "host-b"), ("host-a", "host-c"), ("host-b", "host-c")]
    assert links[("host-a", "host-b")]["slow"] == []
    for pair in (("host-a", "host-c"), ("host-b", "host-c")):
        assert links[pair]["slow"][:1] == ["bandwidth"]
        assert links[pair]["bandwidth_bytes_per_second"] < 5e6  # 20 Mbit/s is 2.5 MB/s
    assert sorted(reports[0]["checks"]) == list(NAMES)
    assert reports[0]["allreduce"]["ranks"] == 3
    _in_time(reports[0], took)


def test_names_nobody_on_a_healthy_set(cluster: hosts.Cluster) -> None:
    codes, reports, took = preflight(cluster, 29520)
    assert codes == [0, 0, 0], _logs(cluster, 29520)
    for report in reports:
        assert report["healthy"] and report["slow_hosts"] == [], report
    assert [link["slow"] for link in reports[0]["links"]] == [[], [], []]
    offsets = [c["clock_offset_seconds"] for c in reports[0]["checks"].values()]
    assert offsets[0] == 0.0 and all(abs(o) < 0.05 for o in offsets), offsets  # one clock
    _in_time(reports[0], took)


def test_run_preflight_keeps_the_job_off_a_slow_host(
    cluster: hosts.Cluster, tmp_path: Path
) -> None:
    """``ddpmon run --preflight`` on every host, host-c shaped: each node prints the verdict
    and exits 1 without starting the script."""
    cluster.hosts[2].shape(SHAPED_RATE)
    script = tmp_path / "train.py"
    script.write_text(f"import pathlib\npathlib.Path({str(tmp_path)!r}, 'ran').write_text('')\n")
    master = cluster.hosts[0].addr("job")
    procs = [
        h.start(
            [sys.executable, "-m", "ddpmon", "run", "--preflight", "--nnodes=3"]
            + ["--nproc-per-node=1", f"--node-rank={h.index}", f"--master-addr={master}"]
            + ["--master-port=29530", str(script)],
            "run",
            GLOO_SOCKET_IFNAME=hosts.IFACE["job"],
        )
        for h in cluster.hosts
    ]
    codes = [p.wait(90) for p in procs]
    assert codes == [1, 1, 1], "\n".join(h.log("run") for h in cluster.hosts)
    for h in cluster.hosts:
        err = (h.tmp.parent / "run.err").read_text()
        assert (
            "\nverdict: slow host host-c (" in err
            and "  host-c: every link of host-c is slow" in err
        ), err
    assert not (tmp_path / "ran").exists()


def _loop(runs: int, keep: str | None = None) -> None:
    """Both cases ``runs`` times each on one set of hosts: how often each names whom, how long;
    the last report of each case written into the directory ``keep``."""
    with tempfile.TemporaryDirectory() as tmp, hosts.Cluster(Path(tmp), NAMES) as c:
        for case in ("healthy", "shaped"):
            if case == "shaped":
                c.hosts[2].shape(SHAPED_RATE)
            named: dict[str, int] = {}
            times = []
            for i in range(runs):
                port = 29600 + (i if case == "healthy" else 100 + i)
                try:
                    codes, reports, took = preflight(c, port)
                except AssertionError as exc:
                    print(f"{case} run {i}: {exc}", flush=True)
                    named["(failed)"] = named.get("(failed)", 0) + 1
                    continue
                who = ",".join(reports[0]["slow_hosts"] + reports[0]["bad_hosts"]) or "nobody"
                who += "" if codes == [codes[0]] * 3 else f" (exit codes {codes})"
                named[who] = named.get(who, 0) + 1
                times.append(took)
                if keep:
                    Path(keep, f"{case}.json").write_text(json.dumps(reports[0]))
                phases = reports[0].get("phases_seconds")
                print(f"{case} run {i}: {who}, {took:.1f} s (node 0: {phases})", flush=True)
                if who != ("nobody" if case == "healthy" else "host-c"):
                    print(json.dumps([reports[0]["reasons"], reports[0]["links"]]), flush=True)
            print(
                f"{case}: {runs} runs named {named}; seconds min {min(times):.1f} "
                f"median {sorted(times)[len(times) // 2]:.1f} max {max(times):.1f}",
                flush=True,
            )


if __name__ == "__main__":
    _loop(int(sys.argv[1]) if len(sys.argv) > 1 else 20, sys.argv[2] if len(sys.argv) > 2 else None)
