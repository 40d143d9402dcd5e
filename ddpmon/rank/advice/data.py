"""same_data, set_epoch_missing: what each rank trains on.

A forward pre-hook on the DDP module samples a handful of elements of the first input tensor
(positions that depend only on its shape) into a checksum per step; ``compare`` finds ranks
whose checksums agree step after step: every rank got the same batches, as with a
DataLoader that shuffles with one seed on every rank and no DistributedSampler. While
attached, ``DataLoader.__iter__`` and ``DistributedSampler.__iter__`` pass through a light
wrapper: the first says which sampler fed the model, the second counts the indices each
iteration of a DistributedSampler draws and notices a shuffling one that draws an epoch's
worth again with an epoch already drawn (``set_epoch`` never called: every epoch in the
same order, pytorch#31771). A peek (``next(iter(loader))`` before the epoch loop, as in
PyTorch's DDP tutorial) draws a batch or a few and is abandoned: it is not an epoch, so
``set_epoch(0)`` after it repeats no order. The wrappers are removed when the last monitor
of the process detaches.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from . import cadence
from .readback import Pending, crc, sample

BATCH_SAMPLE = 8
KEEP_STEPS = 32
EVERY_STEP_UNTIL = 99


def first_tensor(args: Any, kwargs: Any) -> torch.Tensor | None:
    """The first tensor among the forward's arguments (looked for shallowly)."""
    for value in list(args) + list((kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)):
            found = next((v for v in value[:8] if isinstance(v, torch.Tensor)), None)
            if found is not None:
                return found
        if isinstance(value, dict):
            found = next((v for v in list(value.values())[:8] if isinstance(v, torch.Tensor)), None)
            if found is not None:
                return found
    return None


def checked(step: int) -> bool:
    """Step ``step`` (counted from 1) is one the batch checks look at; the advice hooks the
    inner module on the same steps (``watch.py``)."""
    return cadence.due(step, EVERY_STEP_UNTIL)


class BatchPrints:
    """Checksums of the first input of each training step (the first forward of the step)."""

    def __init__(self) -> None:
        self.prints: list[list[int]] = []
        self.batch_size: int | None = None
        self._pending: list[tuple[int, Pending]] = []
        self._last_step = -1

    def due(self, step: int) -> bool:
        return step != self._last_step and checked(step)

    def take(self, step: int, x: torch.Tensor) -> None:
        self._last_step = step
        if self.batch_size is None and x.dim() > 0:
            self.batch_size = int(x.shape[0])
        self._pending.append((step, Pending(sample(x, BATCH_SAMPLE).to(torch.float32))))

    @property
    def waiting(self) -> bool:
        """Checksums are on their way (from the GPU: a step later)."""
        return bool(self._pending)

    def collect(self) -> bool:
        """Move the checksums that arrived into ``prints``; True when any did."""
        if not self._pending:
            return False  # (most steps)
        arrived = False
        while self._pending and self._pending[0][1].ready():
            step, pending = self._pending.pop(0)
            self.prints.append([step, crc(pending.values())])
            arrived = True
        del self.prints[:-KEEP_STEPS]
        return arrived


# -- the sampler watch: class-level wrappers shared by the monitors of this process ---------------

EPOCH_SHARE = 0.5
"""An iteration that draws more than this share of its sampler's indices is an epoch (it is
trained on); one abandoned before is a peek."""

SamplerSeen = Callable[[Any], None]
EpochDrawn = Callable[[Any, int], None]
"""Called with (sampler, its epoch) when an iteration of that sampler becomes an epoch."""
_loader_watchers: list[SamplerSeen] = []
_sampler_watchers: list[EpochDrawn] = []


class Drawn:
    """A DistributedSampler's iterator that counts the indices drawn and tells the watchers
    once, when it has drawn an epoch's worth (more than ``EPOCH_SHARE`` of them)."""

    def __init__(self, sampler: Any, indices: Iterator[Any]) -> None:
        self._sampler = sampler
        self._indices = indices
        self._epoch = int(getattr(sampler, "epoch", 0))  # set_epoch() comes before iter()
        try:
            length = len(sampler)
        except Exception:
            length = 0
        self._epoch_at = int(EPOCH_SHARE * length) + 1
        self.count = 0

    def __iter__(self) -> Drawn:
        return self

    def __next__(self) -> Any:
        index = next(self._indices)
        self.count += 1
        if self.count == self._epoch_at:
            for watcher in list(_sampler_watchers):
                watcher(self._sampler, self._epoch)
        return index


_originals: dict[str, Any] = {}


def _loader_iter(self: Any) -> Any:
    for watcher in list(_loader_watchers):
        watcher(self)
    return _originals["loader"](self)


def _sampler_iter(self: Any) -> Any:
    return Drawn(self, iter(_originals["sampler"](self)))


def watch(on_loader: SamplerSeen, on_sampler: EpochDrawn) -> None:
    if not _originals:
        _originals["loader"] = DataLoader.__iter__
        _originals["sampler"] = DistributedSampler.__iter__
        DataLoader.__iter__ = _loader_iter  # type: ignore[method-assign]
        DistributedSampler.__iter__ = _sampler_iter  # type: ignore[method-assign]
    _loader_watchers.append(on_loader)
    _sampler_watchers.append(on_sampler)


def unwatch(on_loader: SamplerSeen, on_sampler: EpochDrawn) -> None:
    if on_loader in _loader_watchers:
        _loader_watchers.remove(on_loader)
    if on_sampler in _sampler_watchers:
        _sampler_watchers.remove(on_sampler)
    if not _loader_watchers and not _sampler_watchers and _originals:
        DataLoader.__iter__ = _originals.pop("loader")  # type: ignore[method-assign]
        DistributedSampler.__iter__ = _originals.pop("sampler")  # type: ignore[method-assign]


def sampler_of(loader: Any) -> Any:
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    if isinstance(inner, DistributedSampler) or sampler is None:
        return inner
    return sampler


class EpochWatch:
    """The epochs each shuffling DistributedSampler has drawn: one drawn again is a missing
    set_epoch (the same order again)."""

    def __init__(self) -> None:
        self._drawn: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()

    def drawn(self, sampler: Any, epoch: int) -> int | None:
        """``epoch`` when this shuffling sampler has drawn it before, as an epoch: an
        iteration became an epoch (a peek never does) with an order already trained on."""
        if not getattr(sampler, "shuffle", False):
            return None
        seen = self._drawn.setdefault(sampler, set())
        repeated = epoch in seen
        seen.add(epoch)
        return epoch if repeated else None
