"""Which gradients travel together in one all-reduce, and the caps that decide it. Pure: no
communication.

A bucket is one flat buffer holding the gradients of several parameters of the same dtype and
device. Reducing a few large buffers costs far less than many small ones (each collective has a
fixed latency), and a bucket can be sent as soon as its last gradient is ready, while backward is
still computing the gradients of earlier layers: that is where the overlap comes from.

The rules are torch's, so that both engines sum the same numbers in the same groups: the caps of
each dtype's first, second, ... bucket (``bucket_caps``), buckets closed once full in the order
gradients are expected (``assign_buckets``), the cut of a model's parameters (``cut_buckets``),
and a buffer per bucket with a view per parameter (``build_buckets``). When the buckets are cut
and rebuilt is the reducer's business: :mod:`tandem.parallel.ddp.reducer`.

Example::

    >>> bucket_caps(None, None)  # torch's defaults: 1 MiB first, then 25 MiB, in bytes
    [1048576, 26214400]
    >>> layout = assign_buckets(
    ...     sizes=[400, 400, 400, 400], keys=["f32"] * 4, order=[3, 2, 1, 0],
    ...     cap_bytes=1000, first_cap_bytes=500)
    >>> layout
    [[3, 2], [1, 0]]
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

MIB = 1024 * 1024
DEFAULT_BUCKET_MB = 25.0
# With the default cap the first rebuilt bucket is small, so that the first all-reduce starts
# early in backward; an explicit bucket_cap_mb applies to every bucket (torch's rule).
DEFAULT_FIRST_BUCKET_MB = 1.0


def bucket_caps(
    bucket_cap_mb: float | None,
    first_bucket_cap_mb: float | None,
    bucket_cap_mb_list: Sequence[float] | None = None,
) -> list[int]:
    """The caps in bytes of each dtype's first, second, ... bucket, the last one repeated.

    torch's rule: ``[1 MiB, 25 MiB]`` by default, ``[cap, cap]`` for an explicit
    ``bucket_cap_mb``, or ``bucket_cap_mb_list`` as given (``bucket_cap_mb`` is then ignored,
    as in torch). ValueError for a cap that is not positive.
    """
    if bucket_cap_mb_list:
        if first_bucket_cap_mb is not None:
            raise ValueError(
                f"bucket_cap_mb_list={list(bucket_cap_mb_list)} and first_bucket_cap_mb="
                f"{first_bucket_cap_mb} both set the first bucket's cap: pass one of them"
            )
        named = [(f"bucket_cap_mb_list[{k}]", mb) for k, mb in enumerate(bucket_cap_mb_list)]
    else:
        cap_mb = DEFAULT_BUCKET_MB if bucket_cap_mb is None else bucket_cap_mb
        if first_bucket_cap_mb is None:
            first_bucket_cap_mb = DEFAULT_FIRST_BUCKET_MB if bucket_cap_mb is None else cap_mb
        named = [("first_bucket_cap_mb", first_bucket_cap_mb), ("bucket_cap_mb", cap_mb)]
    for name, mb in named:
        if not mb > 0:
            raise ValueError(f"{name}={mb} must be a positive number of MiB")
    # At least one byte: a tiny cap means one parameter per bucket, not an invalid cap.
    return [max(1, int(mb * MIB)) for _, mb in named]


def assign_buckets(
    sizes: Sequence[int],
    keys: Sequence[Hashable],
    order: Sequence[int],
    cap_bytes: int,
    first_cap_bytes: int,
    caps: Sequence[int] | None = None,
) -> list[list[int]]:
    """Group tensor indices into buckets, in the order the buckets will be launched.

    Args:
        sizes: bytes of each tensor, indexed by tensor index.
        keys: a bucket only holds tensors of one key (dtype and device).
        order: the order in which gradients are expected to become ready. At first this is the
            reverse of registration order (backward visits the last layers first); after one
            iteration it is the order that was observed.
        cap_bytes: a bucket is closed once it holds at least this many bytes.
        first_cap_bytes: the cap of the first bucket of each key (kept small: see the reducer
            for where that small bucket goes).
        caps: instead of the two above, the cap of each key's first, second, ... bucket, the
            last one repeated (torch's ``bucket_cap_mb_list``).

    Returns:
        Lists of tensor indices. Buckets are ordered by when their first gradient is expected,
        so launching them in list order follows backward.
    """
    limits = list(caps) if caps else [first_cap_bytes, cap_bytes]
    if min(limits) <= 0:
        given = f"cap_bytes={cap_bytes}, first_cap_bytes={first_cap_bytes}"
        raise ValueError(f"bucket caps must be positive, got {f'caps={limits}' if caps else given}")
    if sorted(order) != list(range(len(sizes))) or len(keys) != len(sizes):
        shown = list(order) if len(order) <= 20 else f"{list(order[:20])}..."
        raise ValueError(
            f"order must be a permutation of range({len(sizes)}) and keys must have "
            f"{len(sizes)} entries; got order of length {len(order)}, {len(keys)} keys: "
            f"order={shown}"
        )
    position = {index: pos for pos, index in enumerate(order)}
    open_buckets: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    closed_count: dict[Hashable, int] = {}
    done: list[list[int]] = []
    for index in order:
        key = keys[index]
        bucket = open_buckets.setdefault(key, [])
        bucket.append(index)
        open_bytes[key] = open_bytes.get(key, 0) + sizes[index]
        cap = limits[min(closed_count.get(key, 0), len(limits) - 1)]
        # Close after adding, as torch does: a tensor is never split, so a large one closes
        # (and overfills) the bucket it joins.
        if open_bytes[key] >= cap:
            done.append(open_buckets.pop(key))
            open_bytes[key] = 0
            closed_count[key] = closed_count.get(key, 0) + 1
    done.extend(bucket for bucket in open_buckets.values() if bucket)
    done.sort(key=lambda bucket: position[bucket[0]])
    return done


def cut_buckets(
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    caps: Sequence[int],
    reverse: bool = False,
    one_bucket: bool = False,
) -> list[list[int]]:
    """The buckets of ``params`` (indices, in launch order) for gradients ready in ``order``.

    ``caps`` as from ``bucket_caps``; ``reverse`` launches the buckets in the reverse order of
    the cut, and ``one_bucket`` puts each dtype and device in a single bucket (torch's layout
    before the ready order is known).
    """
    # Cut in registration order and reversed (initially): gradients arrive roughly in
    # reverse, and the small first-cut bucket then holds the first layers, whose gradients
    # come last, so the all-reduce left after backward is a short one.
    sizes = [p.numel() * p.element_size() for p in params]
    keys = [(p.dtype, p.device) for p in params]
    if one_bucket:
        return list(reversed(assign_buckets(sizes, keys, order, sys.maxsize, sys.maxsize)))
    layout = assign_buckets(sizes, keys, order, caps[-1], caps[0], caps=caps)
    return list(reversed(layout)) if reverse else layout


@dataclass(eq=False)
class Bucket:
    """One bucket at run time: its flat buffer, a view of it per parameter, how many of its
    gradients are still to come in the current backward, whether its buffer was handed to the
    parameters as their ``.grad`` in the last one, and a spare buffer (with its views) for
    when a user keeps those gradients."""

    index: int
    params: list[int]
    flat: torch.Tensor
    views: list[torch.Tensor]
    pending: int = field(default=0)
    handed_over: bool = field(default=False)
    spare: tuple[torch.Tensor, list[torch.Tensor]] | None = field(default=None)


def build_buckets(layout: Sequence[Sequence[int]], params: Sequence[torch.Tensor]) -> list[Bucket]:
    """Allocate a zeroed flat buffer per bucket and carve one view per parameter out of it."""
    buckets = []
    for b, indices in enumerate(layout):
        first = params[indices[0]]
        numel = sum(params[i].numel() for i in indices)
        flat = torch.zeros(numel, dtype=first.dtype, device=first.device)
        views, offset = [], 0
        for i in indices:
            n = params[i].numel()
            views.append(flat[offset : offset + n].view(params[i].shape))
            offset += n
        buckets.append(Bucket(b, list(indices), flat, views))
    return buckets
