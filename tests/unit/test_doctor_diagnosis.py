"""The doctor's newer rules on state files built from the schema's records: collectives
that differ under one sequence number, ranks busy outside a step, exit statuses, names and
ranks folded. (--job choosing its directory: tests/processes/test_doctor_cli.py.)"""

from __future__ import annotations

from pathlib import Path

from ddpmon.doctor import examine, words
from ddpmon.doctor.report import group_lines, render
from tests.support import states
from tests.support.states import kinds, state, waiting_in, write


def test_the_first_mismatched_collective_is_named_with_its_field_ranks_and_sites(tmp_path: Path) -> None:
    done = [dict(waiting_in("all_reduce", s, 0.0, bucket=0), completed_unix=states.NOW) for s in (1, 2, 3)]
    for r in range(3):
        numel = 1000 if r == 1 else 10
        metric = waiting_in("all_reduce", 4, 9.0, site="train.py:40", size=3, dtype="float32", numel=numel)
        write(tmp_path, state(r, world=3, silent=9.0, collective_log=done, in_flight=[metric]))
    d = examine(str(tmp_path), live_stacks=False)
    assert (d.verdict, d.suspect_ranks, kinds(d)[0]) == ("desync", [1], "mismatch")
    f = d.findings[0]
    assert "as #4 of group 0: the element count differs" in f.summary
    assert "ranks 0, 2: all_reduce (10 elements, float32) at train.py:40" in f.summary
    assert "rank 1: all_reduce (1000 elements, float32) at train.py:40" in f.summary
    assert "Pad to a common size" in f.fix


def test_ranks_waiting_for_a_busy_rank_are_not_hung(tmp_path: Path) -> None:
    busy = {"state": "busy", "sampled_unix": states.NOW, "still_seconds": 0.5, "cpu_share": 0.98,
            "where": "train.py:88 in save_checkpoint", "hang_timeout_seconds": 60.0}
    write(tmp_path, state(0, world=3, silent=12.0, activity=busy))
    for r in (1, 2):
        write(tmp_path, state(r, world=3, silent=12.0, in_flight=[waiting_in("barrier", 9, 12.0, size=3)],
                              activity=dict(busy, state="waiting", where="train.py:90 in main")))
    d = examine(str(tmp_path), live_stacks=False)
    assert (d.verdict, d.suspect_ranks, kinds(d)[0]) == ("healthy", [], "busy")
    assert d.findings[0].summary.startswith("ranks 1, 2 have waited ")
    assert " s in barrier #9 (group 0, issued at train.py:88 in train_step)" in d.findings[0].summary
    assert "for rank 0, busy outside the training step (rank 0 in train.py:88 in save_checkpoint)" in d.findings[0].summary
    # busy for longer than 5 hang timeouts: stuck, a hang
    write(tmp_path, state(0, world=3, silent=400.0, activity=busy))
    d = examine(str(tmp_path), live_stacks=False)
    assert (d.verdict, d.suspect_ranks) == ("hang", [0])


POST_LOOP = "tests/scenarios/worker.py:84 in <genexpr>"


def test_ranks_starved_after_the_loop_are_busy_not_hung(tmp_path: Path) -> None:
    """The false hang after the training loop, as two ranks' files read 6.5 s after their
    last step on a machine with more runnable threads than cores. Rank 0 last wrote its
    file 2.5 s into its silence (its process got no CPU since), when its watchdog's sample
    said stepping; rank 1's watchdog says busy: 0.8% of a core, waiting for one 95% of the
    time. Read as stuck, rank 0 made the answer 'hang'."""
    stepping = {"state": "stepping", "sampled_unix": states.NOW - 4.0 - 0.01, "still_seconds": 1.4,
                "where": POST_LOOP, "hang_timeout_seconds": 60.0}
    busy = {"state": "busy", "sampled_unix": states.NOW - 0.5, "still_seconds": 4.1, "cpu_share": 0.008,
            "wait_share": 0.95, "where": POST_LOOP, "hang_timeout_seconds": 60.0}
    write(tmp_path, state(0, silent=2.5, phase="after_optimizer", activity=stepping), age=4.0)
    write(tmp_path, state(1, silent=6.0, phase="after_optimizer", activity=busy), age=0.5)
    d = examine(str(tmp_path), live_stacks=False)
    assert [v.status for v in d.ranks] == ["busy", "busy"]
    assert (d.verdict, d.suspect_ranks, kinds(d)[0]) == ("healthy", [], "busy")
    assert "its watchdog last sampled it 2.5 s into this silence (stepping), too soon to judge" in d.findings[0].evidence[0]
    assert "(main thread waiting for a CPU 95% of the time)" in d.findings[0].evidence[1]
    # its watchdog has said nothing for 6 s before that write: silence decides again
    stepping["sampled_unix"] = states.NOW - 4.0 - 6.0
    write(tmp_path, state(0, silent=2.5, phase="after_optimizer", activity=stepping), age=4.0)
    d = examine(str(tmp_path), live_stacks=False)
    assert (d.verdict, d.suspect_ranks) == ("hang", [0])


def test_a_job_ended_while_busy_after_the_loop_is_not_replayed_as_a_hang(tmp_path: Path) -> None:
    """Every process gone (ended from outside) while busy after the loop: at their last
    writes they were working, not stalled, so the doctor does not put them back in a stall."""
    busy = {"state": "busy", "sampled_unix": states.NOW - 30.2, "still_seconds": 5.0, "cpu_share": 0.9,
            "where": POST_LOOP, "hang_timeout_seconds": 60.0}
    for r in range(2):
        write(tmp_path, state(r, silent=6.0, activity=busy), age=30.0 + r / 10)
    d = examine(str(tmp_path), live_stacks=False)
    assert d.verdict != "hang" and "ended_while_hung" not in kinds(d)
    stuck = dict(busy, state="stuck", cpu_share=0.0)
    for r in range(2):
        write(tmp_path, state(r, silent=6.0, activity=stuck), age=30.0 + r / 10)
    d = examine(str(tmp_path), live_stacks=False)
    assert (d.verdict, d.suspect_ranks) == ("hang", [0, 1]) and "ended_while_hung" in kinds(d)


def test_a_non_zero_exit_status_is_a_failure(tmp_path: Path) -> None:
    write(tmp_path, state(0, silent=5.0, exit={"unix": states.NOW - 5, "code": 3, "how": "sys.exit",
                                                "where": "train.py:12 in main"}))
    write(tmp_path, state(1, silent=9.0, in_flight=[waiting_in("all_reduce", 7, 9.0)]))
    d = examine(str(tmp_path), live_stacks=False)
    assert (d.verdict, d.suspect_ranks) == ("dead_rank", [0])
    assert d.findings[0].summary.startswith("rank 0 exited with status 3 first")
    assert "called sys.exit(3) at train.py:12 in main" in d.findings[0].fix


def test_names_and_ranks_are_folded_never_dropped(tmp_path: Path) -> None:
    names = [f"layers.{i}.attn.weight" for i in range(32)] + [f"head{i}.bias" for i in "abcdefghij"]
    for r in range(2):
        write(tmp_path, state(r, unused_parameters=names))
    d = examine(str(tmp_path), live_stacks=False)
    unused = [f for f in d.findings if f.kind == "unused_parameters"]
    assert len(unused) == 1 and unused[0].ranks == [0, 1]
    assert "ranks 0, 1: 42 parameter(s)" in unused[0].summary
    assert "layers.{0-31}.attn.weight" in unused[0].summary
    assert len(unused[0].evidence) == 11 and "unused: headj.bias" in unused[0].evidence
    assert words.ranks([0, 1, 2, 3, 5, 7, 8, 9]) == "0\u20133, 5, 7\u20139"


def test_a_thousand_ranks_fit_one_screen(tmp_path: Path) -> None:
    lines = [f"rank {r} (host node-{r // 8}, pid {4000 + r}) has waited 9.0 s in all_reduce #14, step 3"
             for r in range(1024) if r != 341]
    assert group_lines(lines) == ["ranks 0\u2013340, 342\u20131023 have waited 9.0 s in all_reduce #14, step 3"]
    for r in range(40):
        write(tmp_path, state(r, world=40, host=f"node-{r // 8}", silent=9.0,
                              in_flight=[waiting_in("all_reduce", 14, 9.0, size=40)] if r != 7 else []))
    text = render(examine(str(tmp_path), live_stacks=False), width=100)
    assert len(text.splitlines()) < 40
    assert "0\u20136, 8\u201339" in text
