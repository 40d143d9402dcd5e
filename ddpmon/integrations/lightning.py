"""PyTorch Lightning: ``Trainer(strategy="ddp", callbacks=[DDPMonCallback()])``.

The callback attaches once the strategy has wrapped the model in DistributedDataParallel
(``on_fit_start``), counts one step per Lightning global step (optimizer step: accumulated
batches are one step), and detaches when fit ends. Needs ``lightning`` (or the older
``pytorch_lightning``): ``pip install 'ddpmon[lightning]'``.
"""

from __future__ import annotations

from typing import Any

from ._common import attach_wrapped, check_options

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[assignment, no-redef]
    except ImportError as exc:
        raise ImportError(
            "ddpmon.integrations.lightning needs PyTorch Lightning: pip install 'ddpmon[lightning]' "
            "(or pip install lightning)"
        ) from exc


class DDPMonCallback(Callback):
    """Monitor the model Lightning's DDP strategy wrapped. ``options`` are ``ddpmon.attach``'s
    (each also a DDPMON_* variable); ``monitor`` is the Monitor while fit runs."""

    def __init__(self, **options: Any) -> None:
        check_options(options)
        self.options = options
        self.monitor: Any = None
        self._global_step = 0

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.monitor = attach_wrapped(trainer.strategy.model, self.options, "Lightning's strategy")
        self._global_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.monitor is not None and trainer.global_step != self._global_step:
            self._global_step = trainer.global_step
            self.monitor.step()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.detach()
