"""lost_node on built state files: a node gone with its ranks is blamed, not the survivor
that saw the reset first; and the cases that look alike but are not a lost node.

Two nodes of two ranks each, numbered as torchrun numbers them (host-a: ranks 0, 1, node 0;
host-b: ranks 2, 3, node 1). The real jobs are in tests/hosts/test_two_hosts.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ddpmon.collectors.host import Liveness
from ddpmon.doctor import examine, rules
from ddpmon.doctor.load import Unreachable, load_dir
from ddpmon.doctor.rules import files as file_rules
from ddpmon.doctor.rules import lost_node
from ddpmon.doctor.view import view
from tests.support import states
from tests.support.states import state, waiting_in, write

RESET = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[10.77.0.2]:3758: Connection reset by peer. This is typically caused by a remote worker hanging"
)
DAEMON_B = Unreachable("10.77.0.2:9490", "[Errno 111] Connection refused", ["10.77.0.2"])


def rank(r: int, **fields: Any) -> dict[str, Any]:
    host = "host-a" if r < 2 else "host-b"
    return state(r, world=4, host=host, local_rank=r % 2, group_rank=r // 2, **fields)


def crashed(r: int, error: str = RESET) -> dict[str, Any]:
    """A rank that failed: its exit record, ``error`` its exception."""
    return rank(
        r,
        stage="allreduce",
        exit={
            "unix": states.NOW,
            "exception": error,
            "where": "train.py:40 in train",
            "code": 1,
            "how": "exception",
        },
    )


def decide(directory: Path, unreachable: tuple[Unreachable, ...] = ()) -> rules.Verdict:
    """The verdict on the files of ``directory`` (ranks on other hosts: no process checked),
    with ``unreachable`` the daemons that did not answer."""
    loaded = load_dir(str(directory))
    files, _world, missing, _ = file_rules.membership(loaded.files)
    vs = [view(f, Liveness(None, "on another host"), states.NOW, None) for f in files]
    return rules.decide(vs, missing, unreachable)


def test_unreachable_node_is_blamed_not_the_survivor_that_saw_the_reset(tmp_path: Path) -> None:
    write(tmp_path, crashed(0), age=2.0)
    write(tmp_path, crashed(1), age=1.8)
    verdict, suspects, findings = decide(tmp_path, (DAEMON_B,))
    assert (verdict, suspects) == ("dead_rank", [2, 3])
    f = findings[0]
    assert (f.kind, f.ranks) == ("lost_node", [2, 3])
    assert f.summary.startswith(
        "node 1 (GROUP_RANK 1) at 10.77.0.2:9490 is lost: its daemon does not answer "
        "and ranks 2, 3 left no state file"
    )
    assert f.summary.endswith("ranks 0, 1 failed on connections to it")
    assert "the daemon 10.77.0.2:9490 does not answer: [Errno 111] Connection refused" in f.evidence
    assert (
        "ranks 2, 3 are node 1 (GROUP_RANK 1): the ranks seen are numbered rank = GROUP_RANK x 2 + LOCAL_RANK"
        in f.evidence
    )
    assert (
        "rank 0 lost its connection to 10.77.0.2, the address of the unreachable daemon 10.77.0.2:9490"
        in f.evidence
    )
    assert "Check node 1 (GROUP_RANK 1) at 10.77.0.2:9490" in f.fix
    # the missing ranks are named by lost_node, not again as a warning
    assert file_rules.missing_ranks([2, 3], 4, set(), findings) == []


def test_without_the_unreachable_daemon_the_missing_ranks_are_not_a_lost_node(
    tmp_path: Path,
) -> None:
    """One node's own directory: the other node's ranks were never here to begin with."""
    write(tmp_path, crashed(0), age=2.0)
    write(tmp_path, crashed(1), age=1.8)
    _, _, findings = decide(tmp_path)
    assert "lost_node" not in [f.kind for f in findings]


def test_survivors_that_only_wait_are_not_enough(tmp_path: Path) -> None:
    """A cut link looks the same from here: the others wait, the far daemon does not answer."""
    for r in (0, 1):
        write(tmp_path, rank(r, silent=8.0, in_flight=[waiting_in("all_reduce", 14, 8.0, size=4)]))
    verdict, suspects, findings = decide(tmp_path, (DAEMON_B,))
    assert (verdict, suspects, findings[0].kind) == ("hang", [2, 3], "missing_rank")


def test_a_survivor_with_an_error_of_its_own_is_the_culprit(tmp_path: Path) -> None:
    write(tmp_path, crashed(0, "ValueError: bad batch"), age=3.0)
    write(tmp_path, crashed(1), age=1.8)
    verdict, suspects, findings = decide(tmp_path, (DAEMON_B,))
    assert (verdict, suspects, findings[0].kind) == ("dead_rank", [0], "dead_rank")


def test_a_whole_host_that_stopped_writing_in_a_shared_directory(tmp_path: Path) -> None:
    """host-b's files stopped 5 s ago, before host-a's ranks failed on connections (3 s
    ago): not yet stale (10 s), yet gone. Without that, rank 0 would be blamed."""
    write(tmp_path, crashed(0), age=3.0)
    write(tmp_path, crashed(1), age=2.9)
    for r in (2, 3):
        write(
            tmp_path,
            rank(r, stage="allreduce", in_flight=[waiting_in("all_reduce", 14, 0.05, size=4)]),
            age=5.0,
        )
    d = examine(str(tmp_path), live_stacks=False, now=states.NOW)
    assert (d.verdict, d.suspect_ranks) == ("dead_rank", [2, 3])
    f = d.findings[0]
    assert f.kind == "lost_node"
    assert f.summary == (
        "host host-b is lost: ranks 2, 3 stopped writing their state files together; "
        "ranks 0, 1 failed on connections to it"
    )
    assert "rank 0 lost its connection to 10.77.0.2" in f.evidence
    assert [v.status for v in d.ranks] == ["crashed", "crashed", "silent", "silent"]


def test_a_far_rank_still_writing_is_not_gone(tmp_path: Path) -> None:
    """host-b's ranks wrote after host-a's failed: alive (their own end is still to come)."""
    write(tmp_path, crashed(0), age=3.0)
    write(tmp_path, crashed(1), age=2.9)
    for r in (2, 3):
        write(tmp_path, rank(r), age=0.5)
    d = examine(str(tmp_path), live_stacks=False, now=states.NOW)
    assert "lost_node" not in [f.kind for f in d.findings]
    assert [v.status for v in d.ranks][2:] == ["stepping", "stepping"]


def test_one_far_rank_killed_is_the_first_to_die_not_a_lost_node(tmp_path: Path) -> None:
    """Rank 2 vanished (the OOM killer) and the others failed on connections, rank 3 of its
    own host too: rank 2 is named within seconds, not the survivor that failed first."""
    write(tmp_path, crashed(0), age=3.0)
    write(tmp_path, crashed(1), age=2.9)
    write(tmp_path, crashed(3), age=2.9)
    write(tmp_path, rank(2), age=5.0)
    d = examine(str(tmp_path), live_stacks=False, now=states.NOW)
    assert (d.verdict, d.suspect_ranks, d.findings[0].kind) == ("dead_rank", [2], "dead_rank")


def test_ranks_per_node_only_when_the_ranks_are_numbered_by_node(tmp_path: Path) -> None:
    write(tmp_path, crashed(0))
    write(tmp_path, crashed(1))
    vs = examine(str(tmp_path), live_stacks=False, now=states.NOW).ranks
    assert lost_node.ranks_per_node(vs) == 2
    for v in vs:
        v.state.group_rank = 1  # ranks 0, 1 on node 1: not torchrun's numbering
    assert lost_node.ranks_per_node(vs) is None


def test_far_ranks_that_stopped_just_before_the_failure_are_waited_for(tmp_path: Path) -> None:
    """0.5 s after host-a's ranks failed on connections, host-b's files (1 s old) may yet be
    rewritten: the doctor waits until they would have been (at most a few seconds) and
    reads again, rather than blame the first survivor to fail."""
    write(tmp_path, crashed(0), age=0.5)
    write(tmp_path, crashed(1), age=0.4)
    for r in (2, 3):
        write(tmp_path, rank(r), age=1.0)
    started = time.monotonic()
    d = examine(str(tmp_path), live_stacks=False)
    took = time.monotonic() - started
    assert (d.verdict, d.suspect_ranks, d.findings[0].kind) == ("dead_rank", [2, 3], "lost_node")
    assert 1.5 < took < 6.0


def test_survivors_that_timed_out_cannot_tell_a_dead_node_from_a_cut_link(tmp_path: Path) -> None:
    timeout = (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
        "waiting 60000ms for recv operation to complete"
    )
    write(tmp_path, crashed(0, timeout), age=2.0)
    write(tmp_path, crashed(1, timeout), age=1.8)
    verdict, suspects, findings = decide(tmp_path, (DAEMON_B,))
    assert (verdict, suspects, findings[0].kind) == ("dead_rank", [2, 3], "lost_node")
    assert findings[0].summary.startswith(
        "node 1 (GROUP_RANK 1) at 10.77.0.2:9490 is lost or cut off:"
    )
    assert (
        "no connection was closed by the far end (ranks 0, 1 timed out): the node is down, or the "
        "network to it is cut"
    ) in findings[0].evidence


def test_a_survivor_that_has_not_failed_yet_does_not_hide_the_node(tmp_path: Path) -> None:
    """A moment after the node died, rank 1 failed on its connection while rank 0 made
    progress just before and has yet to reach the collective that fails."""
    write(tmp_path, crashed(1), age=0.2)
    write(tmp_path, rank(0, silent=0.3), age=0.1)
    verdict, suspects, findings = decide(tmp_path, (DAEMON_B,))
    assert (verdict, suspects, findings[0].kind) == ("dead_rank", [2, 3], "lost_node")
    assert findings[0].summary.endswith("; rank 1 failed on connections to it")


def test_a_silent_host_while_the_others_step_on_is_not_a_lost_node(tmp_path: Path) -> None:
    """host-b's files stopped 15 s ago but host-a's ranks keep stepping: nobody misses host-b
    in a collective, so something else stopped its files (its writer, its mount)."""
    for r in (0, 1):
        write(tmp_path, rank(r), age=0.2)
    for r in (2, 3):
        write(tmp_path, rank(r), age=15.0)
    d = examine(str(tmp_path), live_stacks=False, now=states.NOW)
    assert [v.status for v in d.ranks] == ["stepping", "stepping", "silent", "silent"]
    assert "lost_node" not in [f.kind for f in d.findings]
