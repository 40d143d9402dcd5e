"""Which steps the sampled checks look at: every step at first (a mistake in the setup
shows at once), then every 10th, then every 50th once the job is past its first
``SPARSE_FROM`` steps. A checked step costs the training thread a few hundred microseconds
on a small model (a hook call per gradient, a checksum, their flags), which every 10th step
would be about a third of all that ddpmon costs it per step."""

from __future__ import annotations

SPARSE_FROM = 500


def due(step: int, every_step_until: int) -> bool:
    """Step ``step`` (counted from 1) is checked: every step up to ``every_step_until``,
    then every 10th up to ``SPARSE_FROM``, then every 50th."""
    return step <= every_step_until or step % (10 if step <= SPARSE_FROM else 50) == 0


def next_due(step: int, every_step_until: int) -> int:
    """The first step after ``step`` that ``due`` checks: the advice does nothing at the
    steps before it (``watch.py``)."""
    step += 1
    while not due(step, every_step_until):
        step += 1
    return step
