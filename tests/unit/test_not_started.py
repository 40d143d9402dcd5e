"""The doctor on a job that has not reached its first step (rules/not_started.py), from
state files as ranks write them under ``ddpmon run`` before their DDP model exists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddpmon.doctor import examine
from tests.support import states
from tests.support.states import state, write


def early(rank: int, stage: str, since: float, where: str | None, world: int = 3, **up: Any):
    """A rank's file before its first step: in ``stage`` for ``since`` seconds."""
    now = states.NOW
    activity = {"state": "stuck", "sampled_unix": now, "where": where, "callers": []}
    startup = {"process_started_unix": now - 60, "stage_since_unix": now - since, **up}
    return state(
        rank,
        world=world,
        steps=0,
        step_s=0.0,
        stage=stage,
        step=0,
        startup=startup,
        activity=activity,
        timings={},
        last_progress_unix=now - since,
    )


def test_a_late_rank_is_named_with_where_it_is_and_a_rank_without_a_process_apart(
    tmp_path: Path,
) -> None:
    store = {"backend": "gloo", "store": "10.0.0.1:29500", "init_started_unix": states.NOW - 30}
    write(tmp_path, early(0, "init_process_group", 30.0, "train.py:13 in <module>", **store))
    write(tmp_path, early(1, "starting", 32.0, "train.py:5 in prepare_dataset"))
    d = examine(str(tmp_path))  # rank 2: no file at all
    assert d.verdict == "not_started" and d.suspect_ranks == [1, 2], d.as_dict()
    finding = d.findings[0]
    assert finding.kind == "not_arrived"
    assert "rank 0 waits in init_process_group at 10.0.0.1:29500 for 30." in finding.summary
    assert "rank 1 has not arrived: in prepare_dataset, train.py:5, starting for 32." in (
        finding.summary
    )
    assert "rank 2 has no process (never started)" in finding.summary
    assert any(e.startswith("rank 2: no state file") for e in finding.evidence)
    assert "backend gloo, store 10.0.0.1:29500" in " ".join(finding.evidence)
    assert f"py-spy dump --pid {states.PID_BASE + 1}" in finding.fix


def test_every_rank_in_rendezvous_points_at_the_store(tmp_path: Path) -> None:
    for r in (0, 1):
        write(
            tmp_path,
            early(
                r, "rendezvous", 20.0, "train.py:13 in <module>", world=2, store="10.9.9.9:29500"
            ),
        )
    d = examine(str(tmp_path))
    assert d.verdict == "not_started" and d.suspect_ranks == []
    assert "MASTER_ADDR" in d.findings[0].fix


def test_ranks_all_on_their_own_are_starting_not_a_problem(tmp_path: Path) -> None:
    for r in (0, 1):
        write(tmp_path, early(r, "starting", 3.0, "train.py:5 in load", world=2))
    d = examine(str(tmp_path))
    assert d.verdict == "healthy" and [f.kind for f in d.findings][:1] == ["starting"]


def test_a_short_wait_for_a_rank_still_importing_is_a_job_starting(tmp_path: Path) -> None:
    """Ranks never arrive together: transformers.Trainer's rank 1 waited 47 ms in
    init_process_group while rank 0 still imported, and the doctor answered not_started,
    rank 0. A wait is a finding once it is a stall (5 s before any step)."""
    store = {"backend": "gloo", "store": "127.0.0.1:29500"}
    write(tmp_path, early(0, "starting", 17.5, "train.py:8 in <module>", world=3))
    write(tmp_path, early(1, "init_process_group", 4.0, "train.py:30 in <module>", **store))
    d = examine(str(tmp_path))  # rank 2: no file yet
    assert (d.verdict, d.suspect_ranks) == ("healthy", []), d.as_dict()
    assert d.findings[0].kind == "starting" and d.findings[0].severity == "info"
    assert "rank 1 in <module>, train.py:30, init_process_group for 40" in d.findings[0].summary
    assert "rank 2 not yet there" in d.findings[0].summary
    assert [f.kind for f in d.findings] == ["starting"]  # not missing_ranks either
    write(tmp_path, early(1, "init_process_group", 6.0, "train.py:30 in <module>", **store))
    d = examine(str(tmp_path))
    assert (d.verdict, d.suspect_ranks) == ("not_started", [0, 2]), d.as_dict()
    assert "missing_ranks" not in [f.kind for f in d.findings]  # not_arrived names rank 2


def test_a_job_that_stepped_is_not_judged_by_its_start(tmp_path: Path) -> None:
    write(tmp_path, state(0, stage="forward"))
    write(tmp_path, state(1, stage="forward"))
    assert examine(str(tmp_path)).verdict == "healthy"


def test_a_launcher_whose_ranks_have_not_written_yet_is_a_job_starting(tmp_path: Path) -> None:
    """``ddpmon run`` started the ranks (their Python still starting): no rank file yet."""
    import json
    import os
    import time

    from ddpmon.state import launcher

    now = time.time()
    path = launcher.path_for(str(tmp_path), "node-a", 4242)

    def launched(refused_for: float) -> None:
        """Its store refused it for ``refused_for`` seconds so far (--standalone: its own
        store, coming up)."""
        refused = launcher.Attempt(
            "refused", "[Errno 111] Connection refused", now - refused_for, now
        )
        record = launcher.LauncherState(
            host="node-a",
            pid=4242,
            started_unix=now - 3,
            endpoint="127.0.0.1:29500",
            rdzv_backend="c10d",
            stage=launcher.LauncherStage.RENDEZVOUS,
            attempts=[refused],
            now_unix=now,
        )
        with open(path, "w") as f:
            json.dump(launcher.to_json(record), f)

    launched(refused_for=2.0)
    d = examine(str(tmp_path))
    assert d.verdict == "healthy", d.as_dict()
    assert [(f.kind, f.severity) for f in d.findings] == [("starting", "info")]
    assert d.findings[0].summary == (
        "the job is starting: node-a's launcher is in rendezvous, and no rank has "
        "written its state yet"
    )
    launched(refused_for=15.0)  # refused for longer than a store takes to come up
    d = examine(str(tmp_path))
    assert d.verdict == "not_started" and d.findings[0].kind == "master_unreachable"
    old = time.time() - 60  # a launcher that stopped writing a minute ago: nothing to diagnose
    os.utime(path, (old, old))
    assert examine(str(tmp_path)).verdict == "no_data"


def test_a_c10d_rendezvous_short_of_nodes_says_how_many_of_how_many_joined(
    tmp_path: Path,
) -> None:
    """--rdzv-backend c10d assigns no node ranks before it completes: the doctor reads what
    torch's rendezvous knows (in the launcher's record) and counts the absent nodes, naming
    apart a node that started and cannot reach the endpoint."""
    import json
    import time

    from ddpmon.state import launcher

    now = time.time()

    def launched(host: str, waited: float, joined: list[str] | None, refused: float = 0.0):
        seen = launcher.Rendezvous(2, 2, joined=joined) if joined is not None else None
        attempts = (
            [launcher.Attempt("refused", "[Errno 111] Connection refused", now - refused, now)]
            if refused
            else []
        )
        record = launcher.LauncherState(
            host=host,
            pid=4242,
            started_unix=now - waited - 1,
            stage_since_unix=now - waited,
            endpoint="node-a:29400",
            rdzv_backend="c10d",
            nnodes="2",
            stage=launcher.LauncherStage.RENDEZVOUS,
            rendezvous=seen,
            attempts=attempts,
            now_unix=now,
        )
        path = launcher.path_for(str(tmp_path), host, 4242)
        with open(path, "w") as f:
            json.dump(launcher.to_json(record), f)

    launched("node-a", 5.0, ["node-a"])  # a few seconds: the other node may be starting
    d = examine(str(tmp_path))
    assert d.verdict == "healthy" and [f.kind for f in d.findings] == ["starting"], d.as_dict()
    launched("node-a", 25.0, ["node-a"])
    d = examine(str(tmp_path))
    assert d.verdict == "not_started" and d.findings[0].kind == "node_missing", d.as_dict()
    assert d.findings[0].summary == (
        "the c10d rendezvous at node-a:29400 has 1 of 2 nodes after 25.0 s (node-a joined); "
        "1 node never arrived: no launcher of its is seen"
    )
    assert "--rdzv-endpoint node-a:29400" in d.findings[0].fix
    launched("node-b", 20.0, None, refused=20.0)  # it started, and is refused
    d = examine(str(tmp_path))
    kinds = {f.kind: f for f in d.findings}
    assert set(kinds) == {"master_unreachable", "node_missing"}, d.as_dict()
    assert kinds["node_missing"].summary == (
        "the c10d rendezvous at node-a:29400 has 1 of 2 nodes after 25.0 s (node-a joined); "
        "node-b started and cannot reach it"
    )
