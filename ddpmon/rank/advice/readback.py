"""Small values read back from the GPU without a synchronisation: copied to pinned memory
without blocking, and read a step later once their CUDA event says they are there."""

from __future__ import annotations

import zlib
from typing import Any

import torch


class Pending:
    """A small tensor on its way to the CPU. On the CPU it is there at once."""

    __slots__ = ("_host", "_event")

    def __init__(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach()
        self._event: Any = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._host = host
        else:
            self._host = tensor.clone() if tensor.device.type == "cpu" else tensor.to("cpu")

    def ready(self) -> bool:
        """True once the copy is done (never waits)."""
        return self._event is None or bool(self._event.query())

    def values(self) -> list[Any]:
        return self._host.tolist()


def sample(tensor: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` elements of ``tensor`` at positions that depend only on its size (the same on
    every rank; all of them when it has ``k`` or fewer, a zero when it has none): a strided
    view of a contiguous tensor, no kernel, so that a fingerprint of every parameter is one
    ``cat`` of views (it was five tiny kernels per tensor)."""
    t = tensor.detach()
    n = t.numel()
    if n == 0:
        return torch.zeros(1, dtype=torch.float32, device=t.device)
    flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
    if n <= k:
        return flat
    stride = n // k
    return flat[stride // 2 :: stride][:k]


def crc(values: Any) -> int:
    """A stable 32-bit checksum of plain values (Python's hash() differs per process)."""
    return zlib.crc32(repr(values).encode())
