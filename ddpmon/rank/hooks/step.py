"""Step boundaries and phases, found without any call from the training loop.

A forward pre-hook on the DDP module marks the start of a forward; a forward hook its end
and, through a hook on the output tensor, the start of backward. A step ends at its
optimizer step once its gradients were synchronised (hooks/optimizer.py); a step without
one ends where DDP finished synchronising its gradients, found at the next forward (or at
detach), so time after the loop never enters a step. Both ask ``rank/boundary.py``, the one
owner of a step's end. Forwards under ``no_sync`` belong to
the step in progress (micro-steps); forwards without grad (evaluation) are a heartbeat and
no step. Once a loop calls ``Monitor.step()``, steps end only there.

These are ddpmon's only hooks on the DDP module: the other parts that look at DDP's forward
hear of it from them (the throughput and the advice at its start, the advice and the unused
parameter watch at its end, also when it raised), where a hook each would put several more
calls on every step.

Under torch.compile the module hooks step aside while Dynamo traces (they would add a graph
break); a compiled model's steps are still counted at its optimizer steps, whose hooks run
outside the compiled graph.

Two autograd final callbacks bracket DDP's own: the first marks the end of backward
compute, the second runs after DDP has waited for its buckets (a torch without
``queue_callback`` goes without both, said once: steps then end at their optimizer step). The
``timelines`` (a bucket clock, the untimed bucket marks: see ddpmon/rank/timing/) hear of each
forward, the start of backward and of both callbacks, those they do something at.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from ...fuses import Fuse
from .. import torch_api
from ..boundary import StepBoundary
from ..recorder import Recorder


class StepHooks:
    """Forward pre/post hooks on the DDP module that feed the Recorder's step scratch."""

    def __init__(
        self,
        ddp: torch.nn.Module,
        recorder: Recorder,
        boundary: StepBoundary,
        fuse: Fuse,
        timelines: Sequence[Any] = (),
    ) -> None:
        # Each timeline's methods for the events it hears, bound once (``IGNORES``: the
        # events a timeline does nothing at, left out of the calls).
        self._on_forward = _hearing(timelines, "forward_started")
        self._on_backward = _hearing(timelines, "backward_started")
        self._on_backward_done = _hearing(timelines, "backward_done")
        self._on_synced = _hearing(timelines, "sync_done")
        self._ddp = ddp
        self._recorder = recorder
        self._boundary = boundary
        self._fuse = fuse
        self._sync_expected = False
        self._in_backward = False  # a backward started and its end callback is queued
        try:
            self._queue: Any = torch_api.autograd_callback_queue()
        except torch_api.Missing as missing:  # steps end at their optimizer step
            torch_api.off(missing, recorder)
            self._queue = None
        if _compile_check_missing is not None:
            torch_api.off(_compile_check_missing, recorder)
        self._handles = [
            ddp.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            # always called: also when DDP's forward raised (the watch explains DDP's error)
            ddp.register_forward_hook(self._after_forward, always_call=True),
        ]

    def _before_forward(self, _module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if is_compiling():
            return
        training = torch.is_grad_enabled()
        boundary = self._boundary
        if self._fuse.ok:
            try:
                now = time.perf_counter()
                rec = self._recorder
                if not training:
                    rec.evaluating(now)  # alive, and no part of a step
                else:
                    if not boundary.manual and (
                        rec.step_has_synced or (self._sync_expected and boundary.backward_seen())
                    ):
                        boundary.end(now, rec.step_end_mark)  # a step without an optimizer step
                    self._sync_expected = bool(
                        getattr(self._ddp, "require_backward_grad_sync", True)
                    )
                    self._in_backward = False  # (a backward that raised never ran its callback)
                    for heard in self._on_forward:
                        heard()
                    rec.forward_started(now)
            except Exception as exc:
                self._fuse.blow(exc)
        if not training:
            return
        # The step that ended here is closed before the batch counts in the next and the
        # advice checks the next (each guards itself). The advice hears of every training
        # forward of DDP's, also once the step hooks are off: which forwards are DDP's is
        # what it checks.
        if boundary.throughput is not None and self._fuse.ok:
            boundary.throughput.forward_started(args, kwargs)
        if boundary.advice is not None:
            boundary.advice.ddp_forward_started(args, kwargs)

    def _after_forward(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        if is_compiling():
            return
        boundary = self._boundary
        if boundary.advice is not None:
            boundary.advice.ddp_forward_ended()
        if output is None and (error := sys.exc_info()[1]) is not None:
            if boundary.unused is not None:  # DDP's forward raised (this hook is always called)
                boundary.unused.forward_failed(error)
            return
        if not self._fuse.ok or not torch.is_grad_enabled():
            return
        try:
            self._recorder.forward_finished(time.perf_counter())
            # Every output tensor autograd may reach: the loss may use any of them, and
            # the first whose gradient arrives marks the start of backward.
            for tensor in _grad_tensors(output):
                torch_api.hook_tensor(tensor, self._backward_started)
        except Exception as exc:
            self._fuse.blow(exc)

    def _backward_started(self, _grad: torch.Tensor) -> None:
        if self._fuse.ok and not self._in_backward:
            try:
                self._in_backward = True
                rec = self._recorder
                rec.backward_started(time.perf_counter())
                if self._on_backward:
                    start = rec.step_start
                    for heard in self._on_backward:
                        heard(start)
                # Runs once the autograd graph is done, before DDP waits for its buckets:
                # the end of backward compute, whatever hooks there are.
                if self._queue is not None:
                    self._queue(self._backward_done)
            except Exception as exc:
                self._fuse.blow(exc)

    def _backward_done(self) -> None:
        self._in_backward = False
        if self._fuse.ok:
            try:
                now = time.perf_counter()
                for heard in self._on_backward_done:  # (the untimed buckets' list first)
                    heard(self._sync_expected)
                self._recorder.backward_done(now, self._sync_expected)
                # Queued now, it runs after DDP's finalize (queued during backward).
                self._queue(self._synced)
            except Exception as exc:
                self._fuse.blow(exc)

    def _synced(self) -> None:
        if self._fuse.ok:
            try:
                for heard in self._on_synced:
                    heard(self._sync_expected)
                if self._sync_expected:
                    self._recorder.gradients_synced(time.perf_counter())
            except Exception as exc:
                self._fuse.blow(exc)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _compile_check() -> tuple[Any, torch_api.Missing | None]:
    try:
        return torch_api.compiling_check(), None
    except torch_api.Missing as missing:  # said at attach
        return (lambda: False), missing


is_compiling, _compile_check_missing = _compile_check()
"""True while torch.compile (Dynamo) traces the model: ddpmon's hooks then step aside, so
that they add no graph break (their clock and attribute writes cannot be traced). torch's
own function, bound once: the hooks ask it on every call."""


def _hearing(timelines: Sequence[Any], event: str) -> tuple[Any, ...]:
    """The timelines' bound methods for ``event``, of those that do something at it."""
    return tuple(
        getattr(t, event) for t in timelines if event not in getattr(t, "IGNORES", frozenset())
    )


def _grad_tensors(output: Any, depth: int = 0, limit: int = 16) -> list[torch.Tensor]:
    """The output's tensors that autograd may reach: in tuples, lists, dicts, dataclasses and
    plain objects, looked for shallowly, at most 16."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if depth > 2:
        return []
    if isinstance(output, dict):
        output = list(output.values())
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        output = [getattr(output, f.name, None) for f in dataclasses.fields(output)]
    elif hasattr(output, "__dict__") and not isinstance(output, (list, tuple)):
        output = list(vars(output).values())  # a plain object holding the tensors
    found: list[torch.Tensor] = []
    if isinstance(output, (list, tuple)):
        for item in output[:limit]:
            found += _grad_tensors(item, depth + 1, limit - len(found))
            if len(found) >= limit:
                break
    return found
