"""The Trainer's few collectives, each skipped when the job has one process.

Every helper is called by every rank at the same point of the training loop, and returns the
same value on every rank: that is what lets a decision made from one rank's state (a signal, a
failed write on rank 0) become an error or an action on all of them instead of a hang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tandem import _dist
from tandem.doctor import records


def world_size() -> int:
    """Processes in the default group; 1 when there is none."""
    return _dist.group_size()


def sum_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise sum of a few numbers over ranks, in float64 (exact for counts < 2**53)."""
    if world_size() == 1:
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64, device=_dist.backend_device())
    dist.all_reduce(tensor)
    return tensor.tolist()


def start_sum_over_ranks(values: Sequence[float]) -> Callable[[], list[float]]:
    """:func:`sum_over_ranks` issued now, in the background; call the result for the sums.

    Example::

        >>> start_sum_over_ranks([1.0, 2.0])()   # one process: the values themselves
        [1.0, 2.0]
    """
    if world_size() == 1:
        sums = [float(v) for v in values]
        return lambda: sums
    tensor = torch.tensor(list(values), dtype=torch.float64, device=_dist.backend_device())
    with records.tagged("Trainer step agreement"):
        work = dist.all_reduce(tensor, async_op=True)

    def result() -> list[float]:
        records.wait(work)  # on Gloo, a mismatch the doctor finds is raised here
        return tensor.tolist()

    return result


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order (pickled: keep it small)."""
    return _dist.gather_objects(obj)


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (the others pass anything, e.g. None)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wait_for_all() -> None:
    """Return once every rank has called this (a barrier)."""
    if world_size() > 1:
        dist.barrier()
