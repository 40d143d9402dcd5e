"""The GPU's own step parts (ddpmon/rank/gpu_steps.py): the intervals between CUDA events turned
into parts, steps resolved only once every event passed, what falls back to the host's
parts, the step book counting each step once, and the clock wired into a real DDP job's
hooks. There is no GPU here: ``HostEvent`` stands in for ``torch.cuda.Event`` with the
host's clock (tests/gpu runs the real one)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ddpmon.fuses import Fuse
from ddpmon.rank import gpu_steps
from ddpmon.rank.books import StepBook
from ddpmon.rank.gpu_steps import GpuStepClock, parts
from ddpmon.rank.recorder import StepRecord
from ddpmon.steps import PARTS


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


def marks(*named: tuple[str, float]) -> list[list[Any]]:
    return [[name, HostEvent(at), True] for name, at in named]


def clock(capturing: bool = False, failures: list[str] | None = None) -> GpuStepClock:
    fuse = Fuse(
        "gpu_step_parts", lambda part, msg: (failures if failures is not None else []).append(msg)
    )
    return GpuStepClock(
        "cuda:0", fuse, event=HostEvent, stream=lambda: None, capturing=lambda: capturing
    )


WHOLE = ("forward_start", "forward_end", "backward_start", "grad_ready", "synced")


def test_intervals_become_parts_and_sum_to_the_span() -> None:
    step = marks(
        ("start", 0.0),
        ("forward_start", 0.010),
        ("forward_end", 0.030),
        ("backward_start", 0.032),
        ("grad_ready", 0.070),
        ("synced", 0.085),
        ("optimizer_start", 0.086),
        ("optimizer_end", 0.096),
        ("end", 0.100),
    )
    got = parts(step)
    assert got == pytest.approx(
        {
            "data_wait": 0.010,
            "forward": 0.020,
            "backward": 0.038,
            "exposed_comm": 0.015,
            "optimizer": 0.010,
            "other": 0.007,
            "step": 0.100,
            "exposed_measured": 1.0,
        }
    )


def test_micro_steps_add_up_and_only_the_first_forward_waits_for_data() -> None:
    step = marks(
        ("start", 0.0),
        ("forward_start", 0.005),
        ("forward_end", 0.010),
        ("backward_start", 0.010),
        ("grad_ready", 0.020),
        ("forward_start", 0.024),
        ("forward_end", 0.029),
        ("backward_start", 0.029),
        ("grad_ready", 0.039),
        ("synced", 0.045),
        ("end", 0.046),
    )
    got = parts(step)
    assert got["data_wait"] == pytest.approx(0.005)  # the 4 ms between micro-steps is other
    assert got["forward"] == pytest.approx(0.010) and got["backward"] == pytest.approx(0.020)
    assert got["exposed_comm"] == pytest.approx(0.006) and got["other"] == pytest.approx(0.005)


def test_steps_wait_for_the_gpu_and_what_it_did_not_see_whole_keeps_the_hosts_parts() -> None:
    c = clock()
    for name in WHOLE:
        c.mark(name)
    HostEvent.done = False
    try:
        c.close(1)
        assert c.collect() == []  # not passed yet: nothing waits
    finally:
        HostEvent.done = True
    ((step, got),) = c.collect()
    assert step == 1 and got is not None and got["step"] > 0
    # torch.compile: only the optimizer hooks run; a forward with grad and no backward
    c.mark("optimizer_start")
    c.mark("optimizer_end")
    c.close(2)
    assert c.collect() == [(2, None)]
    # marks during CUDA graph capture would be replayed, not recorded now; and nothing is
    # queried while a capture runs (it would invalidate the capture)
    capturing = [True]
    captured = GpuStepClock(
        "cuda:0",
        Fuse("gpu_step_parts"),
        event=HostEvent,
        stream=lambda: None,
        capturing=lambda: capturing[0],
    )
    for name in WHOLE:
        captured.mark(name)
    captured.close(1)
    assert captured.collect() == []
    capturing[0] = False
    assert captured.collect() == [(1, None)]


def test_a_late_close_shares_its_last_event_with_the_next_steps_start() -> None:
    c = clock()
    for name in WHOLE:
        c.mark(name)
    c.close(1, late=True)  # no optimizer step: closed at the next forward
    time.sleep(0.02)  # the data loader, while the GPU idles
    for name in WHOLE:
        c.mark(name)
    c.close(2, late=True)
    (_, first), (_, second) = c.collect()
    assert first is not None and second is not None
    assert second["data_wait"] >= 0.02  # from the end of step 1's synchronisation
    assert first["other"] < 0.005  # and not in step 1
    # a step that ended unmarked (too many marks) gives the next one no start: host parts
    c = clock()
    for _ in range(gpu_steps.MAX_MARKS + 1):
        c.mark("forward_start")
    c.close(1, late=True)
    for name in WHOLE:
        c.mark(name)
    c.close(2, late=True)
    assert c.collect() == [(1, None), (2, None)]


def test_steps_dropped_or_pending_at_detach_or_after_a_failure_keep_the_hosts_parts() -> None:
    c = clock()
    HostEvent.done = False
    try:
        for step in range(1, gpu_steps.MAX_PENDING + 3):
            for name in WHOLE:
                c.mark(name)
            c.close(step)
        assert c.collect() == [(1, None), (2, None)]  # dropped: more than MAX_PENDING waited
        assert [s for s, p in c.collect(final=True)] == list(range(3, gpu_steps.MAX_PENDING + 3))
    finally:
        HostEvent.done = True
    failures: list[str] = []
    broken = clock(failures=failures)
    for name in WHOLE:
        broken.mark(name)
    broken.close(1)

    def fail() -> HostEvent:
        raise RuntimeError("CUDA error: an illegal memory access")

    broken._new_event, broken._free = fail, []
    broken.mark("forward_start")
    assert not broken.ok and failures == ["RuntimeError: CUDA error: an illegal memory access"]
    assert broken.collect() == [(1, None)]


def record(step: int, pending: bool, comm: float | None = 0.002) -> StepRecord:
    return StepRecord(
        step, 1000.0 + step, 0.050, 0.010, 0.020, 0.005, comm, 0.004, 1, gpu_parts_later=pending
    )


GPU = {
    "data_wait": 0.001,
    "forward": 0.030,
    "backward": 0.060,
    "exposed_comm": 0.004,
    "optimizer": 0.002,
    "other": 0.003,
    "step": 0.100,
    "exposed_measured": 1.0,
}


def test_the_book_counts_each_step_once_with_its_final_parts() -> None:
    book = StepBook()
    book.add(record(1, pending=True))
    assert book.hist["step"].count == 0 and book.phase_totals["forward"] == 0.0  # not yet
    book.exposed(1, 0.008)  # the bucket clock came first: held with the row
    book.gpu_parts(1, dict(GPU))
    row = book.history[-1]
    assert row.gpu_parts and not row.gpu_pending
    assert row.step_seconds == 0.100 and row.forward_seconds == 0.030
    assert row.exposed_comm_seconds == 0.004  # the GPU measured it
    assert sum(row.part(p) or 0.0 for p in PARTS) == pytest.approx(0.100)
    assert book.hist["step"].count == 1 and book.hist["exposed_comm"].count == 1
    assert book.phase_totals["forward"] == pytest.approx(0.030)
    book.exposed(1, 0.009)  # late: the GPU's stands, nothing counted twice
    book.gpu_parts(1, dict(GPU))
    assert row.exposed_comm_seconds == 0.004 and book.hist["step"].count == 1
    # a step whose host parts stand is counted with them, once
    book.add(record(2, pending=True))
    book.gpu_parts(2, None)
    assert book.hist["step"].count == 2 and book.phase_totals["forward"] == pytest.approx(0.040)
    # and a step that never synchronised keeps the bucket clock's figure (none measured)
    book.add(record(3, pending=True))
    book.exposed(3, 0.007)
    book.gpu_parts(3, dict(GPU, exposed_measured=0.0))
    assert book.history[-1].exposed_comm_seconds == 0.007


class SleepInBackward:
    """A module whose backward takes ``seconds`` longer (an autograd Function)."""

    @staticmethod
    def build(seconds: float) -> Any:
        import torch

        class Slow(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                return x.view_as(x)

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                time.sleep(seconds)
                return grad

        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(40)])

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return Slow.apply(self.layers(x))

        return Net()


def train(tmp_path: Path, with_clock: bool, **ddp_options: Any) -> tuple[list[dict[str, Any]], int]:
    """12 steps of a real one-rank DDP job (a 4 ms data loader, a 10 ms backward): its rows
    and how many steps its step histogram counted."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpmon

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        model = DDP(SleepInBackward.build(0.010), **ddp_options)
        mon = ddpmon.attach(model, job="gpu-steps", port=-1, state_dir=None)
        rec = mon.recorder
        if with_clock:
            rec.gpu_steps = clock()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(12):
            time.sleep(0.004)  # the data loader
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(32, 64)), torch.randn(32, 64)).backward()
            opt.step()
        mon.detach()
        return rec.history_since(0), rec.histograms()["step"].count
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "options", [{}, {"find_unused_parameters": True}], ids=["default", "find_unused"]
)
def test_a_real_ddp_job_gets_its_parts_from_the_clock(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    """The hooks mark every boundary, once per backward even when every parameter's
    gradient is watched (find_unused_parameters): the clock's parts replace the host's."""
    rows, counted = train(tmp_path, True, **options)
    assert [r.step for r in rows] == list(range(1, 13)) and counted == 12  # each step once
    assert not any(r.gpu_pending for r in rows)
    timed = [r for r in rows if r.gpu_parts]
    assert len(timed) == 12, rows
    for r in timed[1:]:  # the first step starts at its forward: no data wait
        assert 0.004 <= r.data_wait_seconds < r.step_seconds, r
        assert r.backward_seconds >= 0.010 and r.micro_steps == 1, r
        assert r.forward_seconds > 0 and r.optimizer_seconds > 0, r
        total = sum(r.part(p) or 0.0 for p in PARTS)
        assert total == pytest.approx(r.step_seconds, abs=1e-6)


@pytest.mark.timeout(120)
def test_watching_every_gradient_neither_cuts_backward_nor_counts_micro_steps_per_parameter(
    tmp_path: Path,
) -> None:
    """With find_unused_parameters each parameter's gradient calls the recorder: backward
    compute still runs to its end, and one backward is one micro-step (host parts)."""
    rows, _ = train(tmp_path, False, find_unused_parameters=True)
    for r in rows[1:]:
        assert r.backward_seconds >= 0.010 and r.micro_steps == 1, r


def test_behind_is_how_long_the_gpu_has_not_reached_the_last_mark() -> None:
    c = clock()
    assert c.behind() is None  # nothing marked yet
    c.mark("forward_start")
    assert c.behind() is None  # the "GPU" passed it
    HostEvent.done = False
    try:
        time.sleep(0.05)
        assert c.behind() == pytest.approx(0.05, abs=0.04)
    finally:
        HostEvent.done = True
    assert c.behind() is None
