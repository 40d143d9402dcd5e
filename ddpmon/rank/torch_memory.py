"""What torch knows about a rank's CUDA device: its identity, and its caching allocator.

The identity (UUID, PCI bus id) lets collectors/nvml.py find the same device in NVML. The
allocator statistics are host-side counters of torch's caching allocator: reading them
never synchronizes the device, never initialises CUDA, and takes one pass per sample.
"""

from __future__ import annotations

from typing import Any

import torch

from ..fuses import Fuse

Sample = tuple[str, dict[str, str], float]


def device_identity(index: int) -> tuple[str | None, str | None]:
    """(UUID ``GPU-…``, PCI bus id ``DDDDDDDD:BB:DD.0``) of ``cuda:<index>``; None where
    torch does not say (older torch has no PCI fields; some platforms no UUID)."""
    props: Any = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    uuid_text = str(uuid) if uuid else None
    if uuid_text and uuid_text[:4].upper() not in ("GPU-", "MIG-"):
        uuid_text = "GPU-" + uuid_text
    domain, bus, device = (getattr(props, f"pci_{n}_id", None) for n in ("domain", "bus", "device"))
    pci = None
    if bus is not None and device is not None:
        pci = f"{int(domain or 0):08X}:{int(bus):02X}:{int(device):02X}.0"
    return uuid_text, pci


class AllocatorStats:
    """Allocated, reserved and peak-allocated bytes of torch's allocator on one device."""

    KEYS = (
        ("ddpmon_torch_memory_allocated_bytes", "allocated_bytes.all.current"),
        ("ddpmon_torch_memory_reserved_bytes", "reserved_bytes.all.current"),
        ("ddpmon_torch_memory_peak_allocated_bytes", "allocated_bytes.all.peak"),
    )

    def __init__(self, index: int, labels: dict[str, str]) -> None:
        self.index = index
        self.labels = dict(labels)
        self._fuse = Fuse(f"torch allocator metrics (cuda:{index})")

    def samples(self) -> list[Sample]:
        if not self._fuse.ok:
            return []
        try:
            stats = torch.cuda.memory_stats(self.index)  # {} until CUDA is initialised
        except Exception as exc:
            self._fuse.blow(exc)
            return []
        if not stats:
            return []
        return [(name, self.labels, float(stats.get(key, 0))) for name, key in self.KEYS]


def history_sample(device: Any, base: Any) -> dict[str, Any]:
    """The history's GPU columns, once per batch of steps (each read that fails is left out)."""
    out = dict(base())
    for key, read, scale in (
        ("torch_memory_allocated_bytes", torch.cuda.memory_allocated, 1),
        ("gpu_utilization_ratio", torch.cuda.utilization, 0.01),  # NVML's percent
        ("gpu_memory_used_bytes", getattr(torch.cuda, "device_memory_used", None), 1),
    ):
        try:
            out[key] = read(device) * scale  # type: ignore[misc]
        except Exception:
            pass
    return out
