"""A rank's own state as text for the store: its random generators, taken anew only when they
moved (:class:`RngText`, with the cheap look at their raw words), any state as JSON text
(:func:`encode`, :func:`decode`), and the seed of a rank the run had not before
(:func:`newcomer_seed`).

Nothing here talks to the store or the group: the vote and the loops call it.

Example::

    >>> decode(encode([1, 2.5]))
    [1, 2.5]
"""

from __future__ import annotations

import base64
import ctypes
import json
import sys
from typing import Any

import torch

from tandem.checkpoint.rng import (
    compact_rng_state,
    derived_seed,
)


class RngText:
    """This process's generators as a commit leaves them in the store
    (``encode(compact_rng_state())``), taken anew only when they may have changed.

    Taking them costs 0.15 to 0.4 ms (NumPy's ``get_state`` alone 0.06 to 0.18 ms), a step of a
    small model 20 ms: at every step that is most of a 2% budget, for a model that mostly draws
    nothing. So a cheap look first compares their raw words with the last time's (torch's
    state, NumPy's key and position read in place through its bit generator's ``ctypes``
    address, Python's through the object's memory once that reading was checked against
    ``random.getstate()``); the state is taken only when they differ. NumPy's cached Gaussian
    is not in those words: while one is cached, the state is taken every time.

    Example::

        rng = RngText()
        recoverer.commit(step, rng.value())   # the same text, and no work, while nothing draws
        restore_rng_state(...)
        rng.forget()                          # the generators were set: take them anew
    """

    def __init__(self) -> None:
        self._look: tuple[Any, ...] | None = None
        self._text: str | None = None

    def value(self) -> str:
        look = _rng_look()
        if self._text is None or look is None or look != self._look:
            compact = compact_rng_state()
            self._text = encode(compact)
            # A cached Gaussian of NumPy's is used up without moving the words looked at.
            self._look = look if not compact["numpy"][3] else None
        return self._text

    def forget(self) -> None:
        self._text = None


def _rng_look() -> tuple[Any, ...] | None:
    """The raw words of this process's generators, cheaply (see :class:`RngText`); None where
    they cannot be read so."""
    import numpy as np

    python = _python_words()
    if python is None:
        return None
    cuda: list[bytes] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    bits = np.random.mtrand._rand._bit_generator
    numpy = ctypes.string_at(bits.ctypes.state_address, _MT_WORDS * 4 + 4)
    return (torch.get_rng_state().numpy().tobytes(), numpy, python, cuda)


_MT_WORDS = 624  # Mersenne twister's state: 624 32-bit words, and a position
_python_offset: int | None = -1  # where Python's generator keeps its words (None: unknown)


def _python_words() -> tuple[bytes, Any] | None:
    """Python's global generator: its position and words, read from the object's memory, with
    its cached Gaussian; None where that reading does not give ``random.getstate()``'s."""
    import random

    global _python_offset
    inst: Any = random._inst  # type: ignore[attr-defined,unused-ignore]
    if _python_offset == -1:
        # CPython's RandomObject: the object's header, an int (the position), the words.
        _python_offset = None
        header = object.__basicsize__
        raw = ctypes.string_at(id(inst) + header, 4 + _MT_WORDS * 4)
        words = [*memoryview(raw[4:]).cast("I").tolist(), int.from_bytes(raw[:4], sys.byteorder)]
        if tuple(words) == inst.getstate()[1]:
            _python_offset = header
    if _python_offset is None:
        return None
    return ctypes.string_at(id(inst) + _python_offset, 4 + _MT_WORDS * 4), inst.gauss_next


def newcomer_seed(seed: int, step: int, rank: int) -> int:
    """The seed of the generators of a rank that a run had not before (a replacement admitted
    after ``step`` as ``rank``; a resume at a larger world size does the same for its ranks
    beyond the saved ones): Python's, NumPy's and torch's are seeded from it.

    Example::

        seed_rng(newcomer_seed(run.seed, run.step_count, tandem.world().rank))
    """
    return derived_seed("tandem.recovery.newcomer", seed, step, rank)


def encode(state: Any) -> str:
    """``state`` as text for the store: JSON, with each tensor as its dtype, shape and bytes
    (base64). Dicts with string keys, lists, tuples (read back as lists), numbers, strings,
    None and CPU tensors; a float comes back bitwise. Fast enough for every step (a rank's
    generators in about 0.1 ms), and nothing in it is code (unlike a pickle).

    Example::

        >>> decode(encode({"rng": torch.arange(3), "sums": [0.1, 2]}))
        {'rng': tensor([0, 1, 2]), 'sums': [0.1, 2]}
    """
    return json.dumps(_plain(state), separators=(",", ":"))


def decode(text: str | bytes) -> Any:
    """The state :func:`encode` made text of."""
    return _unplain(json.loads(text))


_TENSOR = "__tensor__"


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
        return {
            _TENSOR: str(data.dtype).removeprefix("torch."),
            "shape": list(data.shape),
            "data": base64.b64encode(raw).decode(),
        }
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"only string keys can be encoded, not {list(value)[:3]}")
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot encode a {type(value).__name__} for the store")


def _unplain(value: Any) -> Any:
    if isinstance(value, dict):
        if _TENSOR in value:
            dtype = getattr(torch, value[_TENSOR])
            raw = bytearray(base64.b64decode(value["data"]))
            flat = (
                torch.frombuffer(raw, dtype=torch.uint8)
                if raw
                else torch.empty(0, dtype=torch.uint8)
            )
            return flat.view(dtype).reshape(value["shape"])
        return {k: _unplain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    return value
