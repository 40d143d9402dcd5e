"""Real multi-process gloo jobs that hang, die, desync or straggle, diagnosed by the doctor.

Each test starts the ranks (tests/distributed/hang_worker.py), waits (polling, bounded)
until the state files show the situation, runs ``python -m ddpmon doctor DIR --json`` and
asserts the verdict, the suspect ranks and the evidence; then it ends the ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddpmon.steps import SUSTAIN_SECONDS
from tests.support import harness

pytestmark = pytest.mark.timeout(120)


def launch(
    scenario: str,
    world: int,
    workdir: Path,
    args: tuple[str, ...] = (),
    prefix: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen]:
    """Like harness.start_ranks, for the scenarios of hang_worker."""
    workdir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        procs.append(
            subprocess.Popen(
                [*prefix, sys.executable, "-m", "tests.distributed.hang_worker", scenario, *args],
                cwd=harness.ROOT,
                env=harness.rank_env(rank, world, workdir, env),
                stdout=open(workdir / f"stdout-{rank}.txt", "w"),
                stderr=open(workdir / f"stderr-{rank}.txt", "w"),
                start_new_session=True,
            )
        )
    return procs


WORKER = harness.ROOT / "tests" / "distributed" / "hang_worker.py"


def site(fragment: str) -> str:
    """The call site (``file:line``) of the first line of hang_worker.py holding ``fragment``."""
    for number, line in enumerate(WORKER.read_text().splitlines(), 1):
        if fragment in line:
            return f"tests/distributed/hang_worker.py:{number}"
    raise AssertionError(f"{fragment!r} is not in {WORKER}")


def wait_for(
    what: str,
    check: Callable[[], bool],
    procs: list[subprocess.Popen],
    workdir: Path,
    timeout: float = 45.0,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    harness.stop(procs)
    raise AssertionError(
        f"timed out waiting for {what}:\n" + harness.describe(harness.collect(procs, workdir))
    )


def doctor(state_dir: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    out = subprocess.run(
        [sys.executable, "-m", "ddpmon", "doctor", str(state_dir), "--json", *args],
        cwd=harness.ROOT,
        env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.stdout, out.stderr
    return out.returncode, json.loads(out.stdout), out.stderr


def finding(report: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [f for f in report["findings"] if f["kind"] == kind]
    assert found, f"no {kind} finding in {json.dumps(report['findings'], indent=1)}"
    return found[0]


def all_hung(workdir: Path, world: int) -> Callable[[], bool]:
    def check() -> bool:
        s = harness.states(workdir)
        return len(s) == world and all(d.get("hang") for d in s.values())

    return check


def test_rank_stuck_outside_collective(tmp_path: Path) -> None:
    """Rank 2 never returns from its data loader; ranks 0 and 1 wait in the gradient
    all-reduce. Their watchdogs report while their main threads wait in C++."""
    procs = launch("stuck", 3, tmp_path, ("2", "4"))
    try:
        wait_for("every rank's hang report", all_hung(tmp_path, 3), procs, tmp_path)
        s = harness.states(tmp_path)
        for rank in (0, 1):
            hang = s[rank]["hang"]
            assert hang["threads"][0]["main"] and hang["threads"][0]["name"] == "MainThread"
            # torch's own innermost Python frame: autograd's engine call (2.2: backward itself)
            assert [f["function"] for f in hang["threads"][0]["frames"]][-1] in (
                "_engine_run_backward",
                "backward",
            )
            waits = hang["in_flight"]
            assert waits and all(e["op"] == "all_reduce" and e["bucket"] is not None for e in waits)
            assert waits[0]["call_site"] == "DDP backward" and waits[0]["bucket"] == 0
            assert waits[0]["age_seconds"] >= 2.0
            assert hang["timeout_seconds"] == 2.0 and hang["timeout_source"] == "configured"
        if tuple(int(x) for x in s[0]["torch_version"].split(".")[:2]) >= (2, 13):
            fr = s[0]["hang"]["flight_recorder"]  # gloo records into it from torch 2.13 on
            assert fr["entries"] and fr["entries"][-1]["profiling_name"] == "gloo:all_reduce"
            assert "0" in fr["pg_status"]
        stuck = s[2]["hang"]
        assert stuck["in_flight"] == [] and stuck["last_collective"]["op"] == "all_reduce"
        assert stuck["threads"][0]["frames"][-1]["function"] == "load_batch"
        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{s[0]['port']}/metrics", timeout=10)
            .read()
            .decode()
        )
        assert 'ddpmon_hang_suspected{job="stuck",rank="0"} 1.0' in metrics

        code, report, _ = doctor(tmp_path / "state")
        assert code == 1
        assert report["verdict"] == "hang" and report["suspect_ranks"] == [2]
        f = finding(report, "stuck_rank")
        assert f["ranks"] == [2] and f["severity"] == "error"
        assert any("in load_batch" in line for line in f["evidence"])
        assert any("rank 0" in line and "all_reduce" in line for line in f["evidence"])
        ranks = {r["rank"]: r for r in report["ranks"]}
        assert [ranks[r]["status"] for r in (0, 1, 2)] == ["waiting", "waiting", "stuck"]
        # live from py-spy where it may read the process, else from the rank's own hang report
        assert ranks[2]["stack"]["source"] in ("py-spy, live",) or ranks[2]["stack"][
            "source"
        ].startswith("its hang report")
        assert ranks[2]["stack"]["frames"][-1]["function"] == "load_batch"
        assert ranks[0]["waiting_in"]["op"] == "all_reduce"
    finally:
        harness.stop(procs)


def test_dead_rank_first_to_die(tmp_path: Path) -> None:
    """Rank 1's process ends abruptly; ranks 0 and 2 then crash on the closed connection.
    The doctor names rank 1 after all three are gone."""
    procs = launch("die", 3, tmp_path, ("1", "5"))
    try:
        wait_for(
            "every rank to end", lambda: all(p.poll() is not None for p in procs), procs, tmp_path
        )
        # rank 1 exits with 3; the others raise (1), or abort in gloo's teardown after that (-6)
        assert procs[1].returncode == 3 and procs[0].returncode != 0 and procs[2].returncode != 0
        code, report, _ = doctor(tmp_path / "state")
        assert code == 1
        assert report["verdict"] == "dead_rank" and report["suspect_ranks"] == [1]
        ranks = {r["rank"]: r for r in report["ranks"]}
        assert ranks[1]["status"] == "crashed" and ranks[1]["alive"] is False
        assert (ranks[1]["exit"]["code"], ranks[1]["exit"]["how"]) == (3, "os._exit")
        assert ranks[1]["exit"]["where"].endswith("in die")
        assert ranks[0]["status"] == ranks[2]["status"] == "crashed"
        assert "Connection" in ranks[0]["exit"]["exception"]
        f = finding(report, "dead_rank")
        assert f["summary"].startswith("rank 1 exited with status 3 first")
        assert "os._exit(3)" in f["fix"]
    finally:
        harness.stop(procs)


def test_desync_rank_conditional_barrier(tmp_path: Path) -> None:
    """Rank 1 issues a barrier the other rank never issues; rank 0 goes on to the next
    gradient all-reduce."""
    procs = launch("desync", 2, tmp_path, ("1", "4"))
    try:
        wait_for("every rank's hang report", all_hung(tmp_path, 2), procs, tmp_path)
        code, report, _ = doctor(tmp_path / "state")
        assert code == 1
        assert report["verdict"] == "desync" and report["suspect_ranks"] == [1]
        ranks = {r["rank"]: r for r in report["ranks"]}
        assert ranks[1]["waiting_in"]["op"] == "barrier"
        assert ranks[1]["waiting_in"]["call_site"] == site("# the odd rank's barrier")
        assert ranks[1]["waiting_in"]["function"] == "report_progress"
        assert (
            ranks[0]["waiting_in"]["op"] == "all_reduce" and ranks[0]["waiting_in"]["bucket"] == 0
        )
        assert ranks[0]["waiting_in"]["seq"] == ranks[1]["waiting_in"]["seq"]
        f = finding(report, "mismatch")  # the first collective where the ranks differ
        assert "the operation differs" in f["summary"]
        assert f"called from {site('report_progress(step)')} in desync" in f["summary"]
        assert "DistributedSampler(dataset, drop_last=True)" in f["fix"]
        assert "torch.distributed.algorithms.Join" in f["fix"]
        assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" not in f["fix"]  # gloo: never advise DETAIL
        assert "TORCH_DISTRIBUTED_DEBUG=INFO" in f["fix"]
    finally:
        harness.stop(procs)


def test_straggler_then_clean_end(tmp_path: Path) -> None:
    """Rank 1's forward takes 30 ms longer while the job progresses: straggler. Then the
    job ends cleanly, and the doctor says both: it finished, and rank 1 straggled."""
    procs = launch("straggle", 2, tmp_path, ("1", "0.03"))
    try:

        def enough_steps() -> bool:
            s = harness.states(tmp_path)
            return len(s) == 2 and all(
                (d.get("timings") or {}).get("window_steps", 0) >= 12 for d in s.values()
            )

        wait_for("12 steps on each rank", enough_steps, procs, tmp_path)
        time.sleep(SUSTAIN_SECONDS)  # a straggler is named once its gap lasted
        deadline = time.monotonic() + 15  # (the histories commit about once a second)
        code, report, _ = doctor(tmp_path / "state")
        while report.get("verdict") != "straggler" and time.monotonic() < deadline:
            time.sleep(1.0)
            code, report, _ = doctor(tmp_path / "state")
        assert code == 1, report
        assert report["verdict"] == "straggler" and report["suspect_ranks"] == [1]
        f = finding(report, "straggler")
        assert f["severity"] == "warning"
        assert any("confirmed: the slow rank waits least" in line for line in f["evidence"])
        ranks = {r["rank"]: r for r in report["ranks"]}
        assert ranks[1]["compute_seconds"] > ranks[0]["compute_seconds"] + 0.02
        assert ranks[1]["exposed_comm_seconds"] < ranks[0]["exposed_comm_seconds"]
        assert {r["status"] for r in report["ranks"]} == {"stepping"}

        (tmp_path / "stop").touch()
        wait_for("a clean end", lambda: all(p.poll() is not None for p in procs), procs, tmp_path)
        assert [p.returncode for p in procs] == [0, 0], harness.describe(
            harness.collect(procs, tmp_path)
        )
        code, report, _ = doctor(tmp_path / "state")
        assert code == 1
        assert report["verdict"] == "straggler" and report["suspect_ranks"] == [1]
        assert [f["kind"] for f in report["findings"]][:2] == ["straggler", "finished"]
        assert finding(report, "finished")["severity"] == "info"
        assert [r["status"] for r in report["ranks"]] == ["exited", "exited"]
    finally:
        harness.stop(procs)


def test_collectives_of_user_code_are_tracked(tmp_path: Path) -> None:
    procs = launch("all_kinds", 2, tmp_path)
    try:
        wait_for(
            "both ranks to finish",
            lambda: all(p.poll() is not None for p in procs),
            procs,
            tmp_path,
            60,
        )
    finally:
        harness.stop(procs)
    results = harness.collect(procs, tmp_path)
    assert all(r.returncode == 0 for r in results), harness.describe(results)
    for r in results:
        out = r.result
        assert out["wrapped_while_attached"] == {
            "all_reduce": True,
            "barrier": True,
            "broadcast": True,
        }
        assert out["restored_after_detach"] == {
            "all_reduce": True,
            "barrier": True,
            "broadcast": True,
        }
        snap = out["snapshot"]
        p2p = "send" if r.rank == 0 else "recv"
        # DDP buckets are counted once each, under torch's name like the rest
        assert out["by_op"] == {
            "all_reduce": [7, 7],
            "barrier": [1, 1],
            "broadcast": [1, 1],
            "all_gather": [1, 1],
            "all_gather_object": [1, 1],
            p2p: [1, 1],
        }
        assert snap["collectives"] == {"issued": 12, "completed": 12}
        assert snap["in_flight"] == []
        assert snap["collective_seq"] == {"0": 11, "p2p:0": 1}
        user = [e for e in snap["collective_log"] if e.get("bucket") is None]
        assert [(e["op"], e["bytes"]) for e in user] == [
            ("all_reduce", 1024),
            ("barrier", None),
            ("broadcast", 1024),
            ("all_reduce", 1024),
            ("all_gather", 1024),
            ("all_gather_object", None),
            (p2p, 16),
        ]
        assert [e["call_site"] for e in user[:4]] == [
            site(f"# user {what}")
            for what in ("all_reduce", "barrier", "broadcast", "async all_reduce")
        ]
        assert all(e["function"] == "all_kinds" and e["group"] == "0" for e in user)
        assert user[3]["async_op"] is True
        assert [e["seq"] for e in user[:6]] == [2, 3, 4, 5, 6, 7]
        buckets = [e for e in snap["collective_log"] if e.get("bucket") is not None]
        assert all(e["call_site"] == "DDP backward" and e["op"] == "all_reduce" for e in buckets)
        assert snap["collective_sites"]["all_reduce DDP backward (DDP bucket)"] == 5
        assert sorted(e["bucket"] for e in buckets[-4:]) == [0, 1, 2, 3]
        assert sum(e["bytes"] for e in buckets[-4:]) == buckets[0]["bytes"] == 60448
        assert out["gathered_objects"] == [{"rank": 0}, {"rank": 1}]


def _network_freeze_possible() -> bool:
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "nsenter", "tc", "ip")):
        return False
    probe = subprocess.run(
        [
            "unshare",
            "-n",
            "sh",
            "-c",
            "ip link set lo up && tc qdisc add dev lo root tbf rate 8bit burst 10 limit 1",
        ],
        capture_output=True,
        timeout=10,
    )
    return probe.returncode == 0


@pytest.mark.skipif(
    not _network_freeze_possible(),
    reason="needs root, unshare, nsenter and tc (tbf) to freeze a network",
)
def test_comm_layer_hang_nobody_behind(tmp_path: Path) -> None:
    """The ranks run in a network namespace of their own; mid-training its loopback link
    starts dropping every packet (tc tbf with a burst smaller than any packet). The TCP
    connections stall without an error: every rank waits in the same all-reduce."""
    holder = subprocess.Popen(["unshare", "-n", "sh", "-c", "ip link set lo up && exec sleep 600"])
    netns = f"--net=/proc/{holder.pid}/ns/net"
    procs: list[subprocess.Popen] = []
    try:
        time.sleep(0.3)
        procs = launch(
            "train_until_frozen",
            2,
            tmp_path,
            prefix=("nsenter", netns),
            env={"GLOO_SOCKET_IFNAME": "lo"},
        )

        def training() -> bool:
            s = harness.states(tmp_path)
            return len(s) == 2 and all(d.get("step", 0) >= 5 for d in s.values())

        wait_for("training", training, procs, tmp_path)
        subprocess.run(
            [
                "nsenter",
                netns,
                "tc",
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                "8bit",
                "burst",
                "10",
                "limit",
                "1",
            ],
            check=True,
            timeout=10,
        )
        wait_for("every rank's hang report", all_hung(tmp_path, 2), procs, tmp_path)
        code, report, _ = doctor(tmp_path / "state")
        assert code == 1
        assert report["verdict"] == "hang" and report["suspect_ranks"] == []
        f = finding(report, "comm_hang")
        assert f["ranks"] == [0, 1]
        assert "GLOO_SOCKET_IFNAME" in f["fix"] and "TORCH_DISTRIBUTED_DEBUG=DETAIL" not in f["fix"]
        assert {r["status"] for r in report["ranks"]} == {"waiting"}
    finally:
        harness.stop(procs)
        holder.kill()
        holder.wait(10)


def test_the_same_error_on_every_rank_is_one_bug_and_its_cause_named(tmp_path: Path) -> None:
    """Every rank leaves one layer unused with find_unused_parameters=False: each raises
    DDP's reduction error at the same line. No rank is "first": the code is the culprit,
    and the unused parameters are named as the error's cause."""
    procs = launch("unused_layer", 2, tmp_path)
    try:
        wait_for(
            "every rank to end", lambda: all(p.poll() is not None for p in procs), procs, tmp_path
        )
        assert [p.returncode for p in procs] == [1, 1]
        code, report, _ = doctor(tmp_path / "state")
        assert code == 1
        assert report["verdict"] == "dead_rank" and report["suspect_ranks"] == [0, 1]
        assert [f["kind"] for f in report["findings"] if f["severity"] == "error"] == ["same_error"]
        f = finding(report, "same_error")
        assert f["ranks"] == [0, 1]
        assert f["summary"].startswith(
            "every rank failed in the same place: a bug in the code, not one rank"
        )
        assert f"at {harness.ROOT}/{site('head_b never used')} in unused_layer" in f["summary"]
        assert (
            "its cause: 2 parameter(s) received no gradient in the step before (head_b.weight, head_b.bias)"
            in f["summary"]
        )
        assert "first" not in f["summary"]
        assert f["fix"].startswith(
            "Make head_b.weight, head_b.bias take part in the loss on every rank"
        )
        assert "find_unused_parameters=True" in f["fix"]
        assert not [f for f in report["findings"] if f["kind"] == "unused_parameters"], (
            "named once, as the cause"
        )
        text = subprocess.run(
            [sys.executable, "-m", "ddpmon", "doctor", str(tmp_path / "state")],
            cwd=harness.ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        assert text.startswith("ddpmon doctor: DEAD RANK - every rank failed in the same place"), (
            text
        )
    finally:
        harness.stop(procs)


def test_a_collective_gloo_aborts_on_is_a_desync_in_gloos_words(tmp_path: Path) -> None:
    """Rank 0 alone all-reduces a metric in its logging function while rank 1 all-reduces
    its next step's gradients: gloo aborts rank 0 (SIGABRT) on the size it did not expect,
    before its state file shows the call. The doctor calls it a desync, names both call
    sites, and quotes gloo's reason from rank 0's stderr (a file here)."""
    procs = launch("log_on_rank_0", 2, tmp_path, ("5",))
    try:
        wait_for(
            "every rank to end", lambda: all(p.poll() is not None for p in procs), procs, tmp_path
        )
        assert procs[0].returncode == -6, harness.describe(harness.collect(procs, tmp_path))
        code, report, _ = doctor(tmp_path / "state")
        assert code == 1
        assert report["verdict"] == "desync" and report["suspect_ranks"] == [0]
        f = finding(report, "mismatch")
        assert f["ranks"] == [0]
        # (gloo aborts rank 0 within a millisecond of its call: its state file, written every
        # 0.2 s, hardly ever shows the call; when it does, the calls are lined up by number)
        assert site("# rank 0's logging all-reduce") + " in log_metrics" in f["summary"]
        assert "DDP gradient bucket 0" in f["summary"]
        reason = next(
            line for line in f["evidence"] if "after gloo::EnforceNotMet" in line
        )  # gloo's own words
        assert (
            reason.startswith("rank 0: SIGABRT (Aborted), after gloo::EnforceNotMet: ")
            and "op.preamble.length" in reason
        )
        assert "Every rank must issue the same collectives in the same order" in f["fix"]
        assert not [x for x in report["findings"] if x["kind"] == "dead_rank"]
    finally:
        harness.stop(procs)
