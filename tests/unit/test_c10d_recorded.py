"""The c10d clock replaying sequences recorded in real DDP jobs (tests/fixtures/workinfo/,
made by tests/gpu/c10d_record_job.py): DDP's first layout, its rebuild after iteration 0, a loss
all-reduce after every backward and gradient accumulation under no_sync, as DDP really
ordered them. The replay must resolve exactly the steps, with exactly the bucket
durations, that the live clock did; an all-reduce slipped into one recorded backward
leaves that step, and only it, untimed."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.c10d import replay

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "workinfo").glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_replay_resolves_what_the_live_clock_did(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = load(path)
    clock, pairs = replay(rec["events"], rec["used_map_allreduce"], monkeypatch)
    assert [replayed for _, replayed in pairs] == [live for live, _ in pairs]
    assert (clock.matched_steps, clock.unmatched_steps) == (rec["matched"], rec["unmatched"])
    steps = sum(1 for e in rec["events"] if e[1] == "new_step")
    assert rec["matched"] == steps - 1, "every step but iteration 0 (DDP's first layout) is timed"
    assert clock.off_reason is None


def test_the_gloo_recording_is_what_its_loop_did(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = load(FIXTURES[0].with_name("gloo-standin.json"))
    names = [e[1] for e in rec["events"]]
    assert (
        names.count("new_step") == 24 and names.count("backward_started") == 28
    )  # 4 steps of 2 microbatches
    buckets = {
        e[3] for e in rec["events"] if e[1] == "new_step"
    }  # new_step(step, buckets, generation)
    assert buckets == {1, 4}, "one bucket first, four once DDP rebuilt them"


def test_an_allreduce_slipped_into_one_recorded_backward_leaves_only_that_step_untimed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rec = load(FIXTURES[0].with_name("gloo-standin.json"))
    events = copy.deepcopy(rec["events"])
    starts = [i for i, e in enumerate(events) if e[1] == "backward_started"]
    i = starts[15]
    done = next(j for j in range(i, len(events)) if events[j][1] == "backward_done")
    middle = (events[i][0] + events[done][0]) / 2
    events.insert(done + 1, [events[done][0], "completion", "ALLREDUCE", 0, middle, 0.001])
    clock, _ = replay(events, False, monkeypatch)
    assert (clock.matched_steps, clock.unmatched_steps) == (rec["matched"] - 1, 1)
    assert (
        clock.last_mismatch
        == "5 all-reduce(s) on DDP's process group during backward for 4 bucket(s)"
    )
