"""The peak table by NVML name, and a FLOP count that fails: it switches itself off with one
line, the training goes on bit for bit, and samples are still counted. One-rank gloo DDP
jobs in this process."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils import flop_counter

import ddpmon
from ddpmon import peaks
from ddpmon.rank import torch_api
from tests.support.in_process import STEPS, train

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4),
        ("NVIDIA H100 80GB HBM3", "float8", 1978.9),
        ("NVIDIA H100 PCIe", "bfloat16", 756),
        ("NVIDIA H200", "bfloat16", 989.4),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312),
        ("NVIDIA A100-SXM4-40GB", "tf32", 156),
        ("NVIDIA A100 80GB PCIe", "float16", 312),
        ("NVIDIA L4", "bfloat16", 121),
        ("NVIDIA L40S", "bfloat16", 362.05),
        ("NVIDIA A10", "float16", 125),
        ("Tesla V100-SXM2-32GB", "float16", 125),
        ("  nvidia  h100 80gb hbm3 ", "bfloat16", 989.4),  # NVML's spelling, spaces and case aside
    ],
)
def test_the_dense_peak_of_a_gpu_by_its_nvml_name(name: str, dtype: str, tflops: float) -> None:
    found = peaks.peak(name, dtype)
    assert found is not None and found.flops_per_second == pytest.approx(tflops * 1e12)
    assert "dense" in found.source


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("Tesla V100-SXM2-32GB", "bfloat16"),  # no BF16 tensor cores
        ("NVIDIA H100 80GB HBM3", "float64"),
        ("NVIDIA GeForce RTX 4090", "bfloat16"),  # not in the table: no guess
        ("NVIDIA H100", "bfloat16"),  # a prefix is not a name
        (None, "float32"),  # a CPU
        ("NVIDIA H100 80GB HBM3", None),
    ],
)
def test_no_peak_where_it_is_not_known(name: str | None, dtype: str | None) -> None:
    assert peaks.peak(name, dtype) is None


def test_dtype_keys() -> None:
    assert [
        peaks.dtype_key(d)
        for d in ("torch.bfloat16", "torch.float16", "torch.float8_e4m3fn", "float32")
    ] == ["bfloat16", "float16", "float8", "float32"]
    assert peaks.dtype_key("torch.float32", tf32=True) == "tf32"
    assert peaks.dtype_key("torch.bfloat16", tf32=True) == "bfloat16"


# -- a count that fails ---------------------------------------------------------------------


def trained(model: nn.Module) -> list[torch.Tensor]:
    """The parameters after STEPS steps from seed 0."""
    train(model)
    return [p.detach().clone() for p in model.parameters()]


def model() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)))


def run(tmp_path: Path) -> tuple[list[torch.Tensor], dict[str, Any]]:
    m = model()
    with ddpmon.attach(m, job="flops", port=-1, state_dir=str(tmp_path / "state")) as mon:
        params = trained(m)
        snap = mon.snapshot()
    return params, snap


def test_a_formula_that_raises_switches_the_count_off_and_nothing_else(
    group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    plain = trained(model())

    def broken(*_args: Any, **_kwargs: Any) -> int:
        raise ValueError("no formula for this shape")

    registry = dict(flop_counter.flop_registry)
    registry[torch.ops.aten.addmm] = broken
    monkeypatch.setattr(flop_counter, "flop_registry", registry)
    params, snap = run(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(plain, params))  # training as without ddpmon
    assert snap["step"] == STEPS and snap["throughput"]["samples_total"] == STEPS * 16
    assert (
        snap["throughput"]["flop_count"] is None
        and snap["throughput"]["achieved_flops_per_second"] is None
    )
    assert "failed on an operator" in snap["errors"]["flop_count"]
    assert set(snap["errors"]) == {"flop_count"}
    switched_off = [r for r in caplog.records if "flop_count failed" in r.getMessage()]
    assert len(switched_off) == 1 and switched_off[0].levelno == logging.WARNING
    assert torch._C._len_torch_dispatch_stack() == 0


def test_a_torch_without_the_counter_s_formulas_counts_samples_alone(
    group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch_api, "_said", set())
    monkeypatch.delattr(flop_counter, "flop_registry")
    _, snap = run(tmp_path)
    api = "torch.utils.flop_counter.flop_registry"
    off = snap["notes"]["torch_api"].splitlines()  # (torch 2.2 has no is_compiling either)
    assert f"{torch_api.FLOPS} off: torch {torch.__version__} has no {api}" in off, off
    assert not snap["errors"] and snap["throughput"]["flop_count"] is None
    assert snap["throughput"]["samples_per_second"] > 0
    assert sum(api in r.getMessage() for r in caplog.records) == 1
