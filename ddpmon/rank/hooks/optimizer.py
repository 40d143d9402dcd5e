"""The optimizer step: its time, its learning rate, and the end of a training step.

torch's global optimizer step hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook``
and ``..._post_hook``) run around ``step()`` of every ``torch.optim.Optimizer``, the user's
own subclasses included, with no change to the training loop. The post hook of an optimizer
that holds the model's parameters ends the step in progress once its gradients were
synchronised (or, where the module hooks cannot see that, under torch.compile, once the
model's parameters hold gradients), so the last step of a loop is counted at its end and
time after the loop never enters a step. Optimizers of other models (a GAN's discriminator,
a twin) are not this model's: their steps are neither timed nor a boundary here.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ...fuses import Fuse
from ..boundary import StepBoundary
from ..recorder import Recorder
from .step import is_compiling


def learning_rate(optimizer: Any) -> float | None:
    """The first parameter group's learning rate, where it is a plain number (a tensor lr,
    torch's ``capturable`` form, may live on the GPU: reading it would synchronise)."""
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None


class OptimizerHooks:
    """Global optimizer step pre/post hooks feeding the Recorder; ``remove()`` undoes them."""

    def __init__(
        self,
        recorder: Recorder,
        boundary: StepBoundary,
        fuse: Fuse,
        parameters: Sequence[Any] = (),
    ) -> None:
        self._first = parameters[0] if parameters else None
        self._ours: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._last: tuple[Callable[[], Any], bool] = (lambda: None, False)
        self._recorder = recorder
        self._boundary = boundary
        self._fuse = fuse
        self._handles = [
            register_optimizer_step_pre_hook(self._before_step),
            register_optimizer_step_post_hook(self._after_step),
        ]

    def _before_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if not self._fuse.ok or is_compiling():
            return
        try:
            if self._holds_model(optimizer):
                self._recorder.optimizer_started(time.perf_counter())
        except Exception as exc:
            self._fuse.blow(exc)

    def _after_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if not self._fuse.ok or is_compiling():
            return
        try:
            if not self._holds_model(optimizer):
                return
            now = time.perf_counter()
            rec = self._recorder
            rec.optimizer_finished(now)
            rec.learning_rate_seen(type(optimizer).__name__, learning_rate(optimizer))
            boundary = self._boundary
            if not boundary.manual and (
                rec.step_has_synced
                or boundary.backward_seen()
                or (self._first is not None and self._first.grad is not None)
            ):
                boundary.end(now, None)
        except Exception as exc:
            self._fuse.blow(exc)

    def _holds_model(self, optimizer: Any) -> bool:
        """The optimizer steps this model's parameters (found once per optimizer; the last
        one asked about answered without a lookup: a loop steps the same one each time)."""
        last, known = self._last
        if last() is optimizer:
            return known
        ours = self._ours.get(optimizer)
        if ours is None:
            first = self._first
            ours = first is None or any(
                p is first for g in optimizer.param_groups for p in g["params"]
            )
            self._ours[optimizer] = ours
        self._last = (weakref.ref(optimizer), ours)
        return ours

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
