"""The norm of a gradient sharded over ranks, clipped: one rule for FSDP and the engines.

``torch.nn.utils.clip_grad_norm_`` on a rank's shards sees only its part of the gradient; the
ranks' partial sums are added first (one all-reduce). A leaf module: ``parallel/fsdp.py`` and
``parallel/engine.py`` both use it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from tandem._dist import group_size


def clip_sharded_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients sharded over ``group``: the norm of
    the whole gradient, of which each rank holds a disjoint part; every part scaled alike.

    Each rank adds ``|g|^p`` over its own parts, one all-reduce adds the ranks' sums (a max for
    ``p = inf``), and every rank applies torch's coefficient ``min(1, max_norm / (norm +
    1e-6))``. The sums are kept in the widest floating dtype of ``params``, and at least float32:
    a float64 model's norm must not be rounded to float32 (torch keeps the gradients' dtype),
    and bfloat16 gradients' squares would lose most of their sum. The dtype is read from the
    parameters, not the gradients, so that every rank picks the same one for the collective.

    Example::

        norm = clip_sharded_grad_norm_(fsdp.parameters(), 1.0, group=fsdp.process_group)
    """
    params = [p for p in params if p.is_floating_point()]
    grads = [p.grad.detach() for p in params if p.grad is not None]
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in params], torch.float32)
    device = grads[0].device if grads else params[0].device if params else torch.device("cpu")
    norm_type = float(norm_type)
    if norm_type == math.inf:
        maxima = [g.abs().max().to(dtype) for g in grads if g.numel()]
        total = torch.stack(maxima).max() if maxima else torch.zeros((), dtype=dtype, device=device)
        if group_size(group) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = torch.zeros((), dtype=dtype, device=device)
        for g in grads:
            total += torch.linalg.vector_norm(g, norm_type, dtype=dtype) ** norm_type
        if group_size(group) > 1:
            dist.all_reduce(total, group=group)
        total = total ** (1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.device, g.dtype))
    return total
