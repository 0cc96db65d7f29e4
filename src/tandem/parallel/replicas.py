"""Keeping replicas identical: check that every rank built the same model, then copy rank 0's.

Example::

    verify_same_parameters(model.named_parameters(), group=None)
    broadcast_coalesced([*model.parameters(), *model.buffers()], group=None)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from tandem.parallel.comm_hooks import group_size

# Broadcast in flat chunks of at most this many bytes: few collectives, bounded extra memory.
CHUNK_BYTES = 64 * 1024 * 1024

Signature = tuple[str, tuple[int, ...], str, bool]


def signature(named_params: Iterable[tuple[str, torch.Tensor]]) -> list[Signature]:
    """(name, shape, dtype, requires_grad) of every parameter, in registration order."""
    return [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in named_params]


def first_difference(signatures: Sequence[Sequence[Signature]]) -> str | None:
    """Describe the first parameter in which some rank differs from rank 0, or None.

    Example::

        >>> a = [("w", (2, 3), "torch.float32", True)]
        >>> b = [("w", (4, 3), "torch.float32", True)]
        >>> first_difference([a, b])
        "parameter 'w' (#0) differs: rank 0 has 'w' of shape (2, 3) torch.float32, rank 1 has 'w' of shape (4, 3) torch.float32"
    """  # noqa: E501
    reference = signatures[0]
    length = max(len(s) for s in signatures)
    for j in range(length):
        entries = [s[j] if j < len(s) else None for s in signatures]
        if all(e == entries[0] for e in entries):
            continue
        name = next(e[0] for e in entries if e is not None)
        described = [f"rank 0 has {_describe(entries[0])}"]
        described += [
            f"rank {r} has {_describe(e)}" for r, e in enumerate(entries) if r and e != entries[0]
        ]
        counts = ""
        if any(len(s) != len(reference) for s in signatures):
            counts = (
                " (parameter counts: "
                + ", ".join(f"rank {r}: {len(s)}" for r, s in enumerate(signatures))
                + ")"
            )
        return f"parameter '{name}' (#{j}) differs: " + ", ".join(described) + counts
    return None


def _describe(entry: Signature | None) -> str:
    if entry is None:
        return "no such parameter"
    name, shape, dtype, requires_grad = entry
    frozen = "" if requires_grad else " (requires_grad=False)"
    return f"'{name}' of shape {shape} {dtype}{frozen}"


def verify_same_parameters(
    named_params: Iterable[tuple[str, torch.Tensor]],
    group: dist.ProcessGroup | None = None,
    wrapper: str = "tandem.DDP",
) -> None:
    """Raise ValueError on every rank unless all ranks hold the same parameter signature.

    Gathering the signatures is one collective that every rank joins, so a mismatch is an error
    in seconds on all ranks, not a hang in the first all-reduce of mismatched buckets.
    """
    mine = signature(named_params)
    size = group_size(group)
    if size == 1:
        return
    everyone: list = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    problem = first_difference(everyone)
    if problem is not None:
        raise ValueError(
            f"{wrapper}: the model differs across ranks: {problem}. Every rank must build "
            f"the same model (same code, same arguments) before passing it to {wrapper}."
        )


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None, src: int = 0
) -> None:
    """Overwrite ``tensors`` on every rank with group rank ``src``'s values.

    Tensors travel as raw bytes, so that every dtype shares one flat buffer: a model's buffers
    (float statistics and integer counters) cost one collective per forward, not one per dtype.

    Example::

        broadcast_coalesced(list(model.buffers()))   # every rank now has rank 0's buffers
    """
    if group_size(group) == 1 or not tensors:
        return
    global_src = dist.get_global_rank(group if group is not None else dist.group.WORLD, src)
    receiving = dist.get_rank(group) != src
    for chunk in _chunks(tensors):
        flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in chunk])
        dist.broadcast(flat, src=global_src, group=group)
        if not receiving:
            continue
        offset = 0
        with torch.no_grad():
            for t in chunk:
                n = t.numel() * t.element_size()
                t.copy_(flat[offset : offset + n].view(t.dtype).view_as(t))
                offset += n


def _chunks(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Group tensors into byte chunks of about CHUNK_BYTES, one device per chunk.

    Within a chunk the widest elements come first: every tensor then starts at an offset that is
    a multiple of its element size, which reinterpreting the bytes as its dtype requires.
    """
    by_device: dict[torch.device, list[list[torch.Tensor]]] = {}
    filled: dict[torch.device, int] = {}
    for t in tensors:
        chunks = by_device.setdefault(t.device, [[]])
        if filled.get(t.device, 0) >= CHUNK_BYTES:
            chunks.append([])
            filled[t.device] = 0
        chunks[-1].append(t)
        filled[t.device] = filled.get(t.device, 0) + t.numel() * t.element_size()
    return [
        sorted(chunk, key=lambda t: -t.element_size())
        for chunks in by_device.values()
        for chunk in chunks
    ]
