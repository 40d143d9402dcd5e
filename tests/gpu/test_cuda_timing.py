"""Bucket timing with CUDA events on a real GPU: two gloo ranks sharing one GPU (NCCL refuses
two ranks on one device), and one NCCL rank. Gradients must stay bit-identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    "backend,ranks,timing,mode",
    [
        ("gloo", 2, "hook", "hook"),  # CUDA events around a Python comm hook (auto is off on gloo)
        ("nccl", 1, "hook", "hook"),
        ("nccl", 1, "auto", "c10d"),  # NCCL's own timing, DDP's C++ all-reduce untouched
        (
            "nccl",
            1,
            "flight_recorder",
            "flight_recorder",
        ),  # the same, read from the flight recorder
    ],
)
def test_cuda_bucket_timing_and_identical_gradients(
    tmp_path: Path, backend: str, ranks: int, timing: str, mode: str
) -> None:
    results = run_ranks("cuda_timing", ranks, tmp_path, args=(backend, timing), timeout=240)
    for r in results:
        out = r.result
        assert out["mode"] == mode
        assert out["comm_hooks"] == (0 if mode in ("c10d", "flight_recorder") else 1)
        assert out["max_diff"] == 0.0
        assert out["steps"] >= 19
        assert out["buckets"], "bucket timings resolved"
        assert "bucket_timing" not in out["notes"], out["notes"]
        for b in out["buckets"]:
            assert b["count"] >= 10, b
            assert 0 < b["last_seconds"] < 5, b
            # nccl-tests' bus bandwidth factor 2(n-1)/n is 0 for one rank
            assert (
                b["busbw_bytes_per_second"] > 0 if ranks > 1 else b["busbw_bytes_per_second"] == 0
            ), b
        assert out["exposed_median"] is not None and out["exposed_median"] >= 0


def test_a_program_that_never_destroys_its_group_still_exits_cleanly(tmp_path: Path) -> None:
    """torch asks for destroy_process_group before exit once a completion hook is in."""
    (r,) = run_ranks("cuda_exit_without_destroy", 1, tmp_path, timeout=120)
    assert r.returncode == 0 and r.result == {"mode": "c10d"}
