"""Keeping replicas identical: check that every rank built the same model, then copy rank 0's.

The checks run at construction, before the first collective whose sizes depend on the model: a
rank with another model would otherwise send a buffer of another size, and the ranks would hang
in that collective (or the backend abort the process). ``check_device_ids`` is the local check
of a wrapper's ``device_ids`` against where the module lives.

Example::

    verify_same_model(model, group=None, wrapper="tandem.DDP")   # parameters and buffers
    broadcast_coalesced([*model.parameters(), *model.buffers()], group=None)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tandem._dist import gather_objects, global_rank, group_rank, group_size

# Broadcast in flat chunks of at most this many bytes: few collectives, bounded extra memory.
CHUNK_BYTES = 64 * 1024 * 1024

# (name, shape, dtype, requires_grad) of a parameter; (name, shape, dtype) of a buffer.
Signature = tuple[str, tuple[int, ...], str, bool] | tuple[str, tuple[int, ...], str]


def signature(named_params: Iterable[tuple[str, torch.Tensor]]) -> list[Signature]:
    """(name, shape, dtype, requires_grad) of every parameter, in registration order."""
    return [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in named_params]


def buffer_signature(named_buffers: Iterable[tuple[str, torch.Tensor]]) -> list[Signature]:
    """(name, shape, dtype) of every buffer, in registration order.

    No requires_grad: buffers are not trained, and torch copies them whatever it is.
    """
    return [(n, tuple(b.shape), str(b.dtype)) for n, b in named_buffers]


def first_difference(
    signatures: Sequence[Sequence[Signature]], kind: str = "parameter"
) -> str | None:
    """Describe the first ``kind`` ("parameter" or "buffer") in which some rank differs from
    rank 0, or None.

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
        described = [f"rank 0 has {_describe(entries[0], kind)}"]
        described += [
            f"rank {r} has {_describe(e, kind)}"
            for r, e in enumerate(entries)
            if r and e != entries[0]
        ]
        counts = ""
        if any(len(s) != len(reference) for s in signatures):
            counts = (
                f" ({kind} counts: "
                + ", ".join(f"rank {r}: {len(s)}" for r, s in enumerate(signatures))
                + ")"
            )
        return f"{kind} '{name}' (#{j}) differs: " + ", ".join(described) + counts
    return None


def _describe(entry: Signature | None, kind: str) -> str:
    if entry is None:
        return f"no such {kind}"
    name, shape, dtype = entry[:3]
    frozen = " (requires_grad=False)" if len(entry) > 3 and not entry[3] else ""
    return f"'{name}' of shape {shape} {dtype}{frozen}"


def _raise_if_different(problem: str | None, wrapper: str) -> None:
    if problem is not None:
        raise ValueError(
            f"{wrapper}: the model differs across ranks: {problem}. Every rank must build "
            f"the same model (same code, same arguments) before passing it to {wrapper}."
        )


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
    if group_size(group) == 1:
        return
    _raise_if_different(first_difference(gather_objects(mine, group)), wrapper)


def verify_same_model(
    module: nn.Module, group: dist.ProcessGroup | None = None, wrapper: str = "tandem.DDP"
) -> None:
    """Raise ValueError on every rank unless all ranks built the same parameters and buffers.

    One collective for both: the first differing parameter is reported, else the first
    differing buffer, each with its name, every differing rank's shape and dtype, and the
    counts when a rank has more or fewer.

    Example::

        verify_same_model(model, process_group, wrapper="tandem.FullyShardedDataParallel")
    """
    mine = (signature(module.named_parameters()), buffer_signature(module.named_buffers()))
    if group_size(group) == 1:
        return
    everyone = gather_objects(mine, group)
    problem = first_difference([params for params, _ in everyone]) or first_difference(
        [buffers for _, buffers in everyone], "buffer"
    )
    _raise_if_different(problem, wrapper)


def check_device_ids(
    module: nn.Module,
    device_ids: Sequence[int | str | torch.device] | None,
    wrapper: str = "tandem.DDP",
    output_device: int | str | torch.device | None = None,
) -> torch.device | None:
    """Raise ValueError where ``device_ids`` cannot describe where ``module`` lives; else the
    device the wrapper moves inputs to (None without device_ids).

    torch's DDP rules, with the fix in the message: ``device_ids`` (and ``output_device``) are
    for a module on one accelerator, so they must be None (or empty) for a CPU module, even
    ``["cpu"]`` (torch rejects that too), and for a module spread over several devices; they
    hold at most one device, and, beyond torch, that device must be the module's own, since
    inputs are moved there. An int is an index on the module's device type (torch's
    convention). Local: no collective, every rank making the mistake raises alike.

    Example::

        check_device_ids(model, [local_rank], wrapper="tandem.DDP")
    """
    given = list(device_ids) if device_ids is not None else []
    # torch tests truthiness: output_device=0 alone passes there, so it passes here too.
    if not given and not output_device:
        return None
    if len(given) > 1:
        raise ValueError(
            f"{wrapper}: device_ids={given} names {len(given)} devices; one process drives one "
            "device: pass device_ids=[local_rank] and start one process per device"
        )
    devices = sorted({p.device for p in module.parameters()}, key=str)
    if not devices:
        return _as_device(given[0], "cuda") if given else None
    passed = f"device_ids={given if device_ids is not None else None}" + (
        f", output_device={output_device!r}" if output_device is not None else ""
    )
    on = ", ".join(str(d) for d in devices)
    if len(devices) > 1:
        raise ValueError(
            f"{wrapper}: {passed}, but the module's parameters are on several devices ({on}). "
            "A module spread over devices moves its own tensors: pass device_ids=None and "
            "output_device=None"
        )
    (device,) = devices
    if device.type == "cpu":
        none = "device_ids=None" + (" and output_device=None" if output_device else "")
        target = _as_device(given[0], "cuda") if given else None
        if target is None or target.type == "cpu":
            # torch rejects even device_ids=["cpu"]: the argument names a GPU or nothing.
            raise ValueError(
                f"{wrapper}: {passed}, but the module's parameters are on {on}: device_ids and "
                f"output_device are for a module on one GPU. Pass {none} for a CPU module"
            )
        raise ValueError(
            f"{wrapper}: {passed}, but the module's parameters are on {on}: device_ids is for "
            f"a module on one GPU. Move the module to {target} first "
            f"(module.to('{target}')), or pass {none} for a CPU module"
        )
    if not given:
        return None
    target = _as_device(given[0], device.type)
    if target.type != device.type or (
        target.index is not None and device.index is not None and target.index != device.index
    ):
        own = device.index if device.index is not None else f"'{device}'"
        raise ValueError(
            f"{wrapper}: {passed}, but the module's parameters are on {device}: inputs would "
            f"be moved to {target}, away from the module. Move the module to {target} first "
            f"(module.to('{target}')), or pass device_ids=[{own}]"
        )
    return target


def _as_device(entry: int | str | torch.device, device_type: str) -> torch.device:
    # torch's convention: an int in device_ids is an index on the module's device type; a
    # device without an index is the current one of its type.
    device = torch.device(device_type, entry) if isinstance(entry, int) else torch.device(entry)
    if device.index is None and device.type == "cuda" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    src: int = 0,
    wait: Callable[[dist.Work], object] = dist.Work.wait,
) -> None:
    """Overwrite ``tensors`` on every rank with group rank ``src``'s values.

    Tensors travel as raw bytes, so that every dtype shares one flat buffer: a model's buffers
    (float statistics and integer counters) cost one collective per forward, not one per dtype.
    ``wait(work)`` waits for each broadcast (DDP's checks that the ranks are still in step).

    Example::

        broadcast_coalesced(list(model.buffers()))   # every rank now has rank 0's buffers
    """
    if group_size(group) == 1 or not tensors:
        return
    global_src = global_rank(group, src)
    receiving = group_rank(group) != src
    for chunk in _chunks(tensors):
        flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in chunk])
        wait(dist.broadcast(flat, src=global_src, group=group, async_op=True))
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
