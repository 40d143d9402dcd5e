"""Samples and tokens of each step, and the model's FLOPs per step, counted once.

The step hooks' forward pre-hook (``hooks/step.py``), once it has closed a step that ends at
this forward, hands each training forward's arguments here, and their batch is added to the
step in progress: the first dimension of its first input (samples) and, where that input is
a 2-D integer tensor (token ids), its elements (tokens). The recorder turns them into rates
over step time (``recorder._throughput``).

FLOPs: at the first training forward of step ``COUNT_STEP`` torch's FLOP counter
(``torch.utils.flop_counter.FlopCounterMode``) is entered on the training thread, and it
stays on until that step ends: forward, backward (autograd carries the mode to its threads)
and every micro-step of the optimizer step. Then it is removed for good, and the hot path is
this hook's counting again. The counter reads the operators' arguments and runs each
operator as it is, so the step's results are the same bit for bit
(tests/distributed/test_throughput.py compares them). A failure switches the count off (its
fuse), never the training; samples and tokens go on.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

from .. import peaks
from ..fuses import Fuse
from ..state import schema
from . import torch_api
from .advice.data import first_tensor
from .recorder import Recorder

COUNT_STEP = 3
"""The step whose FLOPs are counted: past the first two, which do one-off work (DDP
rebuilds its buckets after the first; lazy initialisation)."""
TOKEN_IDS = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


class Throughput:
    """The batch of each training forward, and the FLOP count of step ``COUNT_STEP``;
    ``step_ended`` from the step boundary, ``remove()`` at detach."""

    def __init__(self, recorder: Recorder, device: str, fuse: Fuse, flop_fuse: Fuse) -> None:
        self._rec = recorder
        self._fuse = fuse
        self._waiting: FlopCount | None = FlopCount(recorder, device, flop_fuse)
        """The count, until its step starts."""
        self._counting: FlopCount | None = None
        self._removed = False

    def forward_started(self, args: Any, kwargs: Any) -> None:
        """A training forward starts with these arguments (from the step hooks' pre-hook,
        which has checked that gradients are on and nothing compiles)."""
        if not self._fuse.ok or self._removed:
            return
        try:
            x = (
                args[0]
                if args and isinstance(args[0], torch.Tensor)
                else first_tensor(args, kwargs)
            )
            if x is not None and (shape := x.shape):
                tokens = shape[0] * shape[1] if len(shape) == 2 and x.dtype in TOKEN_IDS else 0
                self._rec.batch_seen(shape[0], tokens)
            if self._waiting is not None and self._rec.steps + 1 >= COUNT_STEP:
                self._counting, self._waiting = self._waiting, None  # (one try, whatever happens)
                self._counting.start(self._rec.steps + 1)
        except Exception as exc:
            self._fuse.blow(exc)

    def step_ended(self, steps: int) -> None:
        """A step ended: the FLOP count of that step, if it ran, ends."""
        if self._counting is not None and self._counting.stop(steps):
            self._counting = None

    def remove(self) -> None:
        self._removed = True
        if self._counting is not None:
            self._counting.stop(None)


class FlopCount:
    """torch's FLOP counter over one step of the training thread, once."""

    def __init__(self, recorder: Recorder, device: str, fuse: Fuse) -> None:
        self._rec = recorder
        self._device = device
        self._fuse = fuse
        self._mode: Any = None
        self._thread = 0
        self._step = 0
        self._by_dtype: collections.Counter[str] = collections.Counter()
        self._failed = False

    def start(self, step: int) -> None:
        """Count the FLOPs of ``step`` (the step in progress), from now to its end."""
        if not self._fuse.ok:
            return
        try:
            mode = torch_api.flop_counter(self._seen)
        except torch_api.Missing as missing:
            torch_api.off(missing, self._rec)
            return
        try:
            self._step, self._thread = step, threading.get_ident()
            mode.__enter__()
            self._mode = mode
            self._rec.slowed_step = step
        except Exception as exc:
            self._fuse.blow(exc)

    def stop(self, steps: int | None) -> bool:
        """At the end of a step (``steps`` done; None: detach): the count ends, on the thread
        that started it. True once it has ended."""
        mode = self._mode
        if mode is None:
            return True
        if threading.get_ident() != self._thread:
            return False  # the mode is the training thread's; it ends there
        self._mode = None
        try:
            mode.__exit__(None, None, None)
            if steps is None:
                return True  # detached before the counted step ended: no count, nothing failed
            if steps != self._step:
                raise RuntimeError(
                    f"step {self._step} was not seen to end (the count stopped at step {steps})"
                )
            if self._failed:
                raise RuntimeError("torch's FLOP counter failed on an operator of the step")
            self._rec.flop_count = self._result(int(mode.get_total_flops()))
        except Exception as exc:
            self._fuse.blow(exc)
        return True

    def _seen(self, flops: int, args: tuple[Any, ...]) -> None:
        """What a formula of torch's counter counted (-1: it failed), by the operator's type."""
        if flops < 0:
            self._failed = True
            return
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        operand = next((t for t in tensors if t.dim() >= 2), tensors[0] if tensors else None)
        self._by_dtype[str(operand.dtype) if operand is not None else "?"] += flops

    def _result(self, total: int) -> schema.FlopCount:
        dtype = None
        if self._by_dtype:
            cuda = self._device.startswith("cuda")
            tf32 = cuda and torch.get_float32_matmul_precision() != "highest"
            dtype = peaks.dtype_key(max(self._by_dtype, key=self._by_dtype.__getitem__), tf32)
        name = torch.cuda.get_device_name(self._device) if self._device.startswith("cuda") else None
        # (CUDA's device name is the one NVML gives: the driver's, e.g. "NVIDIA H100 80GB HBM3")
        peak = peaks.peak(name, dtype)
        return schema.FlopCount(
            total,
            self._step,
            dtype,
            name,
            peak.flops_per_second if peak else None,
            peak.source if peak else None,
        )
