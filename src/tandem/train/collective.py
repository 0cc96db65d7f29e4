"""The Trainer's few collectives, each skipped when the job has one process.

Every helper is called by every rank at the same point of the training loop, and returns the
same value on every rank: that is what lets a decision made from one rank's state (a signal, a
failed write on rank 0) become an error or an action on all of them instead of a hang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def world_size() -> int:
    """Processes in the default group; 1 when there is none."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def _device() -> torch.device:
    # NCCL only moves CUDA tensors; Gloo and MPI take CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise sum of a few numbers over ranks, in float64 (exact for counts < 2**53)."""
    if world_size() == 1:
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64, device=_device())
    dist.all_reduce(tensor)
    return tensor.tolist()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order (pickled: keep it small)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


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
