"""tandem.DDP's gradient reducer: hooks, buckets (cut, rebuilt, saved), launches, end of backward.

One iteration, as the reducer sees it:

1. ``prepare()`` (end of forward): arm the coming backward; with find_unused_parameters, walk
   the autograd graph from the outputs and note the parameters it cannot reach (unused, or,
   behind a custom autograd Function such as reentrant checkpointing, unused unless a gradient
   comes); hook the outputs so that the end-of-backward callback is queued on the backward the
   *user* started.
2. Per parameter, a post-accumulate-grad hook fires once its ``.grad`` is final for this
   backward, and the bucket's pending count drops.
3. A bucket whose count reaches zero is filled (its gradients copied in, divided by the world
   size) and launched, but only after every bucket before it: all ranks must issue the same
   collectives in the same order, whatever order their hooks fire in. With a communication
   hook, bucket k+1 is launched only once bucket k's future is done, because hooks such as
   PowerSGD issue further collectives from that future's callbacks, on another thread (the
   hooks that order their own collectives are exempt: see ``set_hook``).
4. ``_finalize()`` (runs once backward is done): launch what is left (zeros for gradients this
   rank never got), wait for every bucket, give the means to ``.grad``, and agree across ranks
   on how many gradients each rank missed (and, with find_unused_parameters, on which were used
   anywhere): see :mod:`tandem.parallel.ddp.end_of_backward` (on the CPU the check rides in the last
   bucket and costs no collective unless some rank has something to say). With
   find_unused_parameters no gradient counts as missed: a parameter behind an output the loss
   left out is unused, as in torch (whose ``_DDPSink`` gives such outputs an undefined
   gradient). A parameter is used only where its gradient was defined, and one used on no rank
   keeps its ``.grad`` as it is (None stays None). Recovery in memory's commit vote rides here
   too (:class:`tandem.parallel.ddp.end_of_backward.Vote`): told as the backward starts, right
   before the last bucket is reduced, and once every collective of the backward completed on
   this rank.

The means reach ``.grad`` without a copy where it counts: a large gradient (see
``LARGE_GRADIENT``) becomes a view of its bucket's buffer. At the next forward the bucket takes
that buffer back if ``zero_grad`` dropped those gradients (the usual case), or else uses a
spare one: a gradient the user keeps is never written into. Small gradients are copied back,
in one call per bucket. Under a communication hook, and with gradient_as_bucket_view, the
buffers stay the bucket's.

Buckets follow torch's rules so that both engines sum the same numbers in the same groups: the
first backward runs with one bucket per dtype and device (the ready order is unknown), then the
buckets are rebuilt once in the order the gradients really became ready (rank 0's order,
broadcast). With find_unused_parameters the graph may change every step: the buckets are cut
from the start and never rebuilt. The learnt layout is part of the reducer's state, so that a
resumed run reduces in the same buckets as the uninterrupted one. The layout rules themselves
(caps, cuts, buffers) are pure: :mod:`tandem.parallel.ddp.buckets`.

``static_graph`` follows torch's meaning: the first backward counts how many times each
parameter's hook fires and reduces everything at its end; later backwards launch a parameter's
bucket after its last expected gradient.

Example::

    reducer.state_dict()             # {"rebuilt": True, "layout": [[5, 4], [3, 2, 1, 0]], ...}
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors
from torch.autograd import Variable
from torch.autograd.function import BackwardCFunction

from tandem import _tree
from tandem._dist import global_rank, group_size
from tandem._profile import span
from tandem.doctor import records
from tandem.parallel.ddp import out_of_step
from tandem.parallel.ddp.buckets import Bucket, bucket_caps, build_buckets, cut_buckets
from tandem.parallel.ddp.comm_hooks import CommHook, GradBucket, completed, orders_its_collectives
from tandem.parallel.ddp.end_of_backward import EndOfBackward

# A gradient of at least this many elements is copied into its bucket as soon as it is ready,
# the division fused (one pass, while the gradient is still in cache: the copy is memory-bound),
# and its mean is handed back as a view of the bucket, not copied; smaller ones are copied when
# their bucket is full and back when it is done, in one call per bucket (their cost is the
# call, not the memory).
LARGE_GRADIENT = 16384

# Whether a buffer's storage is still shared by a tensor other than the bucket's own (torch's
# count of the tensors that share a storage; without it, buffers are never handed over).
CAN_HAND_OVER = hasattr(torch._C, "_storage_Use_Count")


log = logging.getLogger("tandem.parallel.ddp.reducer")


def _unreferenced(flat: torch.Tensor, views: list[torch.Tensor]) -> bool:
    # The storage is shared by flat, by each of its views, and by the storage object this
    # query makes: any more is somebody else's tensor (a gradient handed over, or one made
    # from it).
    return torch._C._storage_Use_Count(flat.untyped_storage()._cdata) == len(views) + 2


class Phase(enum.Enum):
    """What the parameter hooks do with a gradient."""

    IDLE = "idle"  # no DDP forward armed a backward: gradients are left alone
    ACCUMULATE = "accumulate"  # under no_sync: only note which parameters were used
    REDUCE = "reduce"  # fill buckets and launch them


class Reducer:
    """Averages the gradients of ``params`` across ``group`` during backward.

    Example::

        reducer = Reducer(list(model.parameters()), names, group=None)
        out = model(x)
        reducer.prepare(out)
        out.sum().backward()    # every .grad now holds the mean over ranks
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        first_bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        skip_all_reduce_unused_params: bool = False,
        batched_grad_copy: bool = False,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.world_size = group_size(group)
        self.caps = bucket_caps(bucket_cap_mb, first_bucket_cap_mb, bucket_cap_mb_list)
        self.find_unused = find_unused_parameters and not static_graph
        self.static_graph = static_graph
        self.as_view = gradient_as_bucket_view
        # torch's skip_all_reduce_unused_params: a bucket of parameters all unused in this
        # backward (the same ones on every rank: the user's promise) is not reduced, and its
        # parameters' .grad are left as they are.
        self.skip_unused = skip_all_reduce_unused_params
        self.skipped: list[bool] | None = None  # per bucket, in this backward
        self.buckets_reduced = 0  # in the last reducing backward (torch's num_buckets_reduced)
        # torch's batched_grad_copy: every gradient is copied in when its bucket is full, and
        # the bucket divided by the world size (torch divides there, where it otherwise
        # multiplies by the reciprocal: other bits at a world size that is no power of two).
        self.batched = batched_grad_copy
        self.hook: CommHook | None = None
        self.hook_state: Any = None
        # Training steps started, and a wait on every collective that names a rank that can
        # never join the current step (one that ran out of data), instead of a 30-minute hang.
        self.progress = out_of_step.track(group)
        # What the sum is divided by: the world size, or inside tandem.join with
        # divide_by_initial_world_size=False the ranks still training. Divided while copying in
        # (times the reciprocal): one pass over memory, and torch's exact bits.
        self.divisor = self.world_size

        # Before any backward the ready order is unknown. torch then uses one bucket (so that
        # no all-reduce can start on a guess), except with find_unused_parameters, whose
        # buckets are cut once from the reversed registration order and kept.
        self.eager = [p.numel() >= LARGE_GRADIENT and not self.batched for p in self.params]
        self.rebuilt = self.find_unused
        self.ready_order: list[int] = []
        everything = list(range(len(self.params)))
        if self.find_unused or bucket_cap_mb_list:
            # (torch cuts the first buckets by bucket_cap_mb_list too, whatever the mode)
            self._install(cut_buckets(self.params, everything, self.caps, reverse=True))
        else:
            self._install(cut_buckets(self.params, everything, self.caps, one_bucket=True))
        self._hooks = [
            p.register_post_accumulate_grad_hook(partial(self._on_grad, i))
            for i, p in enumerate(self.params)
        ]

        self.phase = Phase.IDLE
        self.backwards = 0  # backward passes that reduced: static_graph's first one is special
        self.marked = [False] * len(self.params)
        self.next_bucket = 0
        self.held = False  # a ready bucket waits for its predecessor's hook future
        self.serial = False  # buckets wait for the previous hook future (see set_hook)
        self.recording = False  # this backward's ready order is the one buckets are rebuilt in
        self.fill_scale: float | None = None  # what gradients are multiplied by, copied in
        self.futures: list[torch.futures.Future | dist.Work | None] = []
        self.finalize_queued = False
        self.unused: list[int] = []
        self.deferred: list[int] = []  # unreached, but maybe behind a custom autograd Function
        # Which parameters got a defined gradient since the last reducing backward (no_sync
        # iterations included, as torch's map): kept with find_unused_parameters only.
        self.used = [False] * len(self.params)
        # static_graph: hook firings per parameter in the first backward, and in this one.
        self.expected_fires: list[int] | None = None
        self.fires = [0] * len(self.params)
        self.static_used: list[bool] | None = None
        device = self.params[0].device if self.params else torch.device("cpu")
        self.end_of_backward = EndOfBackward(self.names, group, device, self.wait)
        self.on_cpu = device.type == "cpu"
        self.check_in_bucket = False  # this backward's check rides in the last bucket
        self.replaced: list[torch.Tensor] = []  # gradients a bucket's view replaced

    # -- per iteration --------------------------------------------------------------------

    def release(self) -> None:
        """Take this reducer's hooks off the parameters, for good (a new tandem.DDP over the
        same module takes over, as after a recovery re-formed the group)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.phase = Phase.IDLE

    def prepare(self, outputs: Any, sync: bool = True) -> None:
        """Called at the end of a forward that will be followed by backward."""
        self.phase = Phase.REDUCE if sync else Phase.ACCUMULATE
        if not sync:
            return
        self.marked = [False] * len(self.params)
        self.next_bucket = 0
        self.buckets_reduced = 0
        self.held = False
        self.futures = [None] * len(self.buckets)
        self.finalize_queued = False
        self.recording = self._recording()
        self.check_in_bucket = self._checks_in_bucket()
        # The division by the world size is folded into the copy, unless a hook does it.
        self.fill_scale = 1.0 / self.divisor if self.hook is None and self.world_size > 1 else None
        for bucket in self.buckets:
            if bucket.handed_over:
                self._reclaim(bucket)
            bucket.pending = len(bucket.params)
        if self.static_graph:
            self.fires = [0] * len(self.params)
        found = _tree.tensors(outputs)
        self.unused, self.deferred = [], []
        if self.find_unused:
            reached, opaque = _reachable_params(found)
            unreached = [i for i, p in enumerate(self.params) if id(p) not in reached]
            # A custom autograd Function may run a backward of its own through parameters that
            # its node does not show (reentrant checkpointing does): marked unused now, such a
            # parameter's gradient would come later and count twice. Behind such a node the
            # unreached are reduced at the end of backward instead, if no gradient came.
            if opaque:
                self.deferred = unreached
            else:
                self.unused = unreached
        # The end-of-backward callback must be queued on the backward that the user started.
        # A parameter hook may fire inside a nested backward (reentrant checkpointing runs one
        # per checkpointed block), and a callback queued there would run when that inner
        # backward ends, long before the other gradients exist. The outputs' gradients are
        # computed by the outer backward, before any parameter's.
        for t in found:
            if t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self.phase is Phase.REDUCE and not self.finalize_queued:
            self._begin_backward()

    def _begin_backward(self) -> None:
        self.finalize_queued = True
        Variable._execution_engine.queue_callback(self._finalize)
        vote = self.end_of_backward.vote
        if vote is not None:
            # Recovery's commit: this rank's state is taken and sent while the backward runs,
            # off its path; the last bucket then waits for it only if it is not done.
            vote.starting()
        # Parameters known to get no gradient are marked here, inside backward, rather than in
        # prepare(): launching their bucket must wait for backward to exist.
        if self.skip_unused:
            self.skipped = self._unused_buckets()
        if self.static_graph and self.expected_fires is not None:
            for i, n in enumerate(self.expected_fires):
                if n == 0:
                    self._mark(i)
        for i in self.unused:
            self._mark(i)

    def _unused_buckets(self) -> list[bool] | None:
        # The buckets whose parameters are all known unused at the start of this backward.
        if self.static_graph and self.expected_fires is not None:
            unused = {i for i, n in enumerate(self.expected_fires) if n == 0}
        else:
            unused = set(self.unused)
        if not unused:
            return None
        return [all(i in unused for i in b.params) for b in self.buckets]

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        phase = self.phase
        # The used map (read only with find_unused_parameters): the hook also fires for an
        # undefined gradient (torch._C._functions.UndefinedGrad), and such a parameter is not
        # used (torch's rule: its .grad is then left alone, None stays None).
        if phase is Phase.REDUCE:
            if self.find_unused and param.grad is not None:
                self.used[i] = True
            if not self.finalize_queued:
                self._begin_backward()
            if self.static_graph:
                self.fires[i] += 1
                if self.expected_fires is None:
                    return  # first backward: everything is reduced at its end
                if self.fires[i] != self.expected_fires[i]:
                    return  # more gradients to come for this parameter
            if self.recording:
                self.ready_order.append(i)  # real gradients only: the unused are not in order
            self._mark(i)
        elif phase is Phase.ACCUMULATE and self.find_unused and param.grad is not None:
            self.used[i] = True

    def _mark(self, i: int) -> None:
        if self.marked[i]:
            raise RuntimeError(
                f"tandem.DDP: parameter '{self.names[i]}' received a gradient twice in one "
                "backward (used in two reentrant-checkpointed blocks, or a second backward "
                "through the same graph); pass static_graph=True if the graph is the same every "
                "iteration, call backward once per forward, or use no_sync()"
            )
        self.marked[i] = True
        if self.eager[i]:
            self._copy_in(i)
        bucket = self.bucket_of[i]
        bucket.pending -= 1
        if bucket.pending == 0 or self.held:
            self._launch_ready()

    def _launch_ready(self) -> None:
        # Launch strictly in bucket order: collectives must match across ranks one for one.
        buckets, futures = self.buckets, self.futures
        while self.next_bucket < len(buckets) and buckets[self.next_bucket].pending == 0:
            k = self.next_bucket
            self.held = self.serial and k > 0 and not futures[k - 1].done()  # type: ignore[union-attr]
            if self.held:
                return  # retried at the next gradient, or in _finalize
            futures[k] = self._launch(buckets[k])
            self.next_bucket = k + 1
        if (
            self.next_bucket == len(buckets)
            and self.hook is None
            and self.world_size > 1
            and not self.check_in_bucket
            and not self.end_of_backward.launched
        ):
            # Every gradient is in (none missed), and no hook will issue more collectives.
            self.end_of_backward.launch(0, self.used if self.find_unused else None)

    def _copy_in(self, i: int) -> None:
        """Put parameter ``i``'s gradient, times ``fill_scale``, into its bucket slot."""
        view, grad, scale = self.views[i], self.params[i].grad, self.fill_scale
        if grad is None:
            view.zero_()  # an unused parameter adds zeros to the sum
        elif grad.data_ptr() == view.data_ptr():  # gradient_as_bucket_view: already there
            if scale is not None:
                view.mul_(scale)
        else:
            if scale is not None:
                torch.mul(grad, scale, out=view)
            else:
                view.copy_(grad)
            if self.as_view:
                self.params[i].grad = view

    def _fill(self, bucket: Bucket) -> None:
        """Copy in the bucket's gradients not copied in yet, times ``fill_scale``.

        Small gradients cost a call each rather than memory: one call copies them all, one
        more scales them (with gradient_as_bucket_view most are in place and only scaled).
        """
        params, as_view, scale = self.params, self.as_view, self.fill_scale
        if not as_view and not self.has_eager[bucket.index]:
            maybe = [params[i].grad for i in bucket.params]
            grads = [g for g in maybe if g is not None]
            if len(grads) == len(maybe):
                # The common case: one call copies, one kernel scales the whole buffer.
                torch._foreach_copy_(bucket.views, grads)
                if scale is not None:
                    self._scale_flat(bucket.flat, scale)
                return
        copy_views, copy_grads, scaled = [], [], []
        for i, view in zip(bucket.params, bucket.views, strict=True):
            if self.eager[i] and self.marked[i]:
                continue  # copied in when it became ready
            grad = params[i].grad
            if grad is None:
                view.zero_()
                continue
            scaled.append(view)
            if as_view and grad.data_ptr() == view.data_ptr():
                continue
            copy_views.append(view)
            copy_grads.append(grad)
            if as_view:
                params[i].grad = view
        if copy_grads:
            torch._foreach_copy_(copy_views, copy_grads)
        if scale is None:
            return
        if not self.has_eager[bucket.index]:
            self._scale_flat(bucket.flat, scale)  # every slot is this call's (zeros stay zeros)
        elif scaled:
            torch._foreach_mul_(scaled, scale)

    def _scale_flat(self, flat: torch.Tensor, scale: float) -> None:
        if self.batched:
            flat.div_(self.divisor)  # torch's batched_grad_copy divides
        else:
            flat.mul_(scale)

    def _launch(self, bucket: Bucket) -> torch.futures.Future | dist.Work:
        what = f"DDP bucket {bucket.index}, step {self.progress.step}"
        with span("tandem.ddp.bucket_reduce", what), records.tagged(what):
            return self._reduce(bucket)

    def _reduce(self, bucket: Bucket) -> torch.futures.Future | dist.Work:
        vote = self.end_of_backward.vote
        if vote is not None and bucket.index == len(self.buckets) - 1:
            # Recovery's commit: this rank's state goes where the others find it before the
            # collective whose completion commits the step (tandem.recovery).
            vote.entering()
        self._fill(bucket)
        if self.skipped is not None and self.skipped[bucket.index]:
            return completed(bucket.flat)  # skip_all_reduce_unused_params: no collective
        self.buckets_reduced += 1
        if self.hook is not None:
            is_last = bucket.index == len(self.buckets) - 1
            grads = GradBucket(
                bucket.index, bucket.flat, [self.params[i] for i in bucket.params],
                bucket.views, is_last,
            )  # fmt: skip
            return self.hook(self.hook_state, grads)
        if self.world_size == 1:
            return completed(bucket.flat)
        if self.check_in_bucket and bucket is self.buckets[-1]:
            self.end_of_backward.mark(bucket.flat, self.marked.count(False))
        # The default path keeps the Work, not work.get_future(): waiting on the future costs
        # measurably more CPU per bucket with Gloo (benchmarks/ddp_throughput.py).
        return dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def _finalize(self) -> None:
        self.phase = Phase.IDLE
        self.finalize_queued = False
        for i in self.deferred:
            if not self.marked[i]:
                self._mark(i)  # unused after all: launch its bucket, with zeros for it
        first_static = self.static_graph and self.expected_fires is None
        if first_static:
            self.expected_fires = list(self.fires)
            # Static graph: what fired once or more is used; the rest is simply unused.
            self.used = [n > 0 for n in self.fires]
        # Gradients this rank never got go out as zeros (see _fill), so that no rank waits on
        # a collective this rank would never issue; _check then tells every rank what happened.
        missing = [] if first_static else [i for i, m in enumerate(self.marked) if not m]
        if missing and self.find_unused:
            self._mark_left_out(missing)
            missing = []
        agree_used = self._used_map_travels()
        write_back_now = not missing and not agree_used and self.static_used is None
        for k, bucket in enumerate(self.buckets):
            fut = self.futures[k]
            if fut is None:
                if self.serial and k > 0:
                    prior = f"communication hook, bucket {k - 1}"
                    out_of_step.wait_future(self.futures[k - 1], self.progress, prior)
                fut = self.futures[k] = self._launch(bucket)
            with span("tandem.ddp.bucket_wait", f"bucket {k}"):
                if isinstance(fut, dist.Work):
                    self.wait(fut, f"gradient all-reduce, bucket {k}")  # reduced in place
                    result = bucket.flat
                else:
                    result = out_of_step.wait_future(
                        fut, self.progress, f"communication hook, bucket {k}"
                    )
                if isinstance(result, list):  # a hook returned work.get_future() as is
                    result = result[0]
                if result is not bucket.flat:
                    bucket.flat.copy_(result)
                if self.check_in_bucket and k == len(self.buckets) - 1:
                    self.end_of_backward.settle(bucket.flat, missing)  # raises if any rank missed
            # Write each bucket's means back as soon as that bucket is done: the copies then
            # run while the later buckets are still on the wire.
            if write_back_now:
                self._write_back_bucket(bucket)
        self.next_bucket = len(self.buckets)
        # Drop the finished work handles: held past the last step, they keep the process
        # group's threads busy with their tensors while the interpreter shuts down.
        self.futures = []
        self.backwards += 1
        used = None
        if not self.check_in_bucket:
            if not self.end_of_backward.launched:
                self.end_of_backward.launch(len(missing), self.used if agree_used else None)
            used = self.end_of_backward.read(missing, agree_used)
        if first_static:
            self.static_used = used
        elif self.static_used is not None:
            used = self.static_used
        if self.find_unused or first_static:
            self.used = [False] * len(self.params)
        skipped, self.skipped = self.skipped, None
        if skipped is not None:
            # Skipped buckets are not finalized: their .grad stay as they are (torch).
            kept = [i for b in self.buckets if not skipped[b.index] for i in b.params]
            self._write_back(kept, used)
        elif not write_back_now:
            self._write_back(range(len(self.params)), used)
        vote = self.end_of_backward.vote
        if vote is not None and self.progress.sliced:
            # Every collective of this backward completed here, so every rank entered its last
            # one: the vote passed on this rank. On NCCL the waits above do not block the host,
            # which knows nothing yet: the commit votes in a collective of its own there.
            vote.passed()

    def _mark_left_out(self, indices: list[int]) -> None:
        """find_unused_parameters: parameters the outputs reach but the loss did not.

        torch passes the outputs through an autograd Function (``_DDPSink``) that gives the
        outputs the loss left out an undefined gradient, so that backward still visits their
        parameters and each is marked ready, used only if its ``.grad`` is defined. The same,
        without a Function: those parameters are marked here, at the end of backward (their
        gradients, and so their buckets, are the same).
        """
        for i in indices:
            if self.params[i].grad is not None:
                self.used[i] = True
            self._mark(i)

    def _used_map_travels(self) -> bool:
        # In this backward the ranks agree on which parameters were used anywhere:
        # find_unused_parameters, or static_graph's first backward (trained or shadowed).
        return self.find_unused or (self.static_graph and self.backwards == 0)

    def _checks_in_bucket(self) -> bool:
        # See tandem.parallel.ddp.end_of_backward: on the CPU, unless the used map must travel.
        return (
            self.on_cpu
            and self.world_size > 1
            and self.hook is None
            and not self.skip_unused
            and not self._used_map_travels()
            and bool(self.buckets)
            and self.buckets[-1].flat.numel() > 0
        )

    def set_hook(self, hook: CommHook, state: Any) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` (see ``comm_hooks``).

        A hook may issue more collectives from its future's callbacks (PowerSGD does), on
        another thread and at times that differ between ranks; so bucket k+1 is launched only
        once bucket k's future is done, and every rank issues the same collectives in the same
        order. The hooks that order their own collectives (``orders_its_collectives``: those that
        issue one collective before returning, and the hybrid hook) are not held back.
        """
        self.hook, self.hook_state = hook, state
        self.serial = not orders_its_collectives(hook)

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for one of this model's collectives (see ``lockstep``)."""
        out_of_step.wait(work, self.progress, what)

    def shadow_backward(self) -> None:
        """On a rank that ran out of inputs (join): this backward's collectives, with zeros.

        The same collectives in the same order as a training rank's backward: one per bucket
        (through the communication hook, if any, each after the previous hook's future is
        done) and the end-of-backward check. Fresh zero buffers: with gradient_as_bucket_view
        the real buckets are this rank's ``.grad``, which must be left alone.
        """
        agree_used = self._used_map_travels()
        in_bucket = self._checks_in_bucket()
        futures: list[Any] = []
        for bucket in self.buckets:
            zeros = torch.zeros_like(bucket.flat)
            if self.hook is None:
                if in_bucket and bucket is self.buckets[-1]:
                    self.end_of_backward.mark(zeros, 0)
                futures.append(dist.all_reduce(zeros, group=self.group, async_op=True))
                continue
            if futures and self.serial:
                futures[-1].wait()
            pieces = zeros.split([v.numel() for v in bucket.views])
            views = [z.view_as(v) for z, v in zip(pieces, bucket.views, strict=True)]
            params = [self.params[i] for i in bucket.params]
            is_last = bucket.index == len(self.buckets) - 1
            futures.append(
                self.hook(self.hook_state, GradBucket(bucket.index, zeros, params, views, is_last))
            )
        for fut in futures:
            fut.wait()
        if in_bucket:
            self.end_of_backward.settle(zeros, [])
        if self._recording():
            # The training ranks rebuild their buckets at their next forward; so must this one,
            # to answer that broadcast (rank 0's order wins; this one's is a placeholder).
            self.ready_order = list(reversed(range(len(self.params))))
        self.backwards += 1
        self.used = [False] * len(self.params)
        if not in_bucket:
            self.end_of_backward.launch(0, self.used if agree_used else None)
            self.end_of_backward.read([], agree_used)

    def start_step(self) -> None:
        """At a training forward: free the gradients the means replaced, and raise the
        missing-gradient error deferred from the previous backward (GPU only).

        The replaced gradients are freed here, not at once: where ``zero_grad`` drops
        gradients, before the forward. Freed at the end of backward, the CPU's allocator gave
        their pages back to the system and the next backward took every page again (five
        times the page faults of torch's DDP in a backward with 400 gradients of 256 KiB).
        """
        self.replaced.clear()
        self.end_of_backward.check_previous_step()

    # -- buckets: installed, handed over as .grad, rebuilt once, saved --------------------

    def _install(self, layout: list[list[int]]) -> None:
        self.buckets: list[Bucket] = build_buckets(layout, self.params)
        self.has_eager = [any(self.eager[i] for i in b.params) for b in self.buckets]
        self.bucket_of = [self.buckets[0]] * len(self.params) if self.buckets else []
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.params):
                self.bucket_of[i] = bucket
                self.views[i] = bucket.views[slot]
        if self.as_view:
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    self.views[i].copy_(p.grad)
                    p.grad = self.views[i]

    def _reclaim(self, bucket: Bucket) -> None:
        """Before a backward, for a bucket whose buffer the parameters took as their gradients:
        keep it if no gradient of it is held any more (``zero_grad`` set them to None), else
        take the bucket's spare buffer if that one is free, else a new one; the buffer still
        held becomes the spare. A gradient a user keeps is never written into."""
        bucket.handed_over = False
        if _unreferenced(bucket.flat, bucket.views):
            return
        spare = bucket.spare
        bucket.spare = (bucket.flat, bucket.views)
        if spare is not None and _unreferenced(*spare):
            bucket.flat, bucket.views = spare
        else:
            bucket.flat = torch.empty_like(bucket.flat)  # every slot is written before the sum
            params = [self.params[i] for i in bucket.params]
            bucket.views = list(_unflatten_dense_tensors(bucket.flat, params))  # one C++ call
        for i, view in zip(bucket.params, bucket.views, strict=True):
            self.views[i] = view

    def _write_back_bucket(self, bucket: Bucket) -> None:
        """``_write_back`` of one bucket's parameters, without a used map."""
        if not self.as_view and not self.has_eager[bucket.index]:
            # The common case for small gradients: one call, no loop over the parameters here.
            maybe = [self.params[i].grad for i in bucket.params]
            grads = [g for g in maybe if g is not None]
            if len(grads) == len(maybe):
                torch._foreach_copy_(grads, bucket.views)
                return
        self._write_back(bucket.params, None)

    def _write_back(self, indices: Sequence[int], used: list[bool] | None) -> None:
        """Give parameters ``indices`` their mean gradient (``used``: which were used on some
        rank; the others keep their ``.grad`` as it is, as under torch's DDP).

        A large gradient takes its slot of the bucket as it is (see the module doc); small ones
        are copied, in one call.
        """
        grads, means = [], []
        hand_over = CAN_HAND_OVER and self.hook is None and not self.as_view
        for i in indices:
            p, view = self.params[i], self.views[i]
            if used is not None:
                if not used[i]:
                    continue  # used on no rank: .grad left as it is (None stays None)
            elif p.grad is None:
                continue
            if p.grad is view:
                continue  # gradient_as_bucket_view: already there
            if self.as_view:
                p.grad = view
            elif hand_over and self.eager[i]:
                if p.grad is not None:
                    self.replaced.append(p.grad)  # freed at the next forward (see start_step)
                p.grad = view.view_as(view)  # a tensor of its own: see _reclaim
                self.bucket_of[i].handed_over = True
            elif p.grad is None:  # unused here but used on another rank: step with the mean
                p.grad = view.clone()
            else:
                grads.append(p.grad)
                means.append(view)
        if grads:
            torch._foreach_copy_(grads, means)  # one call, not one per parameter

    @property
    def layout(self) -> list[list[int]]:
        """Parameter indices per bucket, in launch order."""
        return [list(b.params) for b in self.buckets]

    def state_dict(self) -> dict[str, Any]:
        """The bucket order learnt so far: a resumed run then builds the same buckets.

        Example::

            state = ddp.reducer.state_dict()     # saved in a checkpoint
            fresh.reducer.load_state_dict(state)
        """
        return {"rebuilt": self.rebuilt, "layout": self.layout, "ready_order": self.ready_order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the buckets of a saved run (see ``state_dict``)."""
        layout = [list(b) for b in state["layout"]]
        if sorted(i for b in layout for i in b) != list(range(len(self.params))):
            raise ValueError(
                f"the saved bucket layout covers {sum(len(b) for b in layout)} parameters, this "
                f"model has {len(self.params)}: load the state of the same model"
            )
        self.rebuilt = bool(state["rebuilt"])
        self.ready_order = list(state["ready_order"])
        if layout != self.layout:
            self._install(layout)

    def rebuild(self) -> bool:
        """Once, before a forward: re-bucket in the order gradients became ready.

        Rank 0's observed order is broadcast, because every rank must build identical buckets
        and hook timing can differ between ranks.
        """
        if self.rebuilt or len(self.ready_order) == 0:
            return False
        self.rebuilt = True
        seen = set(self.ready_order)
        # Parameters that got no gradient (static_graph's unused) go last in index order, where
        # torch appends them: the same buckets, so the same sums in Gloo's ring, bit for bit.
        order = self.ready_order + [i for i in range(len(self.params)) if i not in seen]
        if self.world_size > 1:
            t = torch.tensor(order, dtype=torch.int64, device=self.params[0].device)
            with records.tagged(f"DDP bucket rebuild, step {self.progress.step}"):
                work = dist.broadcast(
                    t, src=global_rank(self.group, 0), group=self.group, async_op=True
                )
            self.wait(work, "bucket rebuild broadcast")
            order = t.tolist()
        layout = cut_buckets(self.params, order, self.caps)
        if layout == self.layout:
            log.debug("bucket rebuild: the learnt order gives the same %d bucket(s)", len(layout))
            return False
        self._install(layout)
        log.debug(
            "buckets rebuilt in the order gradients became ready: %d bucket(s) of %s parameters",
            len(layout), [len(b) for b in layout],
        )  # fmt: skip
        return True

    def _recording(self) -> bool:
        # torch learns the order from the first backward that reduces bucket by bucket: the
        # first one, or with static_graph the second (the first reduces everything at its end).
        if self.rebuilt:
            return False
        return not self.static_graph or self.backwards == 1


def _reachable_params(outputs: list[torch.Tensor]) -> tuple[set[int], bool]:
    """ids of the parameters whose gradient accumulators the graph of ``outputs`` reaches,
    and whether the graph holds a custom autograd Function (which may hide more)."""
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: set[Any] = set()
    reached: set[int] = set()
    opaque = False
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        opaque = opaque or isinstance(fn, BackwardCFunction)
        stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
    return reached, opaque
