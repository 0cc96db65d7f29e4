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

_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
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
