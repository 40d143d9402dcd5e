"""The optimizer step: its time, and the end of a training step.

torch's global optimizer step hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook``
and ``..._post_hook``) run around ``step()`` of every ``torch.optim.Optimizer``, the user's
own subclasses included, with no change to the training loop. The post hook ends the step in
progress once its gradients were synchronised (or, where the module hooks cannot see them,
under torch.compile, once a backward ran), so the last step of a loop is counted at its end
and time after the loop never enters a step. A second optimizer stepping in the same
iteration (two models, a GAN) adds its time to the optimizer part and ends no step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .._safety import Fuse
from ..recorder import Recorder
from .step import is_compiling


class OptimizerHooks:
    """Global optimizer step pre/post hooks feeding the Recorder; ``remove()`` undoes them."""

    def __init__(
        self,
        recorder: Recorder,
        on_boundary: Callable[[float, float | None], None],
        backward_seen: Callable[[], bool],
        manual: Callable[[], bool],
        fuse: Fuse,
    ) -> None:
        self._recorder = recorder
        self._on_boundary = on_boundary
        self._backward_seen = backward_seen
        self._manual = manual
        self._fuse = fuse
        self._handles = [
            register_optimizer_step_pre_hook(self._before_step),
            register_optimizer_step_post_hook(self._after_step),
        ]

    def _before_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if not self._fuse.ok or is_compiling():
            return
        try:
            self._recorder.optimizer_started(time.perf_counter())
        except Exception as exc:
            self._fuse.blow(exc)

    def _after_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if not self._fuse.ok or is_compiling():
            return
        try:
            now = time.perf_counter()
            rec = self._recorder
            rec.optimizer_finished(now)
            if not self._manual() and (rec.step_has_synced or self._backward_seen()):
                self._on_boundary(now, None)
        except Exception as exc:
            self._fuse.blow(exc)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
