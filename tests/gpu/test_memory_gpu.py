"""torch's allocated and reserved memory trends on a real CUDA rank (skipped without a GPU):
a rank that keeps a 4 MiB CUDA tensor every step is named within 100 steps, its allocated
and reserved memory creeping at 4 MiB a step, with the GPU's memory as the limit and
tensors kept across steps as the cause (not fragmentation: allocated grows too)."""

from __future__ import annotations

import pytest

from ddpmon import memory
from ddpmon.doctor import examine, words
from ddpmon.state.schema import MemoryTrend
from tests.distributed.memory_worker import LEAK, STEPS
from tests.support import harness

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]


def test_allocated_and_reserved_trends_name_a_rank_that_keeps_cuda_tensors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (r,) = harness.run_ranks(
        "gpu", 1, tmp_path, timeout=200, module="tests.distributed.memory_worker"
    )
    assert r.result["step"] == STEPS
    gpu = {
        t.kind: t
        for t in (MemoryTrend(**t) for t in r.result["memory"]["trends"])
        if t.kind.startswith("torch_")
    }
    assert set(gpu) == {"torch_allocated", "torch_reserved"}
    for t in gpu.values():
        assert memory.creeping(t), t
        assert t.bytes_per_step == pytest.approx(LEAK, rel=0.15)
        assert t.limit == "device" and t.headroom_bytes and memory.seconds_left(t)
    assert 'kind="torch_allocated",process="rank",rank="0"' in r.result["metrics"]
    (f,) = [
        f
        for f in examine(str(tmp_path / "state"), live_stacks=False).findings
        if f.kind == "memory_creep"
    ]
    assert f.ranks == [0] and "GPU memory grows" in f.summary and "the GPU's memory" in f.summary
    assert f.fix == words.FIX_TENSORS_KEPT
