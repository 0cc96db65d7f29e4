"""``torch.compiler.disable`` without importing ``torch._dynamo`` until something compiles.

``torch.compiler.disable`` imports ``torch._dynamo`` when the decorator is applied: 1.7 s on a
2-core machine, paid by every process that imports ``tandem.DDP`` at import time, compiling or
not (every rank of every job, every worker a launcher restarts). Dynamo can only be tracing a
frame once ``torch._dynamo`` has been imported, so the functions decorated here run as they are
until then, and from then on through ``torch._dynamo.disable``, built once per function.
(torch's own ``torch._disable_dynamo`` defers the import to the first call instead; this
defers it to the first call made after something else imported dynamo, usually never.)

Example::

    @eager_only(recursive=False)
    def forward(self, x):
        ...  # never traced into a graph: with recursive=False, the calls it makes may be
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def eager_only(fn: F | None = None, *, recursive: bool = True) -> Any:
    """``torch.compiler.disable(fn, recursive=...)``, importing dynamo only if it is in use.

    Example::

        @eager_only
        def bookkeeping(self) -> None: ...
    """
    if fn is None:
        return functools.partial(eager_only, recursive=recursive)
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            dynamo = sys.modules.get("torch._dynamo")
            if dynamo is None:  # not imported: nothing is compiling
                return fn(*args, **kwargs)
            disabled.append(dynamo.disable(fn, recursive=recursive))
        return disabled[0](*args, **kwargs)

    return inner
