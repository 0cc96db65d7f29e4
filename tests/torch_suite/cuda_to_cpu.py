"""Moving torch's GPU-only DDP tests to the CPU, the same way for both engines.

Most of torch's DDP tests are written for one GPU per rank: they are wrapped in
``skip_if_lt_x_gpu(n)`` or ``skip_if_no_gpu`` and their bodies say ``model.cuda(rank)``,
``torch.ones(..., device=rank)``, ``x.to(rank)``, ``torch.cuda.set_device(rank)`` and
``DistributedDataParallel(model, device_ids=[rank])``. On a machine without GPUs such a test
is *moved* (in its rank processes only, before the body runs, identically for torch's DDP
and for tandem.DDP):

1. ``strip_gpu_skips``: the ``skip_if_lt_x_gpu`` / ``skip_if_no_gpu`` layers are taken out of
   the test's decorator chain (every other decorator stays);
2. ``cpu_for_cuda``: while the test runs, a ``TorchFunctionMode`` turns every CUDA device
   argument into the CPU: a ``device=`` argument that is an int, ``"cuda[:n]"`` or a CUDA
   ``torch.device``; the device of ``Tensor.to`` and ``Module.to``; ``Tensor.cuda()`` (so
   ``Module.cuda``) returns the tensor where it is. ``torch.cuda.set_device``, ``synchronize``,
   ``current_device``, ``device`` (the context manager) and ``device_count`` (one device per
   rank) are stood in for;
3. ``drop_device_ids``: the DDP constructor gets ``device_ids`` and ``output_device`` as
   ``None`` (both engines reject them for a CPU module, as they should).

What a test then does with real CUDA features (streams, ``torch.cuda.amp``, half precision,
several devices per rank, SyncBatchNorm's CUDA kernels, comparing ``.device`` with
``cuda:n``) still fails, under torch's DDP as under tandem's: such a test shows as failing
with both engines in the results, and counts for neither.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _gpu_skip_codes() -> set[Any]:
    """The code objects of the wrappers that ``skip_if_lt_x_gpu`` and ``skip_if_no_gpu`` make."""
    from torch.testing._internal import common_distributed as cd

    def probe() -> None:
        return None

    return {cd.skip_if_lt_x_gpu(2)(probe).__code__, cd.skip_if_no_gpu(probe).__code__}


def has_gpu_skip(fn: Callable[..., Any]) -> bool:
    """Whether a GPU-count skip wraps ``fn`` (anywhere in its ``__wrapped__`` chain)."""
    codes = _gpu_skip_codes()
    while fn is not None:
        if getattr(fn, "__code__", None) in codes:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def strip_gpu_skips(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` without its GPU-count skip layers; the layers kept are re-pointed past them.

    The wrappers are closures over the function they wrap: a kept wrapper whose inner
    function was a GPU skip has that closure cell set to what the skip wrapped. This changes
    the function objects in place, so it is done in a rank process (a fork of its own).
    """
    codes = _gpu_skip_codes()

    def strip(f: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(f, "__code__", None) in codes:
            return strip(f.__wrapped__)  # type: ignore[attr-defined]
        inner = getattr(f, "__wrapped__", None)
        if inner is None:
            return f
        new_inner = strip(inner)
        if new_inner is not inner:
            cells = [c for c in (f.__closure__ or ()) if c.cell_contents is inner]
            if not cells:
                raise RuntimeError(f"cannot re-point the decorator {f!r} past a GPU skip")
            for cell in cells:
                cell.cell_contents = new_inner
            f.__wrapped__ = new_inner  # type: ignore[attr-defined]
        return f

    return strip(fn)


def _cpu_device(value: Any, int_is_device: bool) -> Any:
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    if int_is_device and isinstance(value, int) and not isinstance(value, bool):
        return "cpu"
    return value


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"], int_is_device=True)
        if func is torch.Tensor.to:
            args = (args[0], *(_cpu_device(a, int_is_device=True) for a in args[1:]))
        elif func is torch._C._nn._parse_to:  # Module.to(...) parses its arguments first
            args = tuple(_cpu_device(a, int_is_device=True) for a in args)
        return func(*args, **kwargs)


class _NoDevice(contextlib.AbstractContextManager):  # torch.cuda.device(n) on the CPU
    def __init__(self, device: Any) -> None:
        self.device = device

    def __exit__(self, *exc: object) -> None:
        return None


@contextlib.contextmanager
def cpu_for_cuda(rank: int) -> Iterator[None]:
    """While active (in a rank process), CUDA device arguments mean the CPU."""
    world_size = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda
    cuda.set_device = lambda device: None  # type: ignore[assignment]
    cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    cuda.current_device = lambda: rank  # type: ignore[assignment]
    cuda.device_count = lambda: world_size  # type: ignore[assignment]
    cuda.device = _NoDevice  # type: ignore[assignment,misc]
    with _CudaToCpu():
        yield


def drop_device_ids(init: Callable[..., None]) -> Callable[..., None]:
    """A DDP ``__init__`` that is given ``device_ids=None, output_device=None``."""

    @functools.wraps(init)
    def cpu_init(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        args = tuple(None if i < 2 else a for i, a in enumerate(args))
        kwargs.pop("device_ids", None)
        kwargs.pop("output_device", None)
        init(self, module, *args, **kwargs)

    return cpu_init
