"""Named ranges for torch's profiler and tandem's trace, free when neither records.

Every engine marks its phases (``tandem.ddp.forward``, ``tandem.ddp.bucket_reduce``,
``tandem.fsdp.all_gather``, ...) so that torch's profiler, tandem's own trace
(:mod:`tandem.doctor.trace`) and a user's logs see the same names.
``torch.profiler.record_function`` costs tens of microseconds even with no profiler running,
which per bucket and per unit adds up on small steps: :func:`span` checks first (a flag and
torch's profiler state, about a tenth of a microsecond) and opens a range only while a profiler
or the trace records.

Importing this module starts the trace when ``TANDEM_TRACE_DIR`` is set (``tandem run
--trace``): every engine and the Trainer import it.

Example::

    with span("tandem.ddp.bucket_reduce", "bucket 3"):
        work = dist.all_reduce(flat, async_op=True)
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch.autograd import Variable
from torch.profiler import record_function

from tandem import _tree
from tandem.doctor import trace as _trace

OFF = contextlib.nullcontext()  # stateless: the one "no range" every caller returns
_profiler_enabled = torch.autograd._profiler_enabled


def recording() -> bool:
    """True while torch's profiler or tandem's trace records (a tenth of a microsecond)."""
    return _trace.on or _profiler_enabled()


def span(name: str, detail: str | None = None) -> contextlib.AbstractContextManager[object]:
    """A range named ``name`` (``detail`` its argument) while a profiler or the trace records,
    else nothing.

    Build ``detail`` cheaply, or check :func:`recording` first when it costs something.
    """
    if _trace.on:
        return _Traced(name, detail)
    if not _profiler_enabled():
        return OFF
    return record_function(name, detail)


class _Traced:
    """A span kept for the trace, and the profiler's range too while one records."""

    __slots__ = ("detail", "inner", "name", "start")

    def __init__(self, name: str, detail: str | None) -> None:
        self.name, self.detail = name, detail
        self.inner = record_function(name, detail) if _profiler_enabled() else None

    def __enter__(self) -> _Traced:
        if self.inner is not None:
            self.inner.__enter__()
        self.start = time.time()
        return self

    def __exit__(self, *exc: Any) -> None:
        _trace.add(self.name, self.start, time.time(), self.detail)
        if self.inner is not None:
            self.inner.__exit__(*exc)


def backward_span(name: str, outputs: Any) -> None:
    """While tracing: a span ``name`` from the first gradient reaching ``outputs`` to the end
    of that backward, callbacks included (an engine's gradient sync runs in one).

    Call after the engine hooked the outputs itself: hooks run in the order they were added,
    so the end queued here comes after the engine's own end-of-backward work.
    """
    if not _trace.on:
        return
    tensors = [t for t in _tree.tensors(outputs) if t.requires_grad]
    if tensors:
        opened = _Backward(name)
        for t in tensors:
            t.register_hook(opened.begin)


class _Backward:
    __slots__ = ("name", "start")

    def __init__(self, name: str) -> None:
        self.name = name
        self.start: float | None = None

    def begin(self, grad: torch.Tensor) -> None:
        if self.start is None:
            self.start = time.time()
            Variable._execution_engine.queue_callback(self.end)

    def end(self) -> None:
        if self.start is not None:
            _trace.add(self.name, self.start, time.time())
            self.start = None


_trace.start_from_env()
