"""accumulation_without_no_sync, static_graph, needless_find_unused_parameters: DDP options
that cost time without changing the result.

Gradient accumulation outside ``no_sync()`` all-reduces at every backward: the optimizer
steps are counted through torch's global optimizer step hook, and steps with two or more
synchronised backwards in a row are the mistake. ``find_unused_parameters=True`` with the
same set of unused parameters step after step is a static graph (``static_graph=True``
skips the search); with none at all it is needless (noted by hooks/autograd.py, folded in
here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

ACCUMULATION_STEPS = 3
"""Optimizer steps in a row with two or more gradient all-reduces each."""
STATIC_STEPS = 50
"""Steps with the same non-empty set of unused parameters."""


class OptimizerSteps:
    """Synchronised backwards per optimizer step, and backward passes per optimizer step
    (``micro_batches``, between the first two: gradient accumulation, with or without
    ``no_sync()``), from torch's global optimizer hook."""

    def __init__(
        self,
        synced_backwards: Callable[[], int],
        backwards: Callable[[], int],
        found: Callable[[int, int], None],
    ) -> None:
        self._synced = synced_backwards
        self._backwards = backwards
        self._found = found
        self._last: int | None = None
        self._run = 0
        self.done = False
        self.seen = 0
        """Optimizer steps seen (counted up to the second)."""
        self.micro_batches: int | None = None
        self._first_backwards = 0
        self._handle = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        try:
            if self.micro_batches is None:
                backwards = self._backwards()
                self.seen += 1
                if self.seen == 1:
                    self._first_backwards = backwards
                else:
                    self.micro_batches = max(1, backwards - self._first_backwards)
        except Exception:
            self.micro_batches = self.micro_batches or 1
        if self.done:
            return
        try:
            now = self._synced()
            if self._last is not None:
                per_step = now - self._last
                self._run = self._run + 1 if per_step >= 2 else 0
                if self._run >= ACCUMULATION_STEPS:
                    self.done = True
                    self._found(per_step, now)
            self._last = now
        except Exception:
            self.done = True

    def remove(self) -> None:
        self._handle.remove()


class StaticGraph:
    """The same non-empty set of unused parameters for ``STATIC_STEPS`` steps."""

    def __init__(self) -> None:
        self._last: list[str] | None = None
        self._same = 0

    def step_ended(self, unused: list[str]) -> bool:
        if unused and unused == self._last:
            self._same += 1
        else:
            self._same = 0
        self._last = list(unused)
        return self._same == STATIC_STEPS
