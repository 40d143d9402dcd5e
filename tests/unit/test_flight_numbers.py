"""torch's flight-recorder numbers beside ddpmon's (``doctor/flight.py``): the offset between
the two numberings found from the records, and the line that says where they disagree. A
real gloo job: tests/distributed/test_flight_recorder_numbers.py."""

from __future__ import annotations

from ddpmon.collectors.host import Liveness
from ddpmon.doctor import flight
from ddpmon.doctor.load import StateFile
from ddpmon.doctor.view import RankView
from ddpmon.state import files
from tests.support import states

NOW = states.NOW


def fr_entry(seq: int, op: str = "all_reduce", numel: int = 1024, retired: bool = True) -> dict:
    return {
        "pg_id": 0,
        "process_group": ["0", "default_pg"],
        "collective_seq_id": seq,
        "profiling_name": f"gloo:{op}",
        "input_sizes": [[numel]],
        "input_dtypes": ["Float"],
        "state": "scheduled",
        "retired": retired,
        "is_p2p": False,
        "time_created_ns": int((NOW - 10 + seq * 0.1) * 1e9),
    }


def view(log: list[dict], waiting: dict, entries: list[dict]) -> RankView:
    data = states.state(
        0,
        collective_log=log,
        in_flight=[waiting],
        hang=states.hang_report(in_flight=[waiting], flight_recorder={"entries": entries}),
    )
    state = files.load("rank-0.json", data)
    return RankView(
        StateFile("d/rank-0.json", state, NOW),
        Liveness(True, "alive"),
        0.1,
        in_flight=list(state.in_flight),
    )


def ours(seq: int, numel: int = 1024, op: str = "all_reduce", done: bool = True) -> dict:
    entry = states.waiting_in(op, seq, 10 - seq * 0.1, numel=numel, bytes=4 * numel)
    if done:
        entry["completed_unix"] = entry["issued_unix"] + 0.01
    return entry


def test_the_numbers_side_by_side_and_what_torch_counted_that_ddpmon_did_not() -> None:
    # torch ran 3 collectives (a broadcast, DDP's checks) before ddpmon attached
    entries = [
        fr_entry(1, "broadcast", 10),
        fr_entry(2, "broadcast", 10),
        fr_entry(3, "all_gather", 2),
    ]
    entries += [fr_entry(s + 3) for s in range(1, 6)] + [fr_entry(9, retired=False)]
    v = view([ours(s) for s in range(1, 6)], ours(6, done=False), entries)
    assert flight.offset(v, "0") == 3
    assert flight.beside(v, v.waiting) == (
        " (flight recorder: pg 0 seq 9, enqueued, not completed; torch counts 3 collectives of "
        "the group that ddpmon did not see (before attach, or torch's own))"
    )


def test_where_the_two_disagree_the_line_says_so() -> None:
    entries = [fr_entry(s) for s in range(1, 6)] + [fr_entry(6, "broadcast", 7, retired=False)]
    v = view([ours(s) for s in range(1, 6)], ours(6, done=False), entries)
    assert flight.beside(v, v.waiting) == (
        " (flight recorder: pg 0 seq 6, enqueued, not completed; it records broadcast of 7 "
        "elements there, ddpmon all_reduce of 1024 elements: they disagree)"
    )
    v = view(
        [ours(s) for s in range(1, 6)], ours(6, done=False), [fr_entry(s) for s in range(1, 6)]
    )
    assert flight.beside(v, v.waiting) == (
        " (flight recorder: pg 0 has no seq 6, its last is seq 5: torch does not record it)"
    )
    v = view([], ours(6, done=False), [fr_entry(1, "barrier", 0)])
    assert flight.beside(v, v.waiting) == (
        " (flight recorder: no entry of group 0 matches ddpmon's collectives by op and size; "
        "its last is seq 1 barrier)"
    )
    bare = view([ours(s) for s in range(1, 6)], ours(6, done=False), [])
    assert flight.beside(bare, bare.waiting) == ""  # no entries: nothing beside
