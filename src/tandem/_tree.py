"""One walker over the containers users pass through models: tensors found and mapped in place.

Lists, tuples, namedtuples, dicts (OrderedDict and defaultdict keep their type) and dataclass
instances are walked; everything else is a leaf. A container comes back as its own type, so a
namedtuple batch reaches the module as that namedtuple, not a plain tuple.

:func:`to_device` (the Trainer's batches) and tandem.DDP's inputs move with this walker;
:func:`tensors` lists the tensors in the same order.

Example::

    >>> from collections import namedtuple
    >>> Batch = namedtuple("Batch", "x y")
    >>> b = map_tensors(lambda t: t * 2, Batch(torch.ones(1), [torch.ones(1), "label"]))
    >>> type(b).__name__, b.y[1]
    ('Batch', 'label')
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_tensors(
    fn: Callable[[torch.Tensor], Any], obj: Any, *, leaf: Callable[[Any], Any] | None = None
) -> Any:
    """``obj`` with every tensor ``t`` inside it replaced by ``fn(t)``, containers rebuilt.

    Args:
        fn: applied to every tensor.
        obj: a tensor, a container of them (nested), or anything else.
        leaf: applied to every other leaf (what is neither a tensor nor a walked container);
            by default those are kept as they are.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [map_tensors(fn, x, leaf=leaf) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return type(obj)(map_tensors(fn, x, leaf=leaf) for x in obj)
    if isinstance(obj, dict):
        out = {k: map_tensors(fn, v, leaf=leaf) for k, v in obj.items()}
        if isinstance(obj, defaultdict):
            return type(obj)(obj.default_factory, out)
        return out if type(obj) is dict else type(obj)(out)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: map_tensors(fn, getattr(obj, f.name), leaf=leaf)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj if leaf is None else leaf(obj)


def to_device(obj: Any, device: torch.device, float_dtype: torch.dtype | None = None) -> Any:
    """``obj`` with every tensor on ``device``, and its floating tensors cast to ``float_dtype``.

    A leaf that is no tensor but has a ``to`` method (transformers' ``BatchEncoding``, a user's
    batch class) is moved by that method, ``leaf.to(device)``, without a dtype. Copies to a CUDA
    device are issued ``non_blocking``: from pinned memory they overlap with compute, and the
    stream orders them before any kernel that reads them.

    Example::

        batch = to_device({"ids": ids, "mask": mask, "text": texts}, torch.device("cuda", 0))
    """
    non_blocking = device.type == "cuda"

    def move(t: torch.Tensor) -> torch.Tensor:
        if float_dtype is not None and t.is_floating_point():
            return t.to(device, float_dtype, non_blocking=non_blocking)
        return t.to(device, non_blocking=non_blocking)

    def move_leaf(x: Any) -> Any:
        to = getattr(x, "to", None)
        return to(device) if callable(to) and not isinstance(x, type) else x

    return map_tensors(move, obj, leaf=move_leaf)


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj``, in walk order (any mapping's values are walked too)."""
    found: list[torch.Tensor] = []
    _collect(obj, found)
    return found


def _collect(obj: Any, found: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _collect(x, found)
    elif isinstance(obj, Mapping):
        for x in obj.values():
            _collect(x, found)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name), found)
