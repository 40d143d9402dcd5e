"""replicas_diverged, inner_module_forward: the model replicas must stay identical.

DDP keeps replicas equal by broadcasting rank 0's parameters at construction and averaging
gradients every step; anything that trains around it (``ddp.module(x)`` in a training
step, a rank-dependent initialisation after wrapping, buffers with
``broadcast_buffers=False``) makes them drift apart silently. Every few steps, at the start
of the inner module's forward (after DDP has broadcast its buffers), a few elements of
every parameter and buffer are sampled into per-tensor checksums; ``compare`` matches the
ranks' checksums of the same step. A training forward on the inner module outside DDP's
forward is reported at once, with its call site.
"""

from __future__ import annotations

import os
import sys

import torch

from .readback import Pending, crc, sample

PARAM_SAMPLE = 4
KEEP = 4
EVERY_UNTIL_100 = 10
LATER_EVERY = 50


def due(step: int) -> bool:
    return step % (EVERY_UNTIL_100 if step <= 100 else LATER_EVERY) == 0


class ParamPrints:
    """Per-tensor checksums of sampled elements of every parameter and buffer."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
        self.tensors += [(f"buffer:{name}", b) for name, b in module.named_buffers()]
        self.names = [name for name, _ in self.tensors]
        self.prints: list[tuple[int, int, list[int]]] = []
        self._pending: list[tuple[int, Pending, list[tuple[int, int]]]] = []
        self._last_step = -1

    def take(self, step: int) -> None:
        if step == self._last_step or not self.tensors:
            return
        self._last_step = step
        with torch.no_grad():
            by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
            for i, (_, t) in enumerate(self.tensors):
                by_device.setdefault(t.device, []).append((i, sample(t, PARAM_SAMPLE)))
            spans = [(i, s.numel()) for samples in by_device.values() for i, s in samples]
            first = next(iter(by_device))
            # One cat per device (dtypes promoted) and one cast: the samples are views.
            parts = [
                torch.cat([s for _, s in v]).to(torch.float32).to(first, non_blocking=True)
                for v in by_device.values()
            ]
            values = torch.cat(parts) if len(parts) > 1 else parts[0]
            self._pending.append((step, Pending(values), spans))

    @property
    def waiting(self) -> bool:
        """Checksums are on their way (from the GPU: a step later)."""
        return bool(self._pending)

    def collect(self) -> bool:
        if not self._pending:
            return False  # (most steps)
        arrived = False
        while self._pending and self._pending[0][1].ready():
            step, pending, spans = self._pending.pop(0)
            values = pending.values()
            per, at = [0] * len(self.tensors), 0
            for i, span in spans:  # (a tensor of fewer than PARAM_SAMPLE elements gives fewer)
                per[i] = crc(values[at : at + span])
                at += span
            self.prints.append((step, crc(per), per))
            arrived = True
        del self.prints[:-KEEP]
        return arrived


def call_site() -> str:
    """``file:line in function`` of the first frame outside torch and ddpmon."""
    frame = sys._getframe(1)
    torch_dir = os.path.dirname(torch.__file__)
    ddpmon_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((torch_dir, ddpmon_dir)) and "torch/nn/modules" not in path:
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"
