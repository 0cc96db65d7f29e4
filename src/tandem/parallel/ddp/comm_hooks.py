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

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tandem._dist import all_gather_flat, group_size, reduce_scatter_flat
from tandem.doctor import records

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


def orders_its_collectives(hook: CommHook) -> bool:
    """True for the hooks whose buckets may be launched without waiting for the previous
    bucket's future: those known to issue their one collective before they return (torch's and
    tandem's allreduce, fp16 and bf16 hooks, and torch's noop_hook, which issues none), and
    :func:`hybrid_allreduce_hook`, whose one thread issues every bucket's collectives in launch
    order.

    Any other hook may issue more collectives from its future's callbacks, at times that differ
    between ranks: the reducer then launches bucket k+1 only once bucket k's future is done.
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
        hybrid_allreduce_hook,
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


class HybridState:
    """The state of :func:`hybrid_allreduce_hook`: a grid's two groups, the divisor, and the
    thread that issues the buckets' collectives in order.

    Args:
        shard_group: the row (the ranks of this node): the bucket is reduce-scattered and
            all-gathered within it.
        replicate_group: the column (this rank's place on every node): the slices are
            all-reduced across it.
        divisor: what the sum is divided by (every rank of the grid), or a function giving it
            at each call (tandem.DDP passes its reducer's, which ``tandem.join`` changes).

    Example::

        rows, columns = tandem.groups.partition(2), tandem.groups.strided(2)
        state = HybridState(rows.group, columns.group, divisor=4)
    """

    def __init__(
        self,
        shard_group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
        divisor: "int | Callable[[], int]",
    ) -> None:
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.shard_size = group_size(shard_group) if shard_group is not None else 1
        self.replicate_size = group_size(replicate_group) if replicate_group is not None else 1
        self._divisor = divisor
        self._jobs: queue.SimpleQueue[Any] | None = None

    def divisor(self) -> int:
        """What the bucket's sum is divided by, now."""
        return self._divisor() if callable(self._divisor) else self._divisor

    def submit(self, stages: list[tuple[str, Callable[[], Any]]], finish: Callable[[], Any]) -> Any:
        """A future of ``finish()``, run once ``stages`` (each starts one collective and
        returns its work) have run one after the other, each waited for before the next.

        One thread of this state's own runs the stages of every bucket in the order they were
        submitted: each collective needs the previous one's result, and Gloo's reduce-scatter
        has no future to chain on; a wait on the main thread would stop backward. Every rank
        submits the buckets in the same order, so every group sees the same collectives in the
        same order on each of its ranks.
        """
        result: torch.futures.Future = torch.futures.Future()
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(
                target=_courier, args=(self._jobs,), name="tandem-ddp-hybrid", daemon=True
            ).start()
        self._jobs.put((stages, finish, result))
        return result


def _courier(jobs: "queue.SimpleQueue[Any]") -> None:
    """The thread of a :class:`HybridState`: each job's collectives in turn, then its result."""
    while True:
        stages, finish, result = jobs.get()
        try:
            for what, start in stages:
                with records.tagged(what):
                    work = start()
                records.wait(work)
            result.set_result(finish())
        except Exception as exc:  # a failed collective: the reducer's wait raises it
            result.set_exception(exc)


def hybrid_allreduce_hook(
    state: HybridState,
    bucket,
) -> torch.futures.Future[torch.Tensor]:
    """Mean over a grid of ranks, the only traffic across nodes one slice per rank.

    Three collectives instead of one all-reduce: a reduce-scatter within the node (each rank
    ends with the node's sum of its 1/S of the bucket), an all-reduce of that slice across the
    nodes (the only collective that leaves the node: 1/S of the bytes a flat all-reduce would
    send there), and an all-gather within the node. The bucket is divided by the grid's size
    first, as :func:`allreduce_hook` divides first. The collectives are issued by the state's
    thread (:meth:`HybridState.submit`), each after the previous one is done.

    Example::

        model = tandem.DDP(net, hybrid=True)     # installs this hook with the node's groups
    """
    buf = bucket.buffer()
    buf.div_(state.divisor())
    shard, replicate = state.shard_size, state.replicate_size
    n = buf.numel()
    # The reduce-scatter cuts its input into S equal slices: a bucket of a size S does not
    # divide is sent with zeros appended up to the next multiple of S. The zeros sum to zeros,
    # and only the first n elements of the gathered result are copied back.
    padded = -(-n // shard) * shard
    sent = buf if padded == n else torch.cat([buf, buf.new_zeros(padded - n)])
    piece = sent if shard == 1 else sent.new_empty(padded // shard)
    what = f"DDP hybrid bucket {bucket.index()}"
    stages: list[tuple[str, Callable[[], Any]]] = []
    if shard > 1:
        stages.append(
            (
                f"{what}: reduce-scatter in the node",
                lambda: reduce_scatter_flat(piece, sent, state.shard_group, async_op=True),
            )
        )
    if replicate > 1:
        stages.append(
            (
                f"{what}: all-reduce across the nodes",
                lambda: dist.all_reduce(piece, group=state.replicate_group, async_op=True),
            )
        )
    if shard > 1:
        stages.append(
            (
                f"{what}: all-gather in the node",
                lambda: all_gather_flat(sent, piece, state.shard_group, async_op=True),
            )
        )

    def finish() -> torch.Tensor:
        if sent is not buf:
            buf.copy_(sent[:n])
        return buf

    return state.submit(stages, finish)


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
