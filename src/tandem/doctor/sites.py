"""Which line of a stack is the user's: the innermost frame outside torch, tandem and Python.

The collective records (``records``) and the doctor's reports (``hang``) name the user's line
that led to a collective or where a rank waits; frames of torch, of tandem and of Python's own
library (threading's waits, queue's gets) are skipped, packages installed under it are not.
"""

from __future__ import annotations

import os
import sysconfig
from typing import Any

import torch

_TORCH = os.path.dirname(torch.__file__)
_TANDEM = os.path.dirname(os.path.dirname(__file__))
_INTERNAL = (_TORCH, _TANDEM)
# Python's own library is not the user's line either (threading's waits, queue's gets), but the
# packages installed under it are.
_STDLIB = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})
_INSTALLED = tuple({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
_internal_code: dict[Any, bool] = {}  # code object -> in torch, tandem or Python (asked once)


def user_line(frame: Any) -> str:
    """``train.py:44 in step``: the innermost frame from ``frame`` out that is the user's
    (outside torch, tandem and Python's standard library); ``"?"`` if there is none."""
    while frame is not None:
        code = frame.f_code
        internal = _internal_code.get(code)
        if internal is None:
            name = code.co_filename
            internal = _internal_code[code] = name.startswith(_INTERNAL) or (
                name.startswith(_STDLIB) and not name.startswith(_INSTALLED)
            )
        if not internal:
            return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return "?"


def users_own(frame: Any) -> str | None:
    """Whether the call that ``frame`` is in came from the user's code itself rather than
    through tandem: the innermost frame from ``frame`` out that is outside torch and Python's
    own library; its line (as :func:`user_line` gives it) if it is not tandem's, else None.
    A user's ``dist.barrier()`` is the user's own; tandem.DDP's broadcast, made in a Trainer
    the user builds, is not.

    Example::

        site = users_own(sys._getframe(1))   # "train.py:12 in main", or None
    """
    while frame is not None:
        name = frame.f_code.co_filename
        stdlib = name.startswith(_STDLIB) and not name.startswith(_INSTALLED)
        if not name.startswith(_TORCH) and not stdlib:
            if name.startswith(_TANDEM):
                return None
            return f"{os.path.basename(name)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None
