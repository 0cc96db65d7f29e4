"""Batches as byte messages: the pure half of BroadcastLoader (no communication).

A batch (tensors inside tuples, lists, dicts and named tuples, plus any picklable values) becomes
one byte tensor: the tensors' bytes at aligned offsets, then a pickled :class:`Header` holding
the structure with each tensor replaced by a :class:`Slot`. ``unpack`` rebuilds the batch with
its tensors as views into the message.

Example::

    header, tensors = flatten({"x": torch.ones(2, 3), "id": "a"})
    message = encode(header, tensors, torch.device("cpu"))
    batch = unpack(decode(message, header.nbytes), message)
"""

from __future__ import annotations

import math
import pickle
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch


@dataclass(frozen=True)
class Slot:
    """Where a tensor was in the batch: its index in the batch's list of tensors."""

    index: int


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # in bytes, into the message

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Header:
    kind: Literal["batch", "end", "error", "ready", "invalid"]
    skeleton: Any = None  # the batch, each tensor replaced by a Slot
    specs: tuple[TensorSpec, ...] = ()
    nbytes: int = 0
    error: str = ""
    lengths: tuple[int | None, ...] = ()  # "ready" only: len() of each member's loader


def flatten(batch: Any) -> tuple[Header, list[torch.Tensor]]:
    """The batch's header and its tensors, in the order of their slots."""
    tensors: list[torch.Tensor] = []

    def to_slot(t: torch.Tensor) -> Slot:
        if t.layout != torch.strided:
            raise TypeError(f"cannot send a tensor of layout {t.layout}; only strided tensors")
        tensors.append(t)
        return Slot(len(tensors) - 1)

    skeleton = map_structure(batch, to_slot, lambda x: isinstance(x, torch.Tensor))
    specs, nbytes = [], 0
    for t in tensors:
        # Each tensor starts at a multiple of its element size: viewing bytes as a dtype needs it.
        nbytes = -(-nbytes // t.element_size()) * t.element_size()
        specs.append(TensorSpec(tuple(t.shape), t.dtype, nbytes))
        nbytes += t.numel() * t.element_size()
    return Header("batch", skeleton, tuple(specs), nbytes), tensors


def encode(header: Header, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One byte tensor on ``device``: the tensors' bytes at their offsets, then the header.

    The data comes first so that its offsets (and their alignment) do not depend on the length
    of the pickled header.
    """
    blob = pickle.dumps(header)
    message = torch.empty(header.nbytes + len(blob), dtype=torch.uint8, device=device)
    for t, spec in zip(tensors, header.specs, strict=True):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        message[spec.offset : spec.offset + spec.nbytes].copy_(raw)
    message[header.nbytes :].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    return message


def decode(message: torch.Tensor, data_bytes: int) -> Header:
    return pickle.loads(message[data_bytes:].cpu().numpy().tobytes())


def unpack(header: Header, message: torch.Tensor) -> Any:
    """The batch rebuilt from the header, its tensors views into the message."""
    tensors = [
        message[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in header.specs
    ]
    return map_structure(header.skeleton, lambda slot: tensors[slot.index], is_slot)


def map_structure(obj: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool]) -> Any:
    """``obj`` with ``fn`` applied to its leaves, through tuples, lists, dicts and named tuples.

    The one rule for what counts as structure: packing and unpacking both walk it, so a batch
    is rebuilt with the types it had. Anything else is a value and travels pickled.
    """
    if is_leaf(obj):
        return fn(obj)
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, map_structure(v, fn, is_leaf)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):  # a named tuple
        return type(obj)(*(map_structure(v, fn, is_leaf) for v in obj))
    if type(obj) in (tuple, list):
        return type(obj)(map_structure(v, fn, is_leaf) for v in obj)
    return obj


def is_slot(x: Any) -> bool:
    return isinstance(x, Slot)


def error_header(exc: BaseException, leader: int, where: str) -> Header:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return Header(
        "error",
        error=f"BroadcastLoader: the loader on rank {leader} raised while {where}: "
        f"{type(exc).__name__}: {exc}\n--- traceback on rank {leader}:\n{text}",
    )
