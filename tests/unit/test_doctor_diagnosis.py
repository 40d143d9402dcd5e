"""The doctor's newer rules on state files built from the schema's records: collectives
that differ under one sequence number, ranks busy outside a step, exit statuses, names and
ranks folded. (--job choosing its directory: tests/processes/test_doctor_cli.py.)"""

from __future__ import annotations

from pathlib import Path

from ddpmon.doctor import examine, words
from ddpmon.doctor.report import group_lines, render
from tests.support import states
from tests.support.states import kinds, state, waiting_in, write


def test_the_first_mismatched_collective_is_named_with_its_field_ranks_and_sites(
    tmp_path: Path,
) -> None:
    done = [
        dict(waiting_in("all_reduce", s, 0.0, bucket=0), completed_unix=states.NOW)
        for s in (1, 2, 3)
    ]
    for r in range(3):
        numel = 1000 if r == 1 else 10
        metric = waiting_in(
            "all_reduce", 4, 9.0, site="train.py:40", size=3, dtype="float32", numel=numel
        )
        write(tmp_path, state(r, world=3, silent=9.0, collective_log=done, in_flight=[metric]))
    d = examine(str(tmp_path), live_stacks=False)
    assert (d.verdict, d.suspect_ranks, kinds(d)[0]) == ("desync", [1], "mismatch")
    f = d.findings[0]
    assert "as #4 of group 0: the element count differs" in f.summary
    assert "ranks 0, 2: all_reduce (10 elements, float32) at train.py:40" in f.summary
    assert "rank 1: all_reduce (1000 elements, float32) at train.py:40" in f.summary
    assert "Pad to a common size" in f.fix


def test_ranks_waiting_for_a_busy_rank_are_not_hung(tmp_path: Path) -> None:
    busy = {
        "state": "busy",
        "sampled_unix": states.NOW,
        "still_seconds": 0.5,
        "cpu_share": 0.98,
        "where": "train.py:88 in save_checkpoint",
        "hang_timeout_seconds": 60.0,
    }
    write(tmp_path, state(0, world=3, silent=12.0, activity=busy))
    for r in (1, 2):
        write(
            tmp_path,
            state(
                r,
                world=3,
                silent=12.0,
                in_flight=[waiting_in("barrier", 9, 12.0, size=3)],
                activity=dict(busy, state="waiting", where="train.py:90 in main"),
            ),
        )
    d = examine(str(tmp_path), live_stacks=False)
    assert (d.verdict, d.suspect_ranks, kinds(d)[0]) == ("healthy", [], "busy")
    assert d.findings[0].summary.startswith("ranks 1, 2 have waited ")
    assert (
        " s in barrier #9 (group 0, issued at train.py:88 in train_step)" in d.findings[0].summary
    )
    assert (
        "for rank 0, busy outside the training step (rank 0 in train.py:88 in save_checkpoint)"
        in d.findings[0].summary
    )
    assert "timeout" not in d.findings[0].summary  # their files do not say it
    # busy for many hang timeouts: still working, still not a hang; the process group's own
    # timeout (30 min) is what ends the wait, and when is said
    write(tmp_path, state(0, world=3, silent=1200.0, activity=busy))
    for r in (1, 2):
        write(
            tmp_path,
            state(
                r,
                world=3,
                silent=1200.0,
                in_flight=[waiting_in("barrier", 9, 1200.0, size=3)],
                activity=dict(busy, state="waiting"),
                group_timeout_seconds=1800.0,
            ),
        )
    d = examine(str(tmp_path), live_stacks=False)
    assert (d.verdict, d.suspect_ranks, kinds(d)[0]) == ("healthy", [], "busy")
    assert d.findings[0].summary.startswith("ranks 1, 2 have waited 1200 s in barrier #9")
    assert d.findings[0].summary.endswith(
        "not a hang; should rank 0 never join, the process group's timeout (1800 s) ends the job in about 600 s"
    )


def _at(
    where: str, *callers: str, loops: list[list[int]] | None = None, sampled: float = 0.0
) -> dict[str, object]:
    """A waiting rank's activity: where its main thread is, the user frames that led there
    and the loops they are in (not known when None)."""
    act = {
        "state": "waiting",
        "sampled_unix": states.NOW - sampled,
        "still_seconds": 8.0,
        "where": where,
        "callers": list(callers),
        "hang_timeout_seconds": 60.0,
    }
    if loops is not None:
        act["loops"] = loops
    return act


def _stepping(**fields: object) -> dict[str, object]:
    """In DDP's all-reduce, from the loop's train_step call (train.py:30; the loop is lines 26-31)."""
    act = _at(
        "train.py:12 in train_step",
        "train.py:30 in main",
        "train.py:40 in <module>",
        loops=[[], [26, 31], []],
    )
    act.update(fields)
    return act


def _uneven(tmp_path: Path, world: int, more: list[int]) -> None:
    """Ranks in ``more`` run another step (DDP's bucket #7, the loop's train_step call at
    train.py:30 in main) while the others wait in the final barrier (#7, train.py:34)."""
    done = [
        dict(waiting_in("all_reduce", s, 0.0, bucket=0, size=world), completed_unix=states.NOW)
        for s in (5, 6)
    ]
    for r in range(world):
        if r in more:
            entry = waiting_in(
                "all_reduce", 7, 9.0, site="DDP backward", size=world, bucket=0, function="backward"
            )
            act = _stepping()
        else:
            entry = waiting_in(
                "barrier",
                7,
                9.0,
                site="train.py:34",
                size=world,
                function="main",
                callers=["train.py:40 in <module>"],
            )
            act = _at("train.py:34 in main", "train.py:40 in <module>", loops=[[], []])
        write(
            tmp_path,
            state(
                r,
                world=world,
                silent=9.0,
                steps=6,
                collective_log=done,
                in_flight=[entry],
                activity=act,
            ),
        )


def test_uneven_inputs_name_the_odd_side_and_with_two_ranks_the_one_with_more(
    tmp_path: Path,
) -> None:
    _uneven(tmp_path / "two", 2, more=[1])
    d = examine(str(tmp_path / "two"), live_stacks=False)
    assert (d.verdict, d.suspect_ranks, kinds(d)[0]) == ("desync", [1], "mismatch")
    assert d.findings[0].summary.startswith(
        "rank 1 has more batches than rank 0 (uneven inputs): as #7 of group 0"
    )
    assert d.findings[0].fix.startswith(words.FIX_UNEVEN)
    _uneven(tmp_path / "fewer", 3, more=[0, 2])  # rank 1 ran out of batches: the minority
    d = examine(str(tmp_path / "fewer"), live_stacks=False)
    assert (d.verdict, d.suspect_ranks) == ("desync", [1])
    assert d.findings[0].summary.startswith(
        "rank 1 has fewer batches than ranks 0, 2 (uneven inputs): as #7 of group 0, ranks 0, 2 run another "
        "training step (all_reduce of DDP gradient bucket 0) while rank 1 has gone past the training loop to "
        "barrier at train.py:34 in main"
    )
    _uneven(tmp_path / "more", 3, more=[2])
    d = examine(str(tmp_path / "more"), live_stacks=False)
    assert (d.verdict, d.suspect_ranks) == ("desync", [2])
    assert d.findings[0].summary.startswith(
        "rank 2 has more batches than ranks 0, 1 (uneven inputs)"
    )


def test_a_rank_conditional_collective_the_other_rank_went_past_is_named(tmp_path: Path) -> None:
    """Two ranks, no majority: rank 1 calls a barrier from a helper in the loop that rank 0
    went past; rank 0 is in DDP's all-reduce (train.py:30, the loop is lines 26-31). At the
    top of the body (line 28) it is behind rank 0 in the same pass; at the end of the body
    (line 31, after its step) it is a pass behind: rank 0 began the next step. Either way
    its barrier is the one too many, not an uneven input: it is still in the loop."""
    done = [
        dict(waiting_in("all_reduce", s, 0.0, bucket=0), completed_unix=states.NOW) for s in (5, 6)
    ]
    bucket = waiting_in("all_reduce", 7, 9.0, site="DDP backward", bucket=0, function="backward")
    for line, evidence in (
        (
            28,
            "at the same step (6), rank 0 is at line 30 of main (train.py), rank 1 at line 28: "
            "rank 0 went past the place of rank 1's collective without issuing it",
        ),
        (
            31,
            "at the same step (6), rank 0 is in the next pass of the loop (lines 26-31 of main (train.py)), "
            "at line 30, rank 1 at line 31, the end of the pass before: rank 0 went past the place of "
            "rank 1's collective without issuing it",
        ),
    ):
        write(
            tmp_path,
            state(
                0,
                silent=9.0,
                steps=6,
                collective_log=done,
                in_flight=[bucket],
                activity=_stepping(),
            ),
        )
        barrier = waiting_in(
            "barrier",
            7,
            9.0,
            site="train.py:20",
            function="log_metrics",
            callers=[f"train.py:{line} in main"],
        )
        write(
            tmp_path,
            state(
                1,
                silent=9.0,
                steps=6,
                collective_log=done,
                in_flight=[barrier],
                activity=_at(
                    "train.py:20 in log_metrics",
                    f"train.py:{line} in main",
                    "train.py:40 in <module>",
                    loops=[[], [26, 31], []],
                ),
            ),
        )
        d = examine(str(tmp_path), live_stacks=False)
        assert (d.verdict, d.suspect_ranks, kinds(d)[0]) == ("desync", [1], "mismatch"), line
        f = d.findings[0]
        assert "the operation differs" in f.summary and not f.fix.startswith(words.FIX_UNEVEN)
        assert f.evidence[-1] == evidence
    # the loops not known (an older ddpmon): a later line does not tell a pass behind from
    # past the loop; nothing tells the two apart (no call-site counts here), both named
    write(
        tmp_path,
        state(
            1,
            silent=9.0,
            steps=6,
            collective_log=done,
            in_flight=[barrier],
            activity=_at(
                "train.py:20 in log_metrics", "train.py:31 in main", "train.py:40 in <module>"
            ),
        ),
    )
    write(
        tmp_path,
        state(
            0,
            silent=9.0,
            steps=6,
            collective_log=done,
            in_flight=[bucket],
            activity=_stepping(loops=[]),
        ),
    )
    d = examine(str(tmp_path), live_stacks=False)
    assert d.suspect_ranks == [0, 1] and not d.findings[0].evidence[-1].startswith(
        "at the same step"
    )
    # an activity sampled before the rank issued its collective says nothing of where it waits
    write(
        tmp_path,
        state(
            0,
            silent=9.0,
            steps=6,
            collective_log=done,
            in_flight=[bucket],
            activity=_stepping(sampled_unix=states.NOW - 20.0),
        ),
    )
    d = examine(str(tmp_path), live_stacks=False)
    assert d.suspect_ranks == [0, 1] and not d.findings[0].evidence[-1].startswith(
        "at the same step"
    )


def test_ranks_waiting_in_different_groups_the_one_gone_past_is_named(tmp_path: Path) -> None:
    """desync, no majority: rank 1 waits in a barrier of another group at train.py:28 that
    rank 0 went past on its way to DDP's all-reduce (train.py:30)."""
    bucket = waiting_in("all_reduce", 9, 9.0, site="DDP backward", bucket=0, function="backward")
    write(tmp_path, state(0, silent=9.0, steps=6, in_flight=[bucket], activity=_stepping()))
    barrier = waiting_in("barrier", 3, 9.0, site="train.py:28", function="main", group="1")
    write(
        tmp_path,
        state(
            1,
            silent=9.0,
            steps=6,
            in_flight=[barrier],
            activity=_at("train.py:28 in main", "train.py:40 in <module>", loops=[[26, 31], []]),
        ),
    )
    d = examine(str(tmp_path), live_stacks=False)
    assert (d.verdict, d.suspect_ranks, kinds(d)[0]) == ("desync", [1], "desync")


POST_LOOP = "tests/scenarios/worker.py:84 in <genexpr>"


def test_ranks_starved_after_the_loop_are_busy_not_hung(tmp_path: Path) -> None:
    """The false hang after the training loop, as two ranks' files read 6.5 s after their
    last step on a machine with more runnable threads than cores. Rank 0 last wrote its
    file 2.5 s into its silence (its process got no CPU since), when its watchdog's sample
    said stepping; rank 1's watchdog says busy: 0.8% of a core, its threads waiting for one
    95% of the time. Read as stuck, rank 0 made the answer 'hang'."""
    stepping = {
        "state": "stepping",
        "sampled_unix": states.NOW - 4.0 - 0.01,
        "still_seconds": 1.4,
        "where": POST_LOOP,
        "hang_timeout_seconds": 60.0,
    }
    busy = {
        "state": "busy",
        "sampled_unix": states.NOW - 0.5,
        "still_seconds": 4.1,
        "cpu_share": 0.008,
        "runnable_share": 0.96,
        "wait_share": 0.95,
        "where": POST_LOOP,
        "hang_timeout_seconds": 60.0,
    }
    write(tmp_path, state(0, silent=2.5, stage="after_optimizer", activity=stepping), age=4.0)
    write(tmp_path, state(1, silent=6.0, stage="after_optimizer", activity=busy), age=0.5)
    d = examine(str(tmp_path), live_stacks=False)
    assert [v.status for v in d.ranks] == ["busy", "busy"]
    assert (d.verdict, d.suspect_ranks, kinds(d)[0]) == ("healthy", [], "busy")
    assert (
        "its watchdog last sampled it 2.5 s into this silence (stepping), too soon to judge"
        in d.findings[0].evidence[0]
    )
    assert "(its threads waiting for a CPU 95% of the time)" in d.findings[0].evidence[1]
    # its watchdog has said nothing for 6 s before that write: silence decides again
    stepping["sampled_unix"] = states.NOW - 4.0 - 6.0
    write(tmp_path, state(0, silent=2.5, stage="after_optimizer", activity=stepping), age=4.0)
    d = examine(str(tmp_path), live_stacks=False)
    assert (d.verdict, d.suspect_ranks) == ("hang", [0])


def test_a_job_ended_while_busy_after_the_loop_is_not_replayed_as_a_hang(tmp_path: Path) -> None:
    """Every process gone (ended from outside) while busy after the loop: at their last
    writes they were working, not stalled, so the doctor does not put them back in a stall."""
    busy = {
        "state": "busy",
        "sampled_unix": states.NOW - 30.2,
        "still_seconds": 5.0,
        "cpu_share": 0.9,
        "where": POST_LOOP,
        "hang_timeout_seconds": 60.0,
    }
    for r in range(2):
        write(tmp_path, state(r, silent=6.0, activity=busy), age=30.0 + r / 10)
    d = examine(str(tmp_path), live_stacks=False)
    assert d.verdict != "hang" and "ended_while_hung" not in kinds(d)
    stuck = dict(busy, state="stuck", cpu_share=0.0)
    for r in range(2):
        write(tmp_path, state(r, silent=6.0, activity=stuck), age=30.0 + r / 10)
    d = examine(str(tmp_path), live_stacks=False)
    assert (d.verdict, d.suspect_ranks) == ("hang", [0, 1]) and "ended_while_hung" in kinds(d)


def test_a_rank_evaluating_while_the_others_wait_in_a_barrier_is_busy(tmp_path: Path) -> None:
    """Rank 0 evaluates through the DDP model under no_grad (its forwards are heartbeats: it
    steps, as far as its silence goes) while ranks 1, 2 wait in a barrier: it has not
    stepped past them, so it works outside the training step, not a rank that runs on
    without joining, however long they wait. Stepped past them, or once their watchdogs
    reported a hang, it is."""
    evaluating = {
        "state": "stepping",
        "sampled_unix": states.NOW - 0.3,
        "where": "train.py:70 in evaluate",
        "hang_timeout_seconds": 60.0,
    }
    waiting = {
        "state": "waiting",
        "sampled_unix": states.NOW - 0.3,
        "still_seconds": 8.0,
        "hang_timeout_seconds": 60.0,
    }

    def job(steps: int, age: float = 8.0, **fields: object) -> Path:
        d = tmp_path / f"{steps}-{age}-{len(fields)}"
        write(d, state(0, world=3, silent=0.1, steps=steps, activity=evaluating))
        for r in (1, 2):
            write(
                d,
                state(
                    r,
                    world=3,
                    silent=age,
                    steps=6,
                    activity=waiting,
                    in_flight=[
                        waiting_in("barrier", 9, age, size=3, site="train.py:75", function="main")
                    ],
                    **fields,
                ),
            )
        return d

    d = examine(str(job(6)), live_stacks=False)
    assert (d.verdict, d.suspect_ranks, kinds(d)[0]) == ("healthy", [], "busy")
    assert d.findings[0].summary.startswith("ranks 1, 2 have waited 8 s in barrier #9")
    assert (
        "for rank 0, busy outside the training step (rank 0 in train.py:70 in evaluate)"
        in d.findings[0].summary
    )
    assert (
        d.findings[0]
        .evidence[0]
        .endswith(
            "makes progress without stepping (forward passes without gradients, an evaluation), step 6, at train.py:70 in evaluate"
        )
    )
    d = examine(str(job(6, age=3001.0)), live_stacks=False)  # 50 x 60 s: it still evaluates
    assert (d.verdict, d.suspect_ranks, kinds(d)[0]) == ("healthy", [], "busy")
    for d in (
        examine(str(job(30)), live_stacks=False),  # it trains on alone
        examine(str(job(6, hang=states.hang_report())), live_stacks=False),
    ):  # their watchdogs said so
        assert (d.verdict, d.suspect_ranks, kinds(d)[0]) == ("hang", [0], "not_joining")


def test_a_non_zero_exit_status_is_a_failure(tmp_path: Path) -> None:
    write(
        tmp_path,
        state(
            0,
            silent=5.0,
            exit={
                "unix": states.NOW - 5,
                "code": 3,
                "how": "sys.exit",
                "where": "train.py:12 in main",
            },
        ),
    )
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
    lines = [
        f"rank {r} (host node-{r // 8}, pid {states.PID_BASE + r}) has waited 9.0 s in all_reduce #14, step 3"
        for r in range(1024)
        if r != 341
    ]
    assert group_lines(lines) == [
        "ranks 0\u2013340, 342\u20131023 have waited 9.0 s in all_reduce #14, step 3"
    ]
    for r in range(40):
        write(
            tmp_path,
            state(
                r,
                world=40,
                host=f"node-{r // 8}",
                silent=9.0,
                in_flight=[waiting_in("all_reduce", 14, 9.0, size=40)] if r != 7 else [],
            ),
        )
    text = render(examine(str(tmp_path), live_stacks=False), width=100)
    assert len(text.splitlines()) < 40
    assert "0\u20136, 8\u201339" in text


def test_a_rank_waiting_for_a_gpu_that_makes_no_progress_is_named_with_its_gpu(
    tmp_path: Path,
) -> None:
    """Its watchdog said stuck: the host spins in ``loss.item()`` (100% of a core) while its
    GPU has not finished the work enqueued 8 s ago."""
    stuck = {
        "state": "stuck",
        "sampled_unix": states.NOW - 0.3,
        "still_seconds": 8.0,
        "cpu_share": 1.0,
        "where": "train.py:75 in main",
        "hang_timeout_seconds": 3.0,
        "gpu_behind_seconds": 8.2,
    }
    write(tmp_path, state(0, world=1, silent=8.5, activity=stuck))
    d = examine(str(tmp_path), live_stacks=False)
    assert (d.verdict, d.suspect_ranks, kinds(d)[0]) == ("hang", [0], "stuck_rank")
    assert any(
        "waiting for its GPU, which has not finished the work the rank enqueued 8 s ago" in line
        for line in d.findings[0].evidence
    ), d.findings[0].evidence
