"""Grad-ready hooks: when each parameter's gradient is ready, and which never got one.

``register_post_accumulate_grad_hook`` fires once a parameter's ``.grad`` is written, with or
without ``find_unused_parameters``, so the parameters that did not fire in a step are the
unused ones, named here by their fully qualified names.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

import torch

from .._safety import Fuse
from ..recorder import Recorder

REDUCTION_ERROR = "Expected to have finished reduction in the prior iteration"


class GradReadyHooks:
    """One post-accumulate-grad hook per trainable parameter, each a few attribute writes."""

    def __init__(
        self,
        named_parameters: Sequence[tuple[str, torch.nn.Parameter]],
        recorder: Recorder,
        fuse: Fuse,
    ) -> None:
        self.names = [name for name, _ in named_parameters]
        self._recorder = recorder
        self._fuse = fuse
        self._seen = [0] * len(self.names)
        self._generation = 1
        self._count = 0
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook_for(i))
            for i, (_, p) in enumerate(named_parameters)
        ]

    def _hook_for(self, i: int) -> Callable[[torch.Tensor], None]:
        seen, recorder, fuse = self._seen, self._recorder, self._fuse

        def grad_ready(param: torch.Tensor) -> None:
            # Autograd also runs the hook with no gradient at all, for a parameter that is
            # reachable from the outputs but not from the loss: that one is unused too.
            if not fuse.ok or param.grad is None:
                return
            try:
                if seen[i] != self._generation:
                    seen[i] = self._generation
                    self._count += 1
                recorder.grad_ready(time.perf_counter())
            except Exception as exc:
                fuse.blow(exc)

        return grad_ready

    @property
    def any_ready(self) -> bool:
        """True when some gradient became ready since the last ``take_unused``."""
        return self._count > 0

    def pending_unused(self) -> list[str]:
        """Parameters without a gradient so far in the step in progress."""
        if self._count == len(self.names):
            return []
        return [n for n, g in zip(self.names, self._seen) if g != self._generation]

    def take_unused(self) -> list[str] | None:
        """End the step: the unused parameters' names (None when no backward ran)."""
        if self._count == 0:
            return None
        unused = self.pending_unused()
        self._generation += 1
        self._count = 0
        return unused

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


def explain_reduction_error(
    exc: BaseException, parameter_names: Sequence[str], unused: Sequence[str], rank: int
) -> None:
    """Add the unused parameters' names to DDP's "Expected to have finished reduction" error,
    which names only parameter indices unless TORCH_DISTRIBUTED_DEBUG is set.

    The indices in DDP's message are positions in the reducer's parameter list, which is
    ``parameter_names``' order; ``unused`` (from grad-ready hooks) is the fallback."""
    text = str(exc.args[0]) if exc.args else ""
    if REDUCTION_ERROR not in text:
        return
    m = _INDICES.search(text)
    if m:
        indices = [int(i) for i in m.group(2).split()]
        unused = [parameter_names[i] if i < len(parameter_names) else f"#{i}" for i in indices]
    if unused:
        listed = "\n".join(f"  {name}" for name in unused[:50])
        more = f"\n  ... and {len(unused) - 50} more" if len(unused) > 50 else ""
        extra = (
            f"\n\nddpmon: on rank {rank} these parameters received no gradient in the previous "
            f"iteration:\n{listed}{more}\nEither make them take part in the loss on every rank, "
            "or pass find_unused_parameters=True to DistributedDataParallel."
        )
    else:
        extra = (
            f"\n\nddpmon: every parameter received a gradient on rank {rank}; the unused ones "
            "are on another rank (see its log or state file)."
        )
    exc.args = (text + extra,) + tuple(exc.args[1:])
