"""The GPU's own step parts (ddpmon/gpu_steps.py): the intervals between CUDA events turned
into parts, steps resolved only once every event passed, a failure switching the clock off,
and the clock wired into a real DDP job's hooks. There is no GPU here: ``HostEvent`` stands
in for ``torch.cuda.Event`` with the host's clock (tests/gpu runs the real one)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from ddpmon._safety import Fuse
from ddpmon.gpu_steps import GpuStepClock, parts


class HostEvent:
    """``torch.cuda.Event``'s interface on the host clock; ``done`` says whether the "GPU"
    has passed it."""

    done = True

    def __init__(self, at: float | None = None) -> None:
        self.at = at

    def record(self, _stream: Any = None) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return HostEvent.done

    def elapsed_time(self, end: HostEvent) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1000.0


def marks(*named: tuple[str, float]) -> list[tuple[str, HostEvent]]:
    return [(name, HostEvent(at)) for name, at in named]


def test_intervals_become_parts_and_sum_to_the_step() -> None:
    step = marks(("start", 0.0), ("forward_start", 0.010), ("forward_end", 0.030), ("backward_start", 0.032),
                 ("grad_ready", 0.070), ("synced", 0.085), ("optimizer_start", 0.086),
                 ("optimizer_end", 0.096), ("end", 0.100))
    got = parts(step)
    assert got == pytest.approx({"data_wait": 0.010, "forward": 0.020, "backward": 0.038,
                                 "exposed_comm": 0.015, "optimizer": 0.010, "other": 0.007})
    assert sum(got.values()) == pytest.approx(0.100)


def test_micro_steps_add_up_and_only_the_first_forward_waits_for_data() -> None:
    step = marks(("start", 0.0), ("forward_start", 0.005), ("forward_end", 0.010), ("backward_start", 0.010),
                 ("grad_ready", 0.020), ("forward_start", 0.024), ("forward_end", 0.029),
                 ("backward_start", 0.029), ("grad_ready", 0.039), ("synced", 0.045), ("end", 0.046))
    got = parts(step)
    assert got["data_wait"] == pytest.approx(0.005)  # the 4 ms between micro-steps is other
    assert got["forward"] == pytest.approx(0.010) and got["backward"] == pytest.approx(0.020)
    assert got["exposed_comm"] == pytest.approx(0.006) and got["other"] == pytest.approx(0.005)


def test_steps_wait_for_every_event_and_a_failure_switches_the_clock_off() -> None:
    failures: list[str] = []
    clock = GpuStepClock("cuda:0", Fuse("gpu_step_parts", lambda part, msg: failures.append(msg)),
                         event=HostEvent, stream=lambda: None)
    for name in ("forward_start", "forward_end", "backward_start", "grad_ready", "synced"):
        clock.mark(name)
    HostEvent.done = False
    try:
        clock.close(1)
        assert clock.collect() == []  # the GPU has not passed them: nothing waits
    finally:
        HostEvent.done = True
    (step, got), = clock.collect()
    assert step == 1 and set(got) == {"data_wait", "forward", "backward", "exposed_comm", "optimizer", "other"}

    def broken() -> HostEvent:
        raise RuntimeError("CUDA error: an illegal memory access")
    clock._new_event, clock._free = broken, []
    clock.mark("forward_start")
    assert not clock.ok and failures == ["RuntimeError: CUDA error: an illegal memory access"]
    clock.close(2)
    assert clock.collect() == []


@pytest.mark.timeout(120)
def test_a_real_ddp_job_gets_its_parts_from_the_clock(tmp_path: Path) -> None:
    """The hooks mark every boundary: the clock's parts replace the host's in the rows, and
    agree with them (both are host time here)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpmon

    os.environ.setdefault("DDPMON_STATE_DIR", str(tmp_path / "state"))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)))
        mon = ddpmon.attach(model, job="gpu-steps", port=-1, state_dir=None)
        rec = mon.recorder
        rec.gpu_steps = GpuStepClock("cuda:0", Fuse("gpu_step_parts"), event=HostEvent, stream=lambda: None)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(12):
            time.sleep(0.004)  # the data loader
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(32, 64)), torch.randn(32, 8)).backward()
            opt.step()
        mon.detach()
        rows = rec.history_since(0)
    finally:
        dist.destroy_process_group()
    assert [r["step"] for r in rows] == list(range(1, 13))
    timed = [r for r in rows if r.get("gpu_parts")]
    assert len(timed) >= 11, rows  # every step the clock resolved (the last at detach)
    for r in timed[1:]:  # the first step starts at its forward: no data wait
        assert 0.004 <= r["data_wait_seconds"] < r["step_seconds"], r  # the sleep, and the batch made
        assert r["forward_seconds"] > 0 and r["backward_seconds"] > 0 and r["optimizer_seconds"] > 0, r
        total = sum(r[p + "_seconds"] or 0.0 for p in ("data_wait", "forward", "backward", "exposed_comm",
                                                        "optimizer", "other"))
        assert total == pytest.approx(r["step_seconds"], abs=1e-6)
