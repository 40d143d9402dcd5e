"""Hugging Face ``transformers.Trainer``: ``Trainer(..., callbacks=[DDPMonCallback()])``.

The Trainer wraps the model in DistributedDataParallel (through Accelerate) when training
starts; the callback attaches then (``on_train_begin``), counts one step per optimizer step
(``state.global_step``: gradient accumulation is one step) and detaches when training ends.
Callbacks are handed the unwrapped model only, so the callback reads the wrapped one from
the Trainer: pass it (``DDPMonCallback(trainer=trainer)``, via ``trainer.add_callback``), or
let the callback find the Trainer that calls it. Needs ``transformers``:
``pip install 'ddpmon[transformers]'``.
"""

from __future__ import annotations

import sys
from typing import Any

from ._common import attach_wrapped, check_options, log

try:
    from transformers import Trainer, TrainerCallback
except ImportError as exc:
    raise ImportError(
        "ddpmon.integrations.transformers needs Hugging Face transformers: "
        "pip install 'ddpmon[transformers]' (or pip install transformers accelerate)"
    ) from exc


class DDPMonCallback(TrainerCallback):
    """Monitor the model a ``transformers.Trainer`` trains. ``options`` are
    ``ddpmon.attach``'s (each also a DDPMON_* variable); ``monitor`` is the Monitor while
    training runs."""

    def __init__(self, trainer: Trainer | None = None, **options: Any) -> None:
        check_options(options)
        self.trainer = trainer
        self.options = options
        self.monitor: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer or _calling_trainer()
        if trainer is None:
            log.warning(
                "ddpmon: DDPMonCallback cannot find its Trainer; pass it: "
                "trainer.add_callback(DDPMonCallback(trainer=trainer))"
            )
            return
        self.monitor = attach_wrapped(trainer.model_wrapped, self.options, "the Trainer")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.detach()


def _calling_trainer(depth: int = 12) -> Trainer | None:
    """The Trainer whose training loop called this callback (a few frames up)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None
