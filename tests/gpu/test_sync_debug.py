"""ddpmon attached never synchronizes the GPU while the job trains: DDP's steps, ddpmon's
step boundaries and the scrapes meanwhile run under ``torch.cuda.set_sync_debug_mode``
(sync_worker.py), for each bucket-timing source on NCCL (one rank) and on gloo with CUDA
tensors (two ranks on one GPU); the steps' parts come from CUDA events all the same."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    "backend,ranks,timing,source",
    [
        ("nccl", 1, "auto", "c10d"),
        ("nccl", 1, "hook", "hook"),
        ("gloo", 2, "auto", "off"),  # buckets marked in flight, not timed
        ("gloo", 2, "hook", "hook"),  # CUDA events around the Python hook
    ],
)
def test_an_attached_job_never_synchronizes_the_gpu(
    tmp_path: Path, backend: str, ranks: int, timing: str, source: str
) -> None:
    results = run_ranks(
        "", ranks, tmp_path, module="tests.gpu.sync_worker", args=(backend, timing), timeout=240
    )
    for r in results:
        out = r.result
        assert out["error"] is None, out["error"]
        assert out["extra_warnings"] == [], out["extra_warnings"]
        assert out["errors"] == {}, (
            "no part of ddpmon failed (a failure is caught and recorded there)"
        )
        assert out["bucket_timing"] == source and "bucket_timing" not in out["notes"], out["notes"]
        assert out["steps"] >= 30
        # the step's parts as the GPU ran them (ddpmon/rank/gpu_steps.py), resolved without a sync
        assert out["gpu_parts_steps"] >= 30, out["gpu_parts_steps"]
        for row in out["gpu_rows"]:
            assert row["forward_seconds"] > 0 and row["backward_seconds"] > 0, row
            parts = sum(
                row[p + "_seconds"] or 0.0
                for p in ("data_wait", "forward", "backward", "exposed_comm", "optimizer", "other")
            )
            assert parts == pytest.approx(row["step_seconds"], abs=1e-6), row
        if source != "off":
            assert out["timed_buckets"] and min(out["timed_buckets"]) >= 10, out["timed_buckets"]
    if backend == "nccl" and results[0].result["mode"] != "error":
        pytest.xfail(
            f"checked under 'warn' only: torch's own NCCL path synchronizes "
            f"({results[0].result['baseline_error']})"
        )
