"""nonfinite_gradients: the rank whose own gradients went NaN/Inf first, before the all-reduce.

One rank's bad batch makes NaN gradients that DDP's all-reduce hands to every rank in the
same step; afterwards every rank looks guilty. A hook on each parameter's gradient (it runs
before the gradient reaches DDP's reducer) keeps ``grad.sum()`` (one reduction: NaN and Inf
survive a sum) on the gradient's device; at the step boundary one ``isfinite`` over them all
makes the step's flags, read a step later (from the GPU without blocking). Every step is
checked for the first ``EVERY_STEP_UNTIL`` steps, then fewer (``cadence.py``). A
non-finite step counts once the parameter is itself non-finite a step later: a mixed-precision
GradScaler skips such steps and the parameters stay finite, which is no finding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..hooks.step import is_compiling
from . import cadence
from .readback import Pending

EVERY_STEP_UNTIL = 50


class GradCheck:
    """The hook on one parameter's gradient. Not serialised with the parameter
    (``__torch_unserializable__``), and from ddpmon, so copies of the model leave it out."""

    __slots__ = ("_owner", "_index")
    __torch_unserializable__ = True

    def __init__(self, owner: NonFiniteWatch, index: int) -> None:
        self._owner = owner
        self._index = index

    def __call__(self, grad: torch.Tensor) -> None:
        owner = self._owner
        if owner.armed and not is_compiling():
            try:
                owner.sums.append((self._index, grad.sum()))
            except Exception:
                owner.armed = False


class NonFiniteWatch:
    """Flags per checked step; ``first`` is (step, parameter) once confirmed."""

    def __init__(self, parameters: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        self.names = [name for name, _ in parameters]
        self._params = [p for _, p in parameters]
        self.armed = True  # step 0 is checked
        self.sums: list[tuple[int, torch.Tensor]] = []
        self.checked_step = 0
        self.first: tuple[int, str] | None = None
        self._pending: list[tuple[int, list[int], Pending]] = []
        self._suspect: tuple[int, int, Pending] | None = (
            None  # (step, index, is the parameter finite)
        )
        self._handles: list[Any] = []
        self._hook(True)

    def _hook(self, on: bool) -> None:
        """Hooks only on checked steps: a Python hook on a gradient keeps autograd from
        reusing the gradient's buffer (it copies), which other steps need not pay."""
        if on and not self._handles:
            self._handles = [
                p.register_hook(GradCheck(self, i)) for i, p in enumerate(self._params)
            ]
        elif not on and self._handles:
            for handle in self._handles:
                handle.remove()
            self._handles = []

    @property
    def idle(self) -> bool:
        """No gradient sums, flags or suspect wait for a step boundary."""
        return self.first is not None or (
            not self.sums and not self._pending and self._suspect is None
        )

    def step_ended(self, step: int) -> bool:
        """At a step boundary: step ``step`` (counted from 1) is done. True when ``first``
        was just set."""
        if self.first is not None:
            return False
        if self.sums:
            by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
            for index, total in self.sums:  # (one stack per dtype: mostly one)
                by_dtype.setdefault(total.dtype, []).append((index, total))
            order = [i for group in by_dtype.values() for i, _ in group]
            finite = [torch.isfinite(torch.stack([t for _, t in g])) for g in by_dtype.values()]
            bad = (finite[0] if len(finite) == 1 else torch.cat(finite)).logical_not_()
            self._pending.append((step, order, Pending(bad)))
            self.sums = []
        following = step + 1
        self.armed = armed = cadence.due(following, EVERY_STEP_UNTIL)
        if armed != bool(self._handles):
            self._hook(armed)
        if self._suspect is None and not self._pending:
            return False  # (most steps: nothing to read)
        return self._confirm() or (self._read() and self._confirm())

    def _confirm(self) -> bool:
        if self._suspect is None or not self._suspect[2].ready():
            return False
        bad_step, index, finite = self._suspect
        self._suspect = None
        if all(finite.values()):  # the parameter stayed finite: a skipped step (GradScaler)
            return False
        self.first = (bad_step, self.names[index])
        self.remove()
        return True

    def _read(self) -> bool:
        """Read the flags that arrived; True when a non-finite step is now a suspect."""
        while self._pending and self._pending[0][2].ready() and self._suspect is None:
            step, order, pending = self._pending.pop(0)
            self.checked_step = max(self.checked_step, step)
            bad = pending.values()
            if any(bad):
                index = order[bad.index(True)]
                with torch.no_grad():
                    finite = torch.isfinite(self._params[index]).all().reshape(1)
                self._suspect = (step, index, Pending(finite))
                self._pending.clear()
                return True
        return False

    def remove(self) -> None:
        self.armed = False
        self._hook(False)
