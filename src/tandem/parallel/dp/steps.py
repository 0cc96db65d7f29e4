"""The four steps of DataParallel, each a function: scatter, replicate, parallel_apply, gather.

``tandem.DataParallel.forward`` is these four calls in a row. Every step is differentiable end
to end, so that one ``backward`` from the gathered output reaches the original parameters (and
the inputs, when they require grad):

- ``scatter`` slices the batch with ``narrow`` and moves each slice with ``.to(device)``; both are
  recorded by autograd.
- ``replicate`` gives every replica the original parameters, or differentiable ``.to(device)``
  copies of them on other devices, so that every replica's gradient accumulates into the
  original ``.grad``.
- ``parallel_apply`` runs one thread per replica under the caller's grad mode and autocast
  state (both are thread-local in torch) and re-raises a replica's exception in the caller.
- ``gather`` concatenates with ``torch.cat`` on the output device.

Example::

    slices = scatter((x,), {}, devices, dim=0)
    replicas = replicate(model, devices[: len(slices)])
    outputs = parallel_apply(replicas, slices, devices[: len(slices)])
    y = gather(outputs, devices[0], dim=0)
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn


class Slice(NamedTuple):
    """One replica's share of the batch: positional and keyword arguments, and the target."""

    args: tuple
    kwargs: dict
    target: Any
    size: int | None  # samples in this slice; None when the inputs hold no tensor


class ReplicaError(RuntimeError):
    """A replica raised in its thread; the message names the replica and device and holds the
    thread's traceback. The original exception is ``.original`` (and ``__cause__``)."""

    def __init__(self, replica: int, device: torch.device, original: BaseException, tb: str):
        self.replica = replica
        self.device = device
        self.original = original
        self.traceback_text = tb
        super().__init__(
            f"replica {replica} on {device} raised {type(original).__name__}: {original}\n\n"
            f"The replica's thread:\n{tb}"
        )

    def __reduce__(self) -> tuple:
        return (type(self), (self.replica, self.device, self.original, self.traceback_text))


# Step 1: scatter


def split_sizes(batch: int, replicas: int) -> list[int]:
    """Slice sizes for ``batch`` samples on at most ``replicas`` replicas: the one split rule.

    As even as possible (sizes differ by at most one, larger first), and never an empty slice:
    a batch smaller than the number of replicas uses fewer replicas. An empty batch is one
    empty slice, so the module still sees it and returns its empty output.

    Example::

        >>> split_sizes(7, 3)
        [3, 2, 2]
        >>> split_sizes(2, 3)
        [1, 1]
    """
    if replicas < 1:
        raise ValueError(f"replicas={replicas}: need at least one replica")
    used = max(1, min(replicas, batch))
    base, extra = divmod(batch, used)
    return [base + 1] * extra + [base] * (used - extra)


def scatter(
    args: tuple,
    kwargs: dict[str, Any],
    devices: Sequence[torch.device],
    dim: int = 0,
    target: Any = None,
) -> list[Slice]:
    """Split the tensors in ``args``, ``kwargs`` and ``target`` along ``dim``, a slice per device.

    Tuples (named tuples too), lists and dicts are walked; other values are passed to every
    replica as they are (the same object). All tensors must have the same size along ``dim``,
    the batch size; ``split_sizes`` decides the slices. Inputs with no tensor at all make one
    slice (nothing to split).

    Args:
        args: the positional arguments of the forward.
        kwargs: the keyword arguments of the forward.
        devices: the replicas' devices; slice ``i`` is moved to ``devices[i]``.
        dim: the batch dimension.
        target: optional labels, split like the inputs (the balanced mode's loss needs them).

    Example::

        >>> s = scatter((torch.zeros(5, 2),), {"flag": True}, [torch.device("cpu")] * 2)
        >>> [(x.shape[0], kw["flag"]) for (x,), kw, _, _ in s]
        [(3, True), (2, True)]
    """
    parts = {"args": tuple(args), "kwargs": dict(kwargs), "target": target}
    batch = _batch_size(parts, dim)
    if batch is None:
        return [Slice(parts["args"], parts["kwargs"], target, None)]
    sizes = split_sizes(batch, len(devices))
    slices = []
    start = 0
    for size, device in zip(sizes, devices, strict=False):
        piece = _map_tensors(parts, partial(_slice, dim=dim, start=start, size=size, device=device))
        slices.append(Slice(piece["args"], piece["kwargs"], piece["target"], size))
        start += size
    return slices


def _slice(t: torch.Tensor, dim: int, start: int, size: int, device: torch.device) -> torch.Tensor:
    if size == t.size(dim):
        return t.to(device, non_blocking=True)  # the whole batch: the tensor itself if in place
    # narrow is a view and .to a recorded copy: gradients flow back into the caller's input
    return t.narrow(dim, start, size).to(device, non_blocking=True)


def _batch_size(parts: dict[str, Any], dim: int) -> int | None:
    first: tuple[str, int] | None = None
    for path, t in _tensors(parts, ""):
        if t.dim() == 0:
            raise ValueError(
                f"{path} is a 0-dim tensor: it cannot be split along dim {dim}; every tensor "
                "in the inputs is split into the replicas' slices"
            )
        size = t.size(dim)
        if first is None:
            first = (path, size)
        elif size != first[1]:
            raise ValueError(
                f"the inputs disagree on the batch size along dim {dim}: {first[0]} has "
                f"{first[1]}, {path} has {size}; every tensor in the inputs is split into the "
                "replicas' slices"
            )
    return None if first is None else first[1]


def _tensors(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            yield from _tensors(x, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}[{k!r}]" if path else str(k))


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``; containers rebuilt, the rest kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_map_tensors(x, fn) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    return obj


# Step 2: replicate


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One replica of ``module`` per device; replica 0 is ``module`` itself.

    Replica 0 runs on ``devices[0]``, where the module already lives, so it needs no copy: its
    in-place updates (BatchNorm running statistics) land in the module, as in torch, where
    replica 0 shares the module's buffers. Every other replica is a shallow copy of the module
    tree whose parameters are ``p.to(device)``: the original tensor on the same device (several
    CPU replicas share one set), a differentiable copy on another, so that backward accumulates
    every replica's gradient into the original ``.grad``. Their buffers are fresh copies, taken
    before any replica runs: each replica normalizes with the module's statistics, and its own
    updates are discarded.

    Example::

        >>> model = nn.Linear(2, 2)
        >>> r0, r1 = replicate(model, [torch.device("cpu")] * 2)
        >>> r0 is model, r1 is model, r1.weight is model.weight
        (True, False, True)
    """
    replicas = [module]
    for device in devices[1:]:
        # Keyed by identity so that tied weights (and shared buffers) stay tied in the replica.
        params = {id(p): p.to(device) for p in module.parameters()}
        buffers = {id(b): b.to(device, copy=True) for b in module.buffers()}
        replicas.append(_copy_tree(module, params, buffers, {}))
    return replicas


def _copy_tree(
    module: nn.Module,
    params: dict[int, torch.Tensor],
    buffers: dict[int, torch.Tensor],
    memo: dict[int, nn.Module],
) -> nn.Module:
    if id(module) in memo:  # a submodule used twice is one module in the replica too
        return memo[id(module)]
    # The module's own hook: a shallow copy with empty parameters (RNNs also copy their flat
    # weight lists here, which the plain copy would share with the original).
    replica = module._replicate_for_data_parallel()
    memo[id(module)] = replica
    for name, p in module._parameters.items():
        if p is None:
            replica._parameters[name] = None
        else:
            # A copy on another device is no leaf, so it goes in as a plain attribute, not as
            # a Parameter (the module's own __setattr__ decides; RNNs update their flat weights).
            setattr(replica, name, params[id(p)])
    for name, b in module._buffers.items():
        if b is not None:
            replica._buffers[name] = buffers[id(b)]
    for name, child in module._modules.items():
        replica._modules[name] = None if child is None else _copy_tree(child, params, buffers, memo)
    return replica


# Step 3: parallel_apply


@dataclass(frozen=True)
class _CallerState:
    """The thread-local state a replica's thread must share with the caller."""

    grad_enabled: bool
    inference: bool
    autocast: dict[str, tuple[bool, torch.dtype]]
    autocast_cache: bool
    streams: dict[torch.device, Any] = field(default_factory=dict)

    @classmethod
    def capture(cls, devices: Sequence[torch.device]) -> _CallerState:
        types = {d.type for d in devices}
        return cls(
            grad_enabled=torch.is_grad_enabled(),
            inference=torch.is_inference_mode_enabled(),
            autocast={
                t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types
            },
            autocast_cache=torch.is_autocast_cache_enabled(),
            # Each replica works on the caller's current stream of its device: the inputs
            # were copied there, and the caller's later work on that stream waits for it.
            streams={d: torch.cuda.current_stream(d) for d in devices if d.type == "cuda"},
        )

    @contextmanager
    def enter(self, device: torch.device) -> Iterator[None]:
        with ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            else:
                stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            enabled, dtype = self.autocast[device.type]
            if enabled:
                stack.enter_context(
                    torch.autocast(device.type, dtype=dtype, cache_enabled=self.autocast_cache)
                )
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
                stack.enter_context(torch.cuda.stream(self.streams[device]))
            yield


def parallel_apply(
    replicas: Sequence[Callable[..., Any]],
    slices: Sequence[Slice],
    devices: Sequence[torch.device],
) -> list[Any]:
    """``replicas[i](*slices[i].args, **slices[i].kwargs)`` for every i, one thread each.

    Each thread runs under the caller's grad mode, inference mode and autocast state, and on
    CUDA with its device and the caller's current stream there. One replica runs in the
    caller's thread (nothing to overlap); its exceptions propagate unchanged.

    Raises:
        ReplicaError: a replica raised; the lowest-numbered failure is raised, naming the
            replica and its device, with the thread's traceback in the message.

    Example::

        >>> outs = parallel_apply([torch.neg, torch.abs], [Slice((torch.ones(1),), {}, None, 1),
        ...     Slice((-torch.ones(1),), {}, None, 1)], [torch.device("cpu")] * 2)
        >>> [o.item() for o in outs]
        [-1.0, 1.0]
    """
    if not len(replicas) == len(slices) == len(devices):
        raise ValueError(
            f"{len(replicas)} replicas, {len(slices)} slices and {len(devices)} devices: "
            "need one slice and one device per replica"
        )
    if len(replicas) == 1:
        return [replicas[0](*slices[0].args, **slices[0].kwargs)]

    state = _CallerState.capture(devices)
    results: list[Any] = [None] * len(replicas)
    errors: list[tuple[BaseException, str] | None] = [None] * len(replicas)

    def work(i: int) -> None:
        try:
            with state.enter(devices[i]):
                results[i] = replicas[i](*slices[i].args, **slices[i].kwargs)
        except BaseException as e:  # every failure must reach the caller, not die with us
            errors[i] = (e, traceback.format_exc())

    threads = [
        threading.Thread(target=work, args=(i,), name=f"replica {i} on {d}", daemon=True)
        for i, d in enumerate(devices)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, error in enumerate(errors):
        if error is not None:
            raise ReplicaError(i, devices[i], *error) from error[0]
    return results


# Step 4: gather


def gather(outputs: Sequence[Any], device: torch.device, dim: int = 0) -> Any:
    """Concatenate the replicas' outputs along ``dim`` on ``device``, structure by structure.

    Tensors are joined with ``torch.cat`` (0-dim tensors, one per replica, are stacked into a
    vector, as torch does); tuples, lists and dicts are gathered element by element; ``None``
    stays ``None``; other values must be equal on every replica. One output is only moved.

    Example::

        >>> gather([torch.ones(2, 3), torch.zeros(1, 3)], torch.device("cpu")).shape
        torch.Size([3, 3])
    """
    if len(outputs) == 1:
        return _map_tensors(outputs[0], lambda t: t.to(device))
    return _gather(list(outputs), device, dim, "output")


def _gather(outs: list[Any], device: torch.device, dim: int, path: str) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise ValueError(f"{path} is a tensor on replica 0 but not on every replica")
        shapes = [tuple(o.shape) for o in outs]
        d = dim % len(shapes[0]) if shapes[0] else 0
        rest = [s[:d] + s[d + 1 :] for s in shapes]
        if any(len(s) != len(shapes[0]) or r != rest[0] for s, r in zip(shapes, rest, strict=True)):
            raise ValueError(
                f"{path}: the replicas' outputs have shapes {shapes}, which differ outside dim "
                f"{dim}; gather concatenates them along dim {dim}"
            )
        moved = [o.to(device) for o in outs]
        # cat and .to are recorded by autograd: the gradient of the gathered output is split
        # back to the replicas' devices.
        return torch.stack(moved) if first.dim() == 0 else torch.cat(moved, dim)
    if first is None or not isinstance(first, (tuple, list, dict)):
        if any(o != first for o in outs):
            raise ValueError(
                f"{path} is {first!r} on replica 0 but {[o for o in outs]!r} across replicas: "
                "only tensors are gathered; other outputs must be equal on every replica"
            )
        return first
    if any(type(o) is not type(first) or len(o) != len(first) for o in outs):
        raise ValueError(
            f"{path}: the replicas returned different structures "
            f"({[f'{type(o).__name__} of {len(o)}' for o in outs]})"
        )
    if isinstance(first, dict):
        if any(o.keys() != first.keys() for o in outs):
            raise ValueError(f"{path}: the replicas returned different keys")
        return type(first)(
            (k, _gather([o[k] for o in outs], device, dim, f"{path}[{k!r}]")) for k in first
        )
    items = [_gather([o[i] for o in outs], device, dim, f"{path}[{i}]") for i in range(len(first))]
    return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)


def tensor_bytes(obj: Any) -> int:
    """Bytes held by the tensors in a nested output (what a gather put on the output device)."""
    return sum(t.numel() * t.element_size() for _, t in _tensors(obj, ""))
