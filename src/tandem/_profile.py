"""Named ranges for torch's profiler, free when no profiler runs.

Every engine marks its phases (``tandem.ddp.forward``, ``tandem.ddp.bucket_reduce``,
``tandem.fsdp.all_gather``, ...) so that torch's profiler, tandem's own trace and a user's
logs see the same names. ``torch.profiler.record_function`` costs tens of microseconds even
with no profiler running, which per bucket and per unit adds up on small steps: :func:`span`
checks first (a tenth of a microsecond) and opens the range only while a profiler records.

Example::

    with span("tandem.ddp.bucket_reduce", "bucket 3"):
        work = dist.all_reduce(flat, async_op=True)
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

OFF = contextlib.nullcontext()  # stateless: the one "no range" every caller returns


def recording() -> bool:
    """True while torch's profiler records (the check is a tenth of a microsecond)."""
    return torch.autograd._profiler_enabled()


def span(name: str, detail: str | None = None) -> contextlib.AbstractContextManager[object]:
    """A ``record_function(name, detail)`` range while a profiler records, else nothing.

    Build ``detail`` cheaply, or check :func:`recording` first when it costs something.
    """
    if not recording():
        return OFF
    return record_function(name, detail)
