"""Bucket timing with CUDA events on a real GPU: two gloo ranks sharing one GPU (NCCL refuses
two ranks on one device), and one NCCL rank. Gradients must stay bit-identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize("backend,ranks", [("gloo", 2), ("nccl", 1)])
def test_cuda_bucket_timing_and_identical_gradients(tmp_path: Path, backend: str, ranks: int) -> None:
    results = run_ranks("cuda_timing", ranks, tmp_path, args=(backend,), timeout=240)
    for r in results:
        out = r.result
        assert out["max_diff"] == 0.0
        assert out["steps"] >= 9
        assert out["buckets"], "bucket timings resolved from CUDA events"
        for b in out["buckets"]:
            assert b["count"] >= 5, b
            assert 0 < b["last_seconds"] < 5, b
            assert b["busbw_bytes_per_second"] > 0, b
        assert out["exposed_median"] is not None and out["exposed_median"] >= 0
