"""Unused parameters, by name: which parameters got no gradient in a step.

``register_post_accumulate_grad_hook`` fires once a parameter's ``.grad`` is written, with or
without ``find_unused_parameters``, so the parameters that did not fire in a step are the
unused ones, named here by their fully qualified names. Parameters can go unused without
an error only with find_unused_parameters or static_graph; otherwise DDP stops at the next
iteration with an error that names indices only, and ddpmon adds the names to it (and to
the state), so the per-parameter hooks are placed only where they can find something.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...advice.words import REDUCTION_ERROR
from ...fuses import Fuse
from ..recorder import Recorder

log = logging.getLogger("ddpmon")


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
) -> list[str] | None:
    """Add the unused parameters' names to DDP's "Expected to have finished reduction" error,
    which names only parameter indices unless TORCH_DISTRIBUTED_DEBUG is set.

    The indices in DDP's message are positions in the reducer's parameter list, which is
    ``parameter_names``' order; ``unused`` (from grad-ready hooks) is the fallback."""
    text = str(exc.args[0]) if exc.args else ""
    if REDUCTION_ERROR not in text or "ddpmon: " in text:
        return None
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
    return list(unused)


class UnusedParameterWatch:
    """Names this rank's unused parameters each step (in the recorder, the log when the
    set changes) and in DDP's own error; notes a needless find_unused_parameters=True."""

    def __init__(
        self,
        ddp: torch.nn.Module,
        parameters: Sequence[tuple[str, torch.nn.Parameter]],
        recorder: Recorder,
        fuse: Fuse,
        advice_steps: int,
        notify: Any = None,
    ) -> None:
        self._ddp = ddp
        self._names = [name for name, _ in parameters]
        self._recorder = recorder
        self._fuse = fuse
        self._advice_steps = advice_steps
        self._notify = notify or (lambda: None)
        # (DDP's find_unused_parameters is fixed at its construction: nothing to advise without)
        self._advised = not getattr(ddp, "find_unused_parameters", False)
        self._grads = None
        if getattr(ddp, "find_unused_parameters", False) or getattr(ddp, "static_graph", False):
            self._grads = GradReadyHooks(parameters, recorder, fuse)

    @property
    def any_ready(self) -> bool:
        return bool(self._grads and self._grads.any_ready)

    def step_ended(self) -> None:
        """At a step boundary (the training thread); nothing to do without the gradient
        hooks (find_unused_parameters off: nothing to name or advise)."""
        if self._grads is None:
            return
        rec = self._recorder
        unused = self._grads.take_unused()
        if unused is not None and rec.set_unused_parameters(unused):
            rank = rec.identity.rank
            if unused:
                shown = ", ".join(unused[:10]) + (
                    f" (+{len(unused) - 10} more)" if len(unused) > 10 else ""
                )
                log.warning(
                    "ddpmon: rank %s: %d parameter(s) received no gradient in step %d: %s",
                    rank,
                    len(unused),
                    rec.steps,
                    shown,
                )
            else:
                log.warning("ddpmon: rank %s: every parameter receives a gradient again", rank)
            self._notify()
        self._advise(rec)

    def _advise(self, rec: Recorder) -> None:
        if self._advised:
            return
        if rec.steps_without_unused >= self._advice_steps:
            self._advised = True
            text = (
                f"find_unused_parameters=True, but no parameter has been unused on this rank for "
                f"{rec.steps_without_unused} steps; it costs a traversal of the autograd graph "
                "every step: if no rank has unused parameters (ddpmon doctor checks them all), "
                "pass find_unused_parameters=False (or static_graph=True)"
            )
            rec.note("find_unused_parameters", text)
            log.warning("ddpmon: rank %s: %s", rec.identity.rank, text)

    def forward_failed(self, exc: BaseException) -> None:
        """DDP's forward raised ``exc`` (from the step hooks' forward hook, which is always
        called): DDP's error for unused parameters gets their names."""
        if not self._fuse.ok:
            return
        try:
            rec = self._recorder
            names = explain_reduction_error(
                exc, self._names, rec.unused_parameters, rec.identity.rank
            )
            if names:  # every name, kept in the state: they matter most now
                rec.set_unused_parameters(names)
                self._notify()
        except Exception:
            pass  # the user's error goes on unchanged

    def remove(self) -> None:
        if self._grads:
            self._grads.remove()
