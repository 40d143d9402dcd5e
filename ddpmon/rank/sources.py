"""The sample sources of one rank: host metrics (psutil), and on a GPU its NVML metrics and
torch's allocator."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from ..collectors import Sample, host, nvml

log = logging.getLogger("ddpmon")


def rank_sources(
    job: str,
    rank: int,
    device: str,
    use_nvml: bool,
    note: Callable[[str, str | None], None] | None = None,
) -> tuple[list[Callable[[], Iterable[Sample]]], list[Callable[[], None]]]:
    """The sample sources of one rank and what to close at detach: host metrics (psutil)
    always; on a CUDA device also its GPU (NVML, when ``use_nvml``) and torch's allocator.
    A part that cannot start logs why, once, and stays off; what is wrong with the GPU's
    metrics also goes to ``note("gpu_metrics", text)`` (the recorder's: the state file)."""

    def gpu_note(text: str) -> None:
        if note is not None:
            note("gpu_metrics", text)

    base = {"job": job, "rank": str(rank)}
    sources: list[Any] = []
    closers: list[Callable[[], None]] = []
    try:
        sources.append(host.ProcessSampler(base).samples)
    except Exception as exc:
        log.warning("ddpmon: rank %d: host metrics are off: %r", rank, exc)
    if not device.startswith("cuda"):
        return sources, closers
    try:
        import torch

        from . import torch_memory

        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        uuid, pci_bus_id = torch_memory.device_identity(index)
        gpu = nvml.rank_gpu(job, rank, index, uuid, pci_bus_id, note=gpu_note) if use_nvml else None
        if gpu is not None:
            sources.append(gpu.samples)
            closers.append(gpu.close)
            labels = gpu.labels
        else:  # without NVML: torch's index and UUID
            labels = {**base, "gpu": str(index), "gpu_uuid": uuid or ""}
        sources.append(torch_memory.AllocatorStats(index, labels).samples)
    except Exception as exc:
        log.warning("ddpmon: rank %d: GPU metrics are off: %r", rank, exc)
        gpu_note(f"GPU metrics are off: {exc!r}")
    return sources, closers
