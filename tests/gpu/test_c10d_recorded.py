"""Record the WorkInfo stream NCCL's real completion hook gives the c10d clock
(tests/gpu/c10d_record_job.py), check the live matching, and check that replaying the
recording gives the same. With DDPMON_WORKINFO_DIR set, the recording is written there as
``nccl-<torch version>.json``: copied into tests/fixtures/workinfo/, it is replayed by
tests/unit/test_c10d_recorded.py on every machine from then on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.c10d import replay
from tests.support.harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_nccl_workinfo_recorded_and_replayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (r,) = run_ranks(
        "", 1, tmp_path, module="tests.gpu.c10d_record_job", args=("nccl",), timeout=240
    )
    rec = r.result
    steps = len({e[2] for e in rec["events"] if e[1] == "new_step"})  # (a step may be closed twice)
    assert rec["mode"] == "c10d" and steps == 24
    assert (rec["matched"], rec["unmatched"]) == (steps - 1, 0), (
        "all but iteration 0 (DDP's first layout)"
    )
    ops = {e[2] for e in rec["events"] if e[1] == "completion"}
    assert "ALLREDUCE" in ops, ops
    clock, pairs = replay(rec["events"], rec["used_map_allreduce"], monkeypatch)
    assert [replayed for _, replayed in pairs] == [live for live, _ in pairs]
    assert (clock.matched_steps, clock.unmatched_steps) == (rec["matched"], rec["unmatched"])
    out = os.environ.get("DDPMON_WORKINFO_DIR")
    if out:
        rec["recorded_by"] = (
            "tests/gpu/test_c10d_recorded.py (python -m tests.gpu.c10d_record_job nccl)"
        )
        name = "nccl-" + rec["torch"].replace("+", "-") + ".json"
        Path(out, name).write_text(json.dumps(rec, separators=(",", ":")))
