"""Hugging Face Accelerate: ``accelerator.prepare`` returns the DistributedDataParallel model,
so the one line is ``ddpmon.attach(model)`` right after it. ``attach`` here does the same for
a script that also runs as a single process, where Accelerate leaves the model unwrapped:
it returns None there instead of raising. Accelerate itself is not imported.
"""

from __future__ import annotations

from typing import Any

from ._common import attach_wrapped


def attach(model: Any, **options: Any) -> Any:
    """``ddpmon.attach`` for what ``accelerator.prepare`` returned; None when it is not a
    DDP model (one process). ``options`` are ``ddpmon.attach``'s."""
    return attach_wrapped(model, options, "accelerator.prepare", single_process_ok=True)
