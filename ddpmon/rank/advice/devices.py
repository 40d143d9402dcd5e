"""device_mismatch, shared_gpu: which GPU each rank uses, against LOCAL_RANK.

A rank whose device index differs from LOCAL_RANK (``torch.device(rank)`` on a one-node job
where RANK and LOCAL_RANK happen to differ, or every rank on ``cuda:0`` because
``torch.cuda.set_device(local_rank)`` is missing) crowds one GPU and leaves others idle. The
check is a pure function of what torch reports, so it is tested with fakes; the GPU's UUID
goes into the state file, where ranks on one GPU show up side by side (``compare``).
"""

from __future__ import annotations

from typing import NamedTuple

from ...advice.words import FIX


class DeviceFacts(NamedTuple):
    device: str
    """The device of the model's parameters (``cuda:1``, ``cpu``)."""
    rank: int
    local_rank: int | None
    """From LOCAL_RANK; None when it is not set."""
    device_count: int
    """GPUs this process sees."""
    current_device: int | None
    """torch.cuda.current_device(), None without CUDA."""


class Found(NamedTuple):
    kind: str
    summary: str
    evidence: list[str]
    fix: str


def check(f: DeviceFacts) -> Found | None:
    """device_mismatch, or None when the device fits LOCAL_RANK (or is not a GPU)."""
    if not f.device.startswith("cuda") or f.local_rank is None:
        return None
    index = int(f.device.partition(":")[2] or (f.current_device or 0))
    evidence = [
        f"model on {f.device}; RANK={f.rank}, LOCAL_RANK={f.local_rank}; "
        f"{f.device_count} GPU(s) visible; current device {f.current_device}"
    ]
    if f.device_count <= 1:
        return None  # one GPU per process (CUDA_VISIBLE_DEVICES): cuda:0 is right
    if index != f.local_rank and f.local_rank < f.device_count:
        cause = (
            "the global rank used as device index"
            if index == f.rank != f.local_rank
            else "torch.cuda.set_device(local_rank) missing"
            if index == 0
            else "a device index that is not LOCAL_RANK"
        )
        return Found(
            "device_mismatch",
            f"rank {f.rank} runs on {f.device}, but its LOCAL_RANK is {f.local_rank} ({cause})",
            evidence,
            FIX["device_mismatch"],
        )
    if f.current_device is not None and f.current_device != index:
        return Found(
            "device_mismatch",
            f"rank {f.rank}: the model is on {f.device} but the current CUDA device is "
            f"cuda:{f.current_device}; collectives and new tensors go to cuda:{f.current_device}",
            evidence,
            FIX["device_mismatch"],
        )
    return None


def gpu_uuid(device: str) -> str | None:
    """The NVML-style UUID (``GPU-...``) of a CUDA device, None elsewhere."""
    if not device.startswith("cuda"):
        return None
    try:
        import torch

        index = int(device.partition(":")[2] or torch.cuda.current_device())
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    except Exception:
        return None
