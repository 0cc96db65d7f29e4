"""What every engine asks of a process group, answered in one place.

A group's size and its members' global ranks, the device its backend moves tensors on, "do all
ranks agree on this value, or raise on every rank with every rank's value", and the check that a
launched job really has a process group. Every helper works with no process group at all (one
process): the size is 1 and nothing is sent, so callers keep one code path.

Example::

    size = group_size(group)                     # 1 without a process group
    src = global_rank(group, 0)                  # group rank 0 as a global rank
    agree({"layout": sizes}, "bucket layout", group)   # ValueError on every rank if they differ
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tandem.doctor import records


def initialized() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (the world when None); 1 when no process group exists."""
    if not initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank within ``group``; 0 when no process group exists."""
    if not initialized():
        return 0
    return dist.get_rank(group)


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (collectives name their source globally)."""
    if not initialized():
        return rank
    if group is None:
        group = dist.group.WORLD
        assert group is not None  # set by init_process_group, which initialized() saw
    return dist.get_global_rank(group, rank)


def global_ranks(group: dist.ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return [global_rank(group, r) for r in range(group_size(group))]


def backend_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s backend takes tensors: the current CUDA device for NCCL, else the CPU."""
    if initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every group rank's ``obj`` in group-rank order (pickled: keep it small)."""
    size = group_size(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def agree(
    value: Any,
    what: str,
    group: dist.ProcessGroup | None = None,
    explain: Callable[[list[Any]], str] | None = None,
    fix: str = "",
) -> None:
    """Return if every rank of ``group`` passed an equal ``value``; else ValueError on every rank.

    The values are gathered (one collective that every rank joins), so a disagreement is the
    same error on every rank within a round trip, never one rank raising while the others hang.
    ``explain(values)`` may describe the difference; by default every rank's value is listed.

    Example::

        agree(sorted(model.state_dict()), "state_dict keys", group,
              fix="build the same model on every rank")
    """
    values = gather_objects(value, group)
    if all(v == values[0] for v in values):
        return
    detail = (
        explain(values)
        if explain is not None
        else "; ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
    )
    raise ValueError(f"{what} differs across ranks: {detail}" + (f". {fix}" if fix else ""))


def require_process_group(wrapper: str) -> None:
    """Raise if this process was launched as one of several but no process group exists.

    Without this check each rank of a ``WORLD_SIZE=4`` job trains alone on its quarter of the
    data and the job exits 0: four different models and no error.

    Example::

        require_process_group("tandem.DDP")   # first thing in a wrapper's constructor

    With a group, the collectives are recorded from here on (``tandem.doctor.records``), also
    in a script that made its group without ``tandem.init()``.
    """
    if initialized():
        from tandem import doctor  # imports torch.distributed: not at import time

        doctor.start()
        return
    declared = os.environ.get("WORLD_SIZE", "1")
    try:
        launched = int(declared)
    except ValueError:
        launched = 1
    if launched > 1:
        raise RuntimeError(
            f"{wrapper}: this process was launched as rank {os.environ.get('RANK', '?')} of "
            f"WORLD_SIZE={declared}, but no process group exists, so it would train alone. "
            f"Call tandem.init() (or torch.distributed.init_process_group()) before "
            f"constructing {wrapper}."
        )


# The few collectives every rank calls at the same point of a training loop, each skipped
# when the job has one process, each returning the same value on every rank (a decision made
# from one rank's state becomes an action on all of them instead of a hang).


def sum_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise sum of a few numbers over ranks, in float64 (exact for counts < 2**53)."""
    if group_size() == 1:
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64, device=backend_device())
    dist.all_reduce(tensor)
    return tensor.tolist()


def start_sum_over_ranks(values: Sequence[float]) -> Callable[[], list[float]]:
    """:func:`sum_over_ranks` issued now, in the background; call the result for the sums.

    Example::

        >>> start_sum_over_ranks([1.0, 2.0])()   # one process: the values themselves
        [1.0, 2.0]
    """
    if group_size() == 1:
        sums = [float(v) for v in values]
        return lambda: sums
    tensor = torch.tensor(list(values), dtype=torch.float64, device=backend_device())
    with records.tagged("Trainer step agreement"):
        work = dist.all_reduce(tensor, async_op=True)

    def result() -> list[float]:
        records.wait(work)  # on Gloo, a mismatch the doctor finds is raised here
        return tensor.tolist()

    return result


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (the others pass anything, e.g. None)."""
    if group_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wait_for_all() -> None:
    """Return once every rank has called this (a barrier)."""
    if group_size() > 1:
        dist.barrier()


# torch 2.13 renamed the flat collectives; older versions (tandem supports 2.4+) lack the new
# names, and the old ones warn on new versions. Looked up at each call, not once at import:
# tandem.doctor's records replace torch's functions when they are installed, later.
def all_gather_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """``dist.all_gather_single`` (``all_gather_into_tensor`` before torch 2.13)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """``dist.reduce_scatter_single`` (``reduce_scatter_tensor`` before torch 2.13), a sum."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)
