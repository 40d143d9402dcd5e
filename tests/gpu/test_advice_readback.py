"""Advice on a GPU: fingerprints and NaN flags come back without a synchronisation and
agree with the same values computed on the CPU (skipped without a GPU)."""

from __future__ import annotations

import time

import torch

from ddpmon.rank.advice.nonfinite import NonFiniteWatch
from ddpmon.rank.advice.readback import Pending, crc, sample


def wait(pending: Pending, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not pending.ready():
        assert time.monotonic() < deadline, "the copy never completed"
        time.sleep(0.001)


def test_sampled_checksum_is_the_same_on_gpu_and_cpu() -> None:
    x = torch.randn(64, 3, 32, 32)
    on_gpu = Pending(sample(x.cuda(), 8))
    wait(on_gpu)
    assert crc(on_gpu.values()) == crc(Pending(sample(x, 8)).values())


def test_nonfinite_gradient_is_named_a_step_later() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).cuda()
    watch = NonFiniteWatch(list(model.named_parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    found = False
    for step in range(1, 8):
        x = torch.randn(4, 8, device="cuda")
        if step == 3:
            x[0, 0] = float("nan")
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        torch.cuda.current_stream().synchronize()  # (the test's own wait, not ddpmon's)
        found = watch.step_ended(step) or found
    assert found and watch.first is not None and watch.first[0] == 3
    watch.remove()
