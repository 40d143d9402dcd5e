"""The shared liveness rule (ddpmon/activity.py): classification, the hang decision, and a
waiting rank's view of its peers from their state files."""

from __future__ import annotations

import time
from pathlib import Path

from ddpmon import activity as lv
from ddpmon.state import files, schema


def test_classify() -> None:
    assert lv.classify(1.0, False, 10.0, 0.0, 0.0) == lv.Status.STEPPING
    assert lv.classify(9.0, True, 10.0, 0.0, 0.0) == lv.Status.WAITING
    assert lv.classify(9.0, False, 10.0, 0.0, 0.0) == lv.Status.STUCK
    assert lv.classify(9.0, False, 0.5, 0.0, 0.0) == lv.Status.BUSY        # the stack moves
    assert lv.classify(9.0, False, 10.0, 0.9, 0.0) == lv.Status.BUSY       # CPU
    assert lv.classify(9.0, False, 10.0, 0.0, 50e6) == lv.Status.BUSY      # I/O (a checkpoint)
    assert lv.classify(0.5, False, 10.0, 0.0, 0.0, timeout=0.2) == lv.Status.STUCK  # short timeouts


def test_is_hang_needs_evidence() -> None:
    assert not lv.is_hang(lv.Status.STUCK, 59.0, 60.0)
    assert lv.is_hang(lv.Status.STUCK, 61.0, 60.0)
    assert lv.is_hang(lv.Status.WAITING, 61.0, 60.0, peers_hold_out=lv.Status.STUCK)
    assert not lv.is_hang(lv.Status.BUSY, 200.0, 60.0)            # evaluation, checkpoint
    assert not lv.is_hang(lv.Status.WAITING, 200.0, 60.0, peers_hold_out=lv.Status.BUSY)
    assert lv.is_hang(lv.Status.BUSY, 301.0, 60.0) and lv.is_hang(lv.Status.WAITING, 301.0, 60.0, lv.Status.BUSY)


def _rank(directory: Path, rank: int, seq: int, state: str | None, exit: bool = False) -> str:
    s = schema.RankState(rank=rank, world_size=3, collective_seq={"0": seq}, state_interval=1.0,
                         now_unix=time.time())
    if state:
        s.activity = schema.Activity(state=state, sampled_unix=time.time())
    if exit:
        s.exit = schema.Exit(unix=time.time(), code=1)
    path = files.path_for(str(directory), rank)
    files.write_atomic(path, schema.to_json(s))
    return path


def test_holdouts_from_the_peers_files(tmp_path: Path) -> None:
    mine = _rank(tmp_path, 1, 9, lv.Status.WAITING)
    entry = schema.Collective(seq=9, op="barrier", group="0", group_size=3)
    _rank(tmp_path, 2, 9, lv.Status.WAITING)                   # joined
    _rank(tmp_path, 0, 8, lv.Status.BUSY)                      # not yet: busy saving
    assert lv.holdouts(mine, entry, time.time()) == lv.Status.BUSY
    _rank(tmp_path, 0, 8, lv.Status.STUCK)
    assert lv.holdouts(mine, entry, time.time()) == lv.Status.STUCK
    _rank(tmp_path, 0, 8, lv.Status.BUSY, exit=True)           # it ended
    assert lv.holdouts(mine, entry, time.time()) == lv.Status.STUCK
    _rank(tmp_path, 0, 9, lv.Status.WAITING)
    assert lv.holdouts(mine, entry, time.time()) is None  # everyone joined: unknown


def test_sampler_sees_the_main_thread(tmp_path: Path) -> None:
    sampler = lv.Sampler()
    sampler.sample()
    act = sampler.activity(0.0, False, 60.0, time.time())
    assert act.state == lv.Status.STEPPING and act.where and "test_activity.py" in act.where
