"""One walker over the containers users pass through models: tensors found and mapped in place.

Lists, tuples, namedtuples, dicts (OrderedDict and defaultdict keep their type) and dataclass
instances are walked; everything else is a leaf. A container comes back as its own type, so a
namedtuple batch reaches the module as that namedtuple, not a plain tuple.

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
from collections.abc import Callable
from typing import Any

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` inside it replaced by ``fn(t)``, containers rebuilt."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [map_tensors(fn, x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return type(obj)(map_tensors(fn, x) for x in obj)
    if isinstance(obj, dict):
        out = {k: map_tensors(fn, v) for k, v in obj.items()}
        if isinstance(obj, defaultdict):
            return type(obj)(obj.default_factory, out)
        return out if type(obj) is dict else type(obj)(out)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj``, in walk order."""
    found: list[torch.Tensor] = []
    _collect(obj, found)
    return found


def _collect(obj: Any, found: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _collect(x, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            _collect(x, found)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name), found)
