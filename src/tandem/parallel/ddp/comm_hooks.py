"""Communication hooks: how a bucket of gradients becomes the mean over ranks.

A hook is any callable ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``. It is
called once per bucket, as soon as the bucket's gradients are all ready, and must start (not
finish) the communication: the future's value is the bucket's reduced buffer, i.e. the *mean*
over ranks, and tandem copies it into the parameters' ``.grad``. ``state`` is whatever was
registered with the hook (the built-in hooks take the process group, or None for the world).
The signature is torch's, so hooks written for ``torch.nn.parallel.DistributedDataParallel``
work unchanged, and ours work in torch's DDP.

Example, a hook of one's own that clips each bucket before averaging::

    def clipped_mean_hook(state, bucket):
        buf = bucket.buffer()
        buf.clamp_(-state["clip"], state["clip"])
        return allreduce_hook(None, bucket)

    model = tandem.DDP(net)
    model.register_comm_hook({"clip": 1.0}, clipped_mean_hook)
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tandem._dist import group_size

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]


class GradBucket:
    """What a communication hook sees: one bucket's flat buffer and the parameters in it.

    Methods, not attributes, as torch's ``GradBucket`` has them, so hooks port both ways.

    Example::

        def print_sizes(state, bucket):
            print(bucket.index(), bucket.buffer().numel(), len(bucket.parameters()))
            return allreduce_hook(state, bucket)
    """

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._parameters = parameters
        # The views of ``buffer``; after set_buffer() they are cut anew from the new buffer.
        self._gradients = gradients
        self._views_of: torch.Tensor = buffer
        self._is_last = is_last

    def index(self) -> int:
        """Position of this bucket in launch order (0 is launched first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D tensor holding every gradient of this bucket, back to back."""
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients are in this bucket, in buffer order."""
        return self._parameters

    def gradients(self) -> list[torch.Tensor]:
        """One view of ``buffer()`` per parameter, shaped like the parameter.

        Views of the buffer as it is now, as torch's ``GradBucket.gradients()`` are: after
        :meth:`set_buffer` they are views of the new buffer, in its dtype. A hook that works
        on them in place (PowerSGD writes its low-rank approximations into them) therefore
        writes into the buffer it returns.

        Example::

            bucket.set_buffer(bucket.buffer().to(torch.float16))
            assert bucket.gradients()[0].dtype == torch.float16   # views of the new buffer
        """
        if self._views_of is not self._buffer:
            # Back to back from offset 0, as in the bucket (torch cuts them the same way).
            views, offset = [], 0
            for g in self._gradients:
                views.append(self._buffer.narrow(0, offset, g.numel()).view(g.shape))
                offset += g.numel()
            self._gradients, self._views_of = views, self._buffer
        return self._gradients

    def is_last(self) -> bool:
        """True for the last bucket of the iteration."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` this bucket's buffer, as torch's ``GradBucket.set_buffer`` does.

        The buffer is replaced, not written into: after ``set_buffer(buf.half())``,
        ``buffer()`` is that float16 tensor and ``gradients()`` are views of it, so a hook
        wrapped by ``fp16_compress_wrapper`` (``allreduce_hook``, ``powerSGD_hook``) computes
        and sums in float16, as it does under torch's DDP. The reducer copies the future's
        result back into the gradients whatever its dtype.

        Example::

            wrapped = fp16_compress_wrapper(powerSGD_hook)   # torch's default_hooks
            model.register_comm_hook(PowerSGDState(process_group=None), wrapped)
        """
        self._buffer = tensor


def issues_one_collective(hook: CommHook) -> bool:
    """True for the hooks known to issue their one collective before they return (torch's and
    tandem's allreduce, fp16 and bf16 hooks, and torch's noop_hook, which issues none).

    The reducer launches the buckets of these hooks without waiting for the previous bucket's
    future; any other hook may issue more collectives from its future's callbacks.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks

    return hook in (
        default_hooks.allreduce_hook,
        default_hooks.fp16_compress_hook,
        default_hooks.bf16_compress_hook,
        debugging_hooks.noop_hook,
        allreduce_hook,
        fp16_compress_hook,
        bf16_compress_hook,
    )


def completed(tensor: torch.Tensor) -> torch.futures.Future:
    """A future that already holds ``tensor``: the one-rank case, where nothing is sent."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


# The built-in hooks leave ``bucket`` unannotated on purpose: torch's DDP rejects a hook whose
# bucket annotation is not its own GradBucket class (or whose return annotation is not exactly
# Future[Tensor], hence no postponed annotations in this file), and these hooks work there too.
def allreduce_hook(
    group: dist.ProcessGroup | None,
    bucket,
) -> torch.futures.Future[torch.Tensor]:
    """Mean over ranks: divide, then sum-all-reduce.

    Dividing first, not after, keeps large gradients from overflowing in the sum (fp16).

    Example::

        model.register_comm_hook(None, allreduce_hook)   # what tandem.DDP does by default
    """
    buf = bucket.buffer()
    size = group_size(group)
    if size == 1:
        return completed(buf)
    buf.div_(size)
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _compress_hook(dtype: torch.dtype) -> CommHook:
    def hook(
        group: dist.ProcessGroup | None,
        bucket,
    ) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        size = group_size(group)
        # Divide in the low precision, as torch's hook does, so that both give the same bits.
        compressed = buf.to(dtype).div_(size)
        if size == 1:
            # Nothing is sent, but the gradients are rounded as torch's hook rounds them alone:
            # a run's numbers do not change with whether there is a second rank.
            buf.copy_(compressed)
            return completed(buf)
        work = dist.all_reduce(compressed, group=group, async_op=True)

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            buf.copy_(fut.value()[0])
            return buf

        return work.get_future().then(decompress)

    return hook


bf16_compress_hook: CommHook = _compress_hook(torch.bfloat16)
bf16_compress_hook.__name__ = "bf16_compress_hook"
bf16_compress_hook.__doc__ = """Halve the bytes sent: all-reduce in bfloat16, then cast back.

bfloat16 keeps float32's exponent range (no overflow) with an 8-bit mantissa, so each averaged
gradient carries a relative error of about 2**-8.

Example::

    model = tandem.DDP(net, comm_hook=bf16_compress_hook)
"""

fp16_compress_hook: CommHook = _compress_hook(torch.float16)
fp16_compress_hook.__name__ = "fp16_compress_hook"
fp16_compress_hook.__doc__ = """Halve the bytes sent: all-reduce in float16, then cast back.

More mantissa than bfloat16 (10 bits) but a far smaller range: gradients above 65504 overflow.

Example::

    model = tandem.DDP(net, comm_hook=fp16_compress_hook)
"""
