"""Telling the indices a DataLoader drew from a sampler from the batches it handed out.

A ``DataLoader`` with worker processes draws indices ahead of the batches it returns: at every
moment up to ``num_workers * prefetch_factor`` batches are in flight, so a sampler that counts
the indices it yielded counts *drawn*, not *trained on*. A checkpoint of that count resumes past
samples that were never trained on. Two remedies share this module:

- :class:`tandem.data.StatefulLoader` records the sampler's state right after it draws each
  batch and hands back the one that belongs to the last batch it yielded (torchdata's
  ``StatefulDataLoader`` does the same), so its ``state_dict()`` counts what was trained on;
- a sampler iterated by a worker loader without it warns in ``state_dict()`` during the epoch
  (:func:`drawn_by_worker_loader` tells it so), instead of silently saving the drawn count.

Code that knows its count is right (the stateful loader's snapshots, the Trainer, which
replaces the position by the batches it consumed) takes the state inside
:func:`position_vouched`, where samplers do not warn.

Example::

    with position_vouched():
        state = sampler.state_dict()      # no warning: the caller fixes the position itself
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from torch.utils.data import dataloader as _dataloader

# torch's iterator of a DataLoader with workers: the only one that draws ahead by itself (the
# single-process iterator draws one batch's indices per batch it returns).
_WORKER_ITER: type | None = getattr(_dataloader, "_MultiProcessingDataLoaderIter", None)
# Frames between a sampler's generator and the loader iterator that draws from it: the batch
# sampler's generator (and its comprehension), _next_index, _try_put_index, _reset or
# _process_data, __init__ or _next_data. Generous, so a wrapping batch sampler still fits.
_FRAMES = 12

_local = threading.local()


def drawn_by_worker_loader(depth: int = 1) -> bool:
    """Whether the caller's caller chain holds a DataLoader iterator with worker processes.

    Call it from a sampler's generator while it yields (``depth``: frames to skip, 1 = the
    generator's own): torch draws indices in the main thread, from
    ``_MultiProcessingDataLoaderIter._next_index``, so that iterator is a few frames up.

    Example::

        def __iter__(self):
            for i, index in enumerate(self._indices()):
                if i == 0:
                    self._ahead = drawn_by_worker_loader()
                yield index
    """
    if _WORKER_ITER is None:  # a torch without it: nothing to detect, nothing to warn about
        return False
    frame: FrameType | None = sys._getframe(depth)
    for _ in range(_FRAMES):
        if frame is None:
            return False
        owner = frame.f_locals.get("self")
        if isinstance(owner, _WORKER_ITER):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def position_vouched() -> Iterator[None]:
    """Within this block samplers' ``state_dict()`` do not warn about a loader drawing ahead.

    For callers whose position is right although a worker loader draws: a stateful loader
    snapshotting the state right after drawing a batch, or a training loop that replaces the
    position by the samples it consumed. Per thread; blocks nest.

    Example::

        with position_vouched():
            state = {**sampler.state_dict(), "position": batches_done * batch_size}
    """
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def is_vouched() -> bool:
    """Whether the current thread is inside :func:`position_vouched`.

    Example::

        with position_vouched():
            assert is_vouched()
    """
    return getattr(_local, "depth", 0) > 0
