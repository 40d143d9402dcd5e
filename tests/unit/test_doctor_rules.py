"""The doctor's rules, one test per finding kind, on state files recorded from real jobs.

``tests/fixtures/doctor/<scenario>/`` holds the state files of a real gloo job (recorded by
``python -m tests.fixtures.doctor.record``) and ``meta.json``: each file's modification
time, the doctor's clock when they were recorded, each process's liveness then, and the
doctor's answer then. A test builds the views from those files without any process (the
liveness given explicitly, ``now`` fixed relative to the recording) and calls one rule.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from ddpmon.collectors.host import Liveness
from ddpmon.doctor import rules, words
from ddpmon.doctor.load import StateFile, load_dir
from ddpmon.doctor.rules import (
    cannot_write,
    comm_hang,
    common,
    dead_rank,
    desync,
    ended_while_hung,
    files,
    fingerprint,
    not_joining,
    rank_notes,
    same_error,
    straggler,
    stuck_rank,
    unused_parameters,
)
from ddpmon.doctor.view import RankView, view
from ddpmon.state import files as state_files
from ddpmon.state import schema

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "doctor"
SCENARIOS = sorted(p.name for p in FIXTURES.iterdir() if (p / "meta.json").exists())


def meta(scenario: str) -> dict[str, Any]:
    return json.loads((FIXTURES / scenario / "meta.json").read_text())


def state_files_of(scenario: str) -> list[StateFile]:
    """The recorded files, read as the doctor reads them, with their recorded mtimes."""
    m = meta(scenario)
    return [
        StateFile(str(path), state_files.read(str(path)), m["mtime"][path.name])
        for path in sorted(
            (FIXTURES / scenario).glob("rank-*.json"),
            key=lambda p: state_files.rank_of(str(p)) or 0,
        )
    ]


def views(
    scenario: str,
    *,
    later: float = 0.0,
    alive: dict[int, bool | None] | None = None,
    stopped: tuple[int, ...] = (),
    only: tuple[int, ...] | None = None,
) -> list[RankView]:
    """The ranks of a recorded job ``later`` seconds after the recording. Liveness is as the
    doctor saw it then, unless ``alive`` (by rank) or ``stopped`` say otherwise."""
    m = meta(scenario)
    out = []
    for f in state_files_of(scenario):
        if only is not None and f.rank not in only:
            continue
        name = Path(f.path).name
        live = (alive or {}).get(f.rank, m["alive"][name])
        liveness = Liveness(
            live, f"given by the test: alive={live}", f.rank in stopped or m["stopped"][name]
        )
        out.append(view(f, liveness, m["now"] + later, None))
    return out


def statuses(vs: list[RankView]) -> list[str]:
    return [v.status for v in vs]


# -- the view of a rank ---------------------------------------------------------------------------


def test_views_of_recorded_jobs() -> None:
    assert statuses(views("stuck_rank")) == ["waiting", "waiting", "stuck"]
    assert statuses(views("stuck_rank", stopped=(2,))) == ["waiting", "waiting", "frozen"]
    assert statuses(views("dead_rank")) == ["crashed", "dead", "crashed"]
    assert statuses(views("straggler")) == ["stepping", "stepping"]
    assert statuses(views("finished")) == ["exited", "exited"]
    # another host (liveness unknown): a file no longer rewritten is silent
    assert statuses(views("straggler", later=60.0, alive={0: None, 1: None})) == [
        "silent",
        "silent",
    ]
    stuck = views("stuck_rank")
    waiting = stuck[0].waiting
    assert waiting is not None and (waiting.op, waiting.bucket, waiting.call_site) == (
        "all_reduce",
        0,
        "DDP backward",
    )
    assert waiting.age_seconds is not None and waiting.age_seconds >= 2.0
    assert stuck[2].stack_source is not None and stuck[2].stack_source.startswith("its hang report")
    assert stuck[2].stack is not None and stuck[2].stack[0].frames[-1].function == "load_batch"


def test_every_recorded_job_gets_the_answer_the_doctor_gave_when_recorded() -> None:
    for scenario in SCENARIOS:
        vs = views(scenario)
        missing = [
            r for r in range(vs[0].state.world_size or len(vs)) if r not in {v.rank for v in vs}
        ]
        verdict, suspects, findings = rules.decide(vs, missing)
        findings += rules.notes(vs, suspects)
        expected = meta(scenario)["doctor"]
        assert (verdict, suspects, [f.kind for f in findings]) == (
            expected["verdict"],
            expected["suspect_ranks"],
            expected["kinds"],
        ), scenario


# -- verdict rules, in the order of rules.VERDICT_RULES -------------------------------------------


def test_finished() -> None:
    found = dead_rank.finished(views("finished"), [])
    assert found is not None and (found.verdict, found.suspects) == ("healthy", [])
    assert [(f.kind, f.severity, f.ranks) for f in found.findings] == [("finished", "info", [0, 1])]
    assert dead_rank.finished(views("straggler"), []) is None
    assert dead_rank.finished(views("dead_rank"), []) is None


def test_left_early() -> None:
    """Rank 0 had fewer batches and exited cleanly; rank 1 then failed in its all-reduce."""
    vs = views("left_early")
    assert statuses(vs) == ["exited", "crashed"]
    found = dead_rank.left_early(vs, [])
    assert found is not None and (found.verdict, found.suspects) == ("desync", [0])
    f = found.findings[0]
    assert (f.kind, f.ranks) == ("left_early", [0])
    assert f.summary.startswith(
        "rank 0 left the job (exited without an error at step 4) while rank 1 still needed it"
    )
    assert f.fix == words.FIX_UNEVEN
    assert dead_rank.left_early(views("dead_rank"), []) is None
    assert dead_rank.left_early(views("finished"), []) is None


def test_mismatch_uneven_inputs_with_two_ranks() -> None:
    """Rank 0 has one batch more than rank 1: as #15 it runs DDP's gradient all-reduce of
    that batch while rank 1 waits in the script's final barrier. No majority, yet rank 1
    stands further along in the code both run, at the same step: at the barrier (line 34),
    past the loop (lines 32-33) in which rank 0 calls train_step: rank 0 has more batches."""
    vs = views("uneven_more")
    assert statuses(vs) == ["waiting", "waiting"]
    where, past, stepping = common.parting(vs[1], vs[0])
    assert where == "uneven_more (tests/fixtures/doctor/record_worker.py)"
    assert (past[2:], stepping[2:]) == ((34, ()), (33, (32, 33)))  # the training loop: lines 32-33
    assert common.ahead(vs[1], vs[0]) is True and common.behind([[vs[0]], [vs[1]]]) == [vs[0]]
    found = fingerprint.mismatch(vs, [])
    assert found is not None and (found.verdict, found.suspects) == ("desync", [0])
    f = found.findings[0]
    assert (f.kind, f.ranks) == ("mismatch", [0])
    assert f.summary.startswith(
        "rank 0 has more batches than rank 1 (uneven inputs): as #15 of group 0, rank 0 runs another "
        "training step (all_reduce of DDP gradient bucket 0) while rank 1 has gone past the training "
        "loop to barrier at tests/fixtures/doctor/record_worker.py:34 in uneven_more"
    )
    assert f.evidence[-1] == (
        "at the same step (5), rank 1 is at line 34 of uneven_more (tests/fixtures/doctor/record_worker.py), "
        "past the loop (lines 32-33) that rank 0 is in, at line 33: rank 1 went past the place of rank 0's "
        "training step without running it"
    )
    assert f.fix.startswith(words.FIX_UNEVEN)
    # positions that do not tell (other steps): the call site no other rank used, as before
    vs[0].state.step += 1
    assert common.ahead(vs[1], vs[0]) is None
    found = fingerprint.mismatch(vs, [])
    assert (
        found is not None
        and found.suspects == [1]
        and not found.findings[0].fix.startswith(words.FIX_UNEVEN)
    )


def test_dead_rank() -> None:
    """Rank 1 ended with os._exit; ranks 0 and 2 then crashed on the closed connection: their
    errors are symptoms, rank 1 went first."""
    found = dead_rank.dead_rank(views("dead_rank"), [])
    assert found is not None and (found.verdict, found.suspects) == ("dead_rank", [1])
    f = found.findings[0]
    assert (f.kind, f.ranks, f.severity) == ("dead_rank", [1], "error")
    assert f.summary == "rank 1 died first; ranks 0, 2 ended after it"
    assert f.evidence[0].startswith("rank 1 (host ") and "vanished without a trace" in f.evidence[0]
    assert "Killed process" in f.fix
    # on another host the same rank is only seen to stop writing
    found = dead_rank.dead_rank(views("dead_rank", later=60.0, alive={1: None}), [])
    assert found is not None and found.suspects == [1]
    assert found.findings[0].summary.startswith("rank 1 stopped writing its state file")
    assert dead_rank.dead_rank(views("left_early"), []) is None
    assert dead_rank.dead_rank(views("stuck_rank"), []) is None


def test_same_error() -> None:
    """Both ranks raised DDP's reduction error at the same line (an unused head, and
    find_unused_parameters=False): one bug in the code, every rank a suspect, the unused
    parameters its cause. One rank alone failing so is that rank's failure, cause named."""
    vs = views("same_error")
    assert dead_rank.dead_rank(vs, []) is not None  # the rule after it would pick one rank
    found = same_error.same_error(vs, [])
    assert found is not None and (found.verdict, found.suspects) == ("dead_rank", [0, 1])
    f = found.findings[0]
    assert (f.kind, f.ranks, f.severity) == ("same_error", [0, 1], "error")
    assert f.summary.startswith(
        "every rank failed in the same place: a bug in the code, not one rank "
        '(ranks 0, 1 raised DDP\'s "Expected to have finished reduction in the prior iteration" at '
    )
    assert f.summary.endswith(
        "in unused_layer); its cause: 2 parameter(s) received no gradient in the step before "
        "(head_b.weight, head_b.bias) and DDP runs with find_unused_parameters=False"
    )
    assert f.fix.startswith("Make head_b.weight, head_b.bias take part in the loss on every rank")
    assert unused_parameters.unused_parameters(vs) == []  # named once, as the cause
    assert same_error.same_error(vs, [2]) is None  # a rank without a file: not every rank is known
    assert (
        "2 parameter(s) received no gradient in the step before (head_b.weight, head_b.bias)"
        in words.fix_crashed(vs[1])
    )  # dead_rank's fix, where one rank failed so
    assert same_error.same_error(views("dead_rank"), []) is None  # os._exit, then connection errors


def full_disk(monkeypatch: pytest.MonkeyPatch, free: tuple[int, int] = (12 * 1024, 500)) -> str:
    """A state directory whose file system has ``free`` (bytes, inodes) left, as statvfs says."""
    where = str(FIXTURES / "straggler")
    monkeypatch.setattr(
        state_files, "free_space", lambda directory: free if directory == where else None
    )
    return where


def test_cannot_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose disk filled up: its files stop changing while its ranks train on (they
    read as frozen: a hang), and once they end cleanly their last writes fail too (they read
    as killed from outside: the OOM killer). The full file system says why."""
    running = views("straggler", later=14.0, alive={0: True, 1: True})
    assert statuses(running) == ["frozen", "frozen"]
    assert rules.decide(running, []).verdict == "hang"  # what the doctor said before
    where = full_disk(monkeypatch)
    cannot_write.mark(running, where)
    assert statuses(running) == ["unknown", "unknown"]
    verdict, suspects, found = rules.decide(running, [])
    assert (verdict, suspects, [f.kind for f in found]) == (
        "cannot_write",
        [0, 1],
        ["cannot_write"],
    )
    f = found[0]
    assert (f.severity, f.summary) == (
        "error",
        "ranks 0, 1 cannot write their state: no space left on device",
    )
    assert f.evidence[0] == f"the file system of {where} has 12 KiB free (under 1 MiB: full)"
    assert (
        f.evidence[1].startswith("rank 0 (host ")
        and "its state file was last written " in f.evidence[1]
    )
    assert "its process runs (given by the test: alive=True)" in f.evidence[1]
    assert f"df -h {where}" in f.fix and "DDPMON_STATE_DIR" in f.fix and "OOM" not in f.fix
    # a clean finish whose last writes failed: ended, how not recorded; not killed
    ended = views("straggler", later=30.0, alive={0: False, 1: False})
    assert (
        rules.decide(ended, []).findings[0].kind == "dead_rank"
    )  # "vanished ... the OOM killer" before
    cannot_write.mark(ended, where)
    verdict, _, found = rules.decide(ended, [])
    assert verdict == "cannot_write" and found[0].summary == (
        "ranks 0, 1 cannot write their state: no space left on device; ranks 0, 1 have ended, how is not recorded"
    )
    assert "vanished" not in " ".join(found[0].evidence) and "dmesg" in found[0].fix
    # no free inode is as full
    monkeypatch.setattr(state_files, "free_space", lambda directory: (50 << 20, 0))
    late = views("straggler", later=14.0, alive={0: True, 1: True})
    cannot_write.mark(late, where)
    assert (
        statuses(late) == ["unknown", "unknown"]
        and "no free inode" in late[0].cannot_write.evidence[0]
    )


def test_cannot_write_from_the_ranks_own_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Space came back (or the doctor cannot see the file system: --from), but the last file
    that got through says the rank's history writes were failing: its writes fail, the file
    is old for that reason."""
    full_disk(monkeypatch, free=(50 << 20, 500))
    vs = views("straggler", later=14.0, alive={0: True, 1: False})
    s = vs[1].state
    s.write_failures["history"] = schema.WriteFailure(
        "No space left on device",
        (s.now_unix or 0) - 6,
        (s.now_unix or 0) - 1,
        "ENOSPC",
        count=5,
        total=5,
    )
    cannot_write.mark(vs, str(FIXTURES / "straggler"))
    assert statuses(vs) == ["frozen", "unknown"]  # rank 0 says nothing of the sort: frozen
    assert vs[1].cannot_write.evidence == [
        "rank 1: its last state file that got through says writing its history had failed for 6 s "
        "(5 tries: No space left on device)"
    ]
    cannot_write.mark(vs, None)  # read from node daemons: the record alone
    verdict, suspects, found = rules.decide(vs, [])
    assert verdict == "hang" and suspects == [0]  # rank 0 is frozen: the hang stays the cause...
    note = next(f for f in found if f.kind == "cannot_write")  # ...and rank 1's writes are a note
    assert (note.severity, note.ranks) == ("warning", [1])
    assert (
        note.summary
        == "rank 1 cannot write its state: no space left on device; rank 1 has ended, how is not recorded"
    )


def test_cannot_write_needs_a_late_file_and_a_running_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    where = full_disk(monkeypatch)
    fresh = views("straggler", alive={0: True, 1: True})
    cannot_write.mark(fresh, where)
    assert statuses(fresh) == ["stepping", "stepping"]  # written a moment ago: it writes
    stopped = views("straggler", later=14.0, alive={0: True, 1: True}, stopped=(1,))
    cannot_write.mark(stopped, where)
    assert statuses(stopped) == ["unknown", "frozen"]  # SIGSTOP is not a full disk
    done = views("finished", later=60.0)
    cannot_write.mark(done, where)
    assert statuses(done) == ["exited", "exited"]  # their exit records got through
    assert cannot_write.cannot_write(done, []) is None


def test_stuck_rank() -> None:
    """Rank 2 never returns from its data loader; ranks 0 and 1 wait in the all-reduce."""
    found = stuck_rank.stuck_rank(views("stuck_rank"), [])
    assert found is not None and (found.verdict, found.suspects) == ("hang", [2])
    f = found.findings[0]
    assert (f.kind, f.ranks) == ("stuck_rank", [2])
    assert f.summary == (
        "rank 2 is stuck outside any collective; ranks 0, 1 wait for it in all_reduce #11 "
        "(group 0, gradient bucket 0 of DDP's backward)"
    )
    assert any(line.endswith("in load_batch") for line in f.evidence)
    assert f.fix == words.FIX_STUCK
    # its process stopped (SIGSTOP): frozen, and the fix says how to read its stack
    found = stuck_rank.stuck_rank(views("stuck_rank", stopped=(2,)), [])
    assert (
        found is not None
        and found.suspects == [2]
        and found.findings[0].fix.startswith(words.FIX_FROZEN)
    )
    assert stuck_rank.stuck_rank(views("desync"), []) is None


def test_not_joining() -> None:
    """Rank 0 waits in a barrier of the whole job; rank 1 trains on (DDP over its own group)."""
    vs = views("not_joining")
    assert statuses(vs) == ["waiting", "stepping"]
    found = not_joining.not_joining(vs, [])
    assert found is not None and (found.verdict, found.suspects) == ("hang", [1])
    f = found.findings[0]
    assert (f.kind, f.ranks) == ("not_joining", [1])
    assert f.summary.startswith("rank 0 waits in barrier #") and f.summary.endswith(
        "rank 1 runs on without issuing it"
    )
    assert any(line.startswith("rank 1 keeps making progress") for line in f.evidence)
    barrier = vs[0].waiting  # a rank that has issued it is not the one that does not join
    vs[1].state.collective_seq[barrier.group] = barrier.seq
    assert not_joining.not_joining(vs, []) is None
    assert not_joining.not_joining(views("stuck_rank"), []) is None
    assert not_joining.not_joining(views("straggler"), []) is None


def test_a_wait_a_peer_has_seen_end_is_over() -> None:
    """Rank 0's file shows it waiting in a barrier (its watchdog's hang report still in it);
    rank 1 completed that barrier after the file was written: the moment between two
    writes, not a hang. Completed before the file was written, it proves nothing."""
    for after, verdict in ((0.2, "healthy"), (-0.2, "hang")):
        vs = views("not_joining")
        barrier = vs[0].waiting
        vs[0].state.hang = schema.Hang(0.0, 0.0, 3.0, 2.0, "test")
        done = dataclasses.replace(
            barrier, completed_unix=vs[0].state.now_unix + after, seconds=0.1
        )
        vs[1].state.collective_log.append(done)
        vs[1].state.collective_seq[barrier.group] = barrier.seq
        assert rules.decide(vs, []).verdict == verdict, after
        assert statuses(vs)[0] == ("stepping" if verdict == "healthy" else "waiting")
        vs = views("not_joining")  # a collective that completes on a root alone proves nothing
        vs[1].state.collective_log.append(
            dataclasses.replace(
                barrier,
                op="broadcast",
                seq=barrier.seq + 1,
                completed_unix=vs[0].state.now_unix + 0.2,
            )
        )
        assert rules.decide(vs, []).verdict == "hang"


def test_missing_rank() -> None:
    """Ranks 0 and 1 wait in a 3-rank all-reduce; rank 2 has no state file here."""
    vs = views("stuck_rank", only=(0, 1))
    found = comm_hang.missing_rank(vs, [2])
    assert found is not None and (found.verdict, found.suspects) == ("hang", [2])
    f = found.findings[0]
    assert (f.kind, f.ranks) == ("missing_rank", [2])
    assert "the group has 3 members and rank 2 has no state file here" in f.summary
    assert comm_hang.missing_rank(vs, []) is None
    assert comm_hang.missing_rank(views("desync"), [2]) is None


def test_comm_hang() -> None:
    """Every rank the doctor sees waits in the same all-reduce and no member is unseen."""
    vs = views("stuck_rank", only=(0, 1))
    found = comm_hang.comm_hang(vs, [])
    assert found is not None and (found.verdict, found.suspects) == ("hang", [])
    f = found.findings[0]
    assert (f.kind, f.ranks) == ("comm_hang", [0, 1])
    assert "none is behind" in f.summary
    assert "GLOO_SOCKET_IFNAME" in f.fix and "TORCH_DISTRIBUTED_DEBUG=DETAIL" not in f.fix
    assert comm_hang.comm_hang(vs, [2]) is None  # rank 2 is a member without a file
    assert comm_hang.comm_hang(views("desync"), []) is None


def test_desync() -> None:
    """Rank 1 issued a barrier rank 0 never issues; rank 0 went on to its all-reduce."""
    vs = views("desync")
    found = desync.desync(vs, [])
    assert found is not None and (found.verdict, found.suspects) == ("desync", [1])
    f = found.findings[0]
    assert (f.kind, f.ranks) == ("desync", [1])
    assert f.summary.startswith("the ranks wait in different collectives (rank 1 in barrier #")
    assert "in report_progress" in f.summary
    assert "monitored_barrier" in f.fix and "TORCH_DISTRIBUTED_DEBUG=INFO" in f.fix
    assert desync.odd_ranks(vs) == [1]
    assert desync.desync(views("stuck_rank", only=(0, 1)), []) is None


def test_straggler() -> None:
    """Rank 1's forward sleeps 30 ms longer; it computes slower and waits least."""
    found = straggler.straggler(views("straggler"), [])
    assert found is not None and (found.verdict, found.suspects) == ("straggler", [1])
    f = found.findings[0]
    assert (f.kind, f.ranks, f.severity) == ("straggler", [1], "warning")
    assert "x slower than the others" in f.summary
    assert (
        "confirmed: the slow rank waits least for communication (the others wait for it)"
        in f.evidence
    )
    assert straggler.straggler(views("stuck_rank"), []) is None


def test_ended_while_hung() -> None:
    """The stuck job, its processes later killed: diagnosed as the hang it was."""
    vs = views("stuck_rank", later=120.0, alive={0: False, 1: False, 2: False})
    assert statuses(vs) == ["dead", "dead", "dead"]
    assert ended_while_hung.applies(vs)
    verdict, suspects, findings = rules.decide(vs, [])
    assert (verdict, suspects) == ("hang", [2])
    assert [f.kind for f in findings] == ["stuck_rank", "ended_while_hung"]
    assert not ended_while_hung.applies(views("dead_rank"))
    assert not ended_while_hung.applies(views("stuck_rank"))
    # killed while they still made progress: a dead rank, not a hang
    assert not ended_while_hung.applies(views("straggler", alive={0: False, 1: False}))


def test_the_first_rule_that_answers_wins() -> None:
    """Precedence: a stuck rank is blamed before the waiting ranks' collectives are compared."""
    vs = views("stuck_rank")
    assert comm_hang.comm_hang(vs, []) is not None  # on its own it would answer
    assert rules.VERDICT_RULES.index(stuck_rank.stuck_rank) < rules.VERDICT_RULES.index(
        comm_hang.comm_hang
    )
    assert rules.decide(vs, []).suspects == [2]
    assert rules.decide([], []) == ("no_data", [], [])
    assert rules.decide(views("finished"), [])[0] == "healthy"


# -- notes ----------------------------------------------------------------------------------------


def test_unused_parameters() -> None:
    """Rank 0 uses head_a and never head_b; rank 1 the other way round."""
    found = unused_parameters.unused_parameters(views("unused_parameters"))
    assert [(f.kind, f.ranks) for f in found] == [
        ("unused_parameters", [0]),
        ("unused_parameters", [1]),
    ]
    assert "head_b.weight" in found[0].summary and "head_a.weight" in found[1].summary
    assert unused_parameters.unused_parameters(views("needless_find_unused")) == []


def test_needless_find_unused_parameters() -> None:
    found = unused_parameters.needless_find_unused_parameters(views("needless_find_unused"))
    assert [(f.kind, f.ranks) for f in found] == [("needless_find_unused_parameters", [0, 1])]
    assert "find_unused_parameters=False" in found[0].fix
    # another rank does have unused parameters: the flag is needed
    assert unused_parameters.needless_find_unused_parameters(views("unused_parameters")) == []
    assert unused_parameters.needless_find_unused_parameters(views("straggler")) == []
    # one rank alone cannot tell: the other (without the flag noted) may need it
    mixed = views("needless_find_unused", only=(0,)) + views("finished", only=(1,))
    assert unused_parameters.needless_find_unused_parameters(mixed) == []


def test_no_stack() -> None:
    vs = views("stuck_rank")
    assert rank_notes.no_stack(vs[2], [2]) is None  # its hang report has its stack
    vs[2].stack, vs[2].stack_error = None, "py-spy is not installed"
    f = rank_notes.no_stack(vs[2], [2])
    assert (
        f is not None
        and (f.kind, f.ranks) == ("no_stack", [2])
        and "py-spy is not installed" in f.summary
    )
    assert rank_notes.no_stack(vs[2], [0]) is None  # not a suspect


def test_ddpmon_part_off() -> None:
    assert [rank_notes.ddpmon_part_off(v, []) for v in views("straggler")] == [None, None]
    v = views("straggler")[1]
    v.file = dataclasses.replace(
        v.file, state=dataclasses.replace(v.state, errors={"bucket_timing": "boom"})
    )
    f = rank_notes.ddpmon_part_off(v, [])
    assert (
        f is not None
        and (f.kind, f.ranks) == ("ddpmon_part_off", [1])
        and "bucket_timing: boom" in f.summary
    )


# -- the state directory --------------------------------------------------------------------------


@pytest.mark.bad_state_files
def test_bad_state_file_and_unreachable_daemon(tmp_path: Path) -> None:
    body = (FIXTURES / "desync" / "rank-0.json").read_text()
    (tmp_path / "rank-0.json").write_text(body[: len(body) // 2])
    shutil.copy(FIXTURES / "desync" / "rank-1.json", tmp_path / "rank-1.json")
    loaded = load_dir(str(tmp_path))
    assert [f.rank for f in loaded.files] == [1]
    found = files.bad_files(loaded.bad + [("http://node-3:9400/state", "cannot be read (refused)")])
    assert [(f.kind, f.summary.split(" ")[0]) for f in found] == [
        ("bad_state_file", str(tmp_path / "rank-0.json")),
        ("unreachable_daemon", "http://node-3:9400/state"),
    ]
    assert "not valid JSON" in found[0].summary and "--serve-state" in found[1].fix


def test_no_state_files() -> None:
    f = files.no_state_files("/some/dir")
    assert (f.kind, f.severity) == ("no_state_files", "warning") and "/some/dir" in f.summary


def test_other_job_and_leftover_state_file() -> None:
    desync_files, stuck_files = state_files_of("desync"), state_files_of("stuck_rank")
    jobs = {"desync": [0, 1], "stuck": [0, 1, 2]}
    found = files.other_job("desync", jobs)
    assert [(f.kind, f.ranks) for f in found] == [
        ("other_job", [0, 1, 2])
    ] and "--job stuck" in found[0].fix
    # rank 2 of a 3-rank run beside the files of a 2-rank one
    kept, world, missing, notes = files.membership(desync_files + [stuck_files[2]])
    assert ([f.rank for f in kept], world, missing) == ([0, 1], 2, [])
    assert [(f.kind, f.ranks) for f in notes] == [
        ("leftover_state_file", [2])
    ] and "rank-2.json" in notes[0].summary


def test_missing_ranks() -> None:
    kept, world, missing, notes = files.membership(state_files_of("stuck_rank")[:2])
    assert (world, missing, notes) == (3, [2], [])
    found = files.missing_ranks(missing, world, set(), [])
    assert [(f.kind, f.ranks) for f in found] == [("missing_ranks", [2])]
    assert files.missing_ranks(missing, world, {2}, []) == []  # its file is there, unreadable
    blamed = comm_hang.missing_rank(views("stuck_rank", only=(0, 1)), [2])
    assert blamed is not None and files.missing_ranks(missing, world, set(), blamed.findings) == []


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fixture_files_are_real_state_files(scenario: str) -> None:
    """Every fixture fits the shipped schema, reads cleanly, and its meta.json covers every file."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema.generated_schema())
    for path in (FIXTURES / scenario).glob("rank-*.json"):
        errors = list(validator.iter_errors(json.loads(path.read_text())))
        assert not errors, f"{path}: {errors[0].message}"
    fs = state_files_of(scenario)
    assert fs and {Path(f.path).name for f in fs} == set(meta(scenario)["mtime"])
