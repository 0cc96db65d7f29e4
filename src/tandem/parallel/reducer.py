"""The gradient reducer behind tandem.DDP: hooks, bucket launches, and the end of backward.

One iteration, as the reducer sees it:

1. ``prepare()`` (end of forward): reset the per-iteration state; with find_unused_parameters,
   walk the autograd graph from the outputs and note the parameters it cannot reach.
2. Per parameter, a post-accumulate-grad hook fires once its ``.grad`` is final for this
   backward: the gradient is copied into its bucket slot (or already lives there, with
   gradient_as_bucket_view) and the bucket's pending count drops.
3. A bucket whose count reaches zero is launched, but only after every bucket before it: all
   ranks must issue the same collectives in the same order, whatever order their hooks fire in.
4. ``_finalize()`` (queued on the autograd engine, runs once backward is done): wait for every
   bucket, write the means back into ``.grad``, settle unused parameters, and raise on every rank
   if any rank was missing gradients.

After the first iteration the buckets are rebuilt once, in the order the gradients really became
ready (rank 0's order, broadcast, so that every rank agrees).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from tandem.parallel.buckets import MIB, Bucket, assign_buckets, build_buckets
from tandem.parallel.comm_hooks import CommHook, GradBucket, completed, group_size

# The first bucket is small so that the first all-reduce starts early in backward.
FIRST_BUCKET_MB = 1.0


class UnusedParametersError(RuntimeError):
    """Some rank finished backward without a gradient for some parameters."""


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
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = FIRST_BUCKET_MB,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.world_size = group_size(group)
        for name, mb in (
            ("bucket_cap_mb", bucket_cap_mb),
            ("first_bucket_cap_mb", first_bucket_cap_mb),
        ):
            if not mb > 0:
                raise ValueError(f"{name}={mb} must be a positive number of MiB")
        # At least one byte: a tiny cap means one parameter per bucket, not an invalid cap.
        self.cap_bytes = max(1, int(bucket_cap_mb * MIB))
        self.first_cap_bytes = max(1, int(first_bucket_cap_mb * MIB))
        self.find_unused = find_unused_parameters
        self.as_view = gradient_as_bucket_view
        self.hook: CommHook | None = None
        self.hook_state: Any = None

        # With find_unused_parameters the graph may change every step, so the first step's
        # order says little about the next: keep the initial layout (as torch does).
        self.rebuilt = find_unused_parameters
        self.ready_order: list[int] = []
        self._install(self._initial_layout())
        self._handles = [
            p.register_post_accumulate_grad_hook(partial(self._on_grad, i))
            for i, p in enumerate(self.params)
        ]

        # Per-iteration state. "sync": hooks reduce; "accumulate": under no_sync, hooks only
        # note which parameters were used; None: backward not started by a DDP forward.
        self.mode: str | None = None
        self.marked = [False] * len(self.params)
        self.num_marked = 0
        self.next_bucket = 0
        self.futures: list[torch.futures.Future | dist.Work | None] = []
        self.finalize_queued = False
        self.unused: list[int] = []
        self.used = [False] * len(self.params)  # survives no_sync iterations, as torch's map
        self._flag_host: torch.Tensor | None = None
        self._flag_event: Any = None
        self._missing: list[int] = []

    # -- layout ---------------------------------------------------------------------------

    def _initial_layout(self) -> list[list[int]]:
        # Before any backward the ready order is unknown: assume layers run in registration
        # order, so gradients arrive in reverse. Buckets are cut in registration order and then
        # reversed, which leaves the small bucket for the first layers, whose gradients come
        # last: the all-reduce still to do once backward has finished is then a short one.
        # (This is torch's layout too, which keeps the two bit-for-bit comparable.)
        return list(reversed(self._layout(list(range(len(self.params))))))

    def _layout(self, order: list[int]) -> list[list[int]]:
        sizes = [p.numel() * p.element_size() for p in self.params]
        keys = [(p.dtype, p.device) for p in self.params]
        return assign_buckets(sizes, keys, order, self.cap_bytes, self.first_cap_bytes)

    def _install(self, layout: list[list[int]]) -> None:
        # One spare element in the last bucket carries the missing-gradient flag (see _finalize).
        self.buckets: list[Bucket] = build_buckets(layout, self.params, extra_last=1)
        where = {
            i: (bucket.index, slot)
            for bucket in self.buckets
            for slot, i in enumerate(bucket.params)
        }
        self.where = [where[i] for i in range(len(self.params))]
        self.views = [self.buckets[b].views[slot] for b, slot in self.where]
        if self.as_view:
            for bucket in self.buckets:
                for slot, i in enumerate(bucket.params):
                    grad = self.params[i].grad
                    if grad is not None:
                        bucket.views[slot].copy_(grad)
                        self.params[i].grad = bucket.views[slot]

    @property
    def layout(self) -> list[list[int]]:
        """Parameter indices per bucket, in launch order."""
        return [list(b.params) for b in self.buckets]

    def rebuild(self) -> bool:
        """Once, before the second forward: re-bucket in the order gradients became ready.

        Rank 0's observed order is broadcast, because every rank must build identical buckets
        and hook timing can differ between ranks. The first bucket is now the small one, so
        that communication starts as soon as the first gradients exist.
        """
        if self.rebuilt or not self.ready_order:
            return False
        self.rebuilt = True
        seen = set(self.ready_order)
        order = self.ready_order + [i for i in reversed(range(len(self.params))) if i not in seen]
        if self.world_size > 1:
            device = self.params[0].device
            t = torch.tensor(order, dtype=torch.int64, device=device)
            dist.broadcast(t, src=dist.get_global_rank(_group(self.group), 0), group=self.group)
            order = t.tolist()
        layout = self._layout(order)
        if layout == self.layout:
            return False
        self._install(layout)
        return True

    # -- per iteration --------------------------------------------------------------------

    def prepare(self, outputs: Any, sync: bool = True) -> None:
        """Called at the end of a forward that will be followed by backward."""
        self.mode = "sync" if sync else "accumulate"
        self.marked = [False] * len(self.params)
        self.num_marked = 0
        self.next_bucket = 0
        self.futures = [None] * len(self.buckets)
        self.finalize_queued = False
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self.unused = []
        if sync and self.find_unused:
            reached = _reachable_params(outputs)
            self.unused = [i for i, p in enumerate(self.params) if id(p) not in reached]

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        if self.mode is None:
            return
        self.used[i] = True
        if self.mode == "accumulate":
            return
        if not self.finalize_queued:
            self.finalize_queued = True
            Variable._execution_engine.queue_callback(self._finalize)
            # Unused parameters are marked ready here, inside backward, rather than in
            # prepare(): launching their bucket must wait for backward to exist.
            for j in self.unused:
                self._mark_ready(j)
        self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        if self.marked[i]:
            raise RuntimeError(
                f"tandem.DDP: parameter '{self.names[i]}' received a gradient twice in one "
                "backward (a second backward through the same graph, or reentrant "
                "checkpointing); call backward once per forward, or use no_sync()"
            )
        self.marked[i] = True
        self.num_marked += 1
        if not self.rebuilt:
            self.ready_order.append(i)
        b, slot = self.where[i]
        bucket = self.buckets[b]
        view = bucket.views[slot]
        grad = self.params[i].grad
        if grad is None:
            view.zero_()  # an unused parameter contributes zeros to the mean
        elif self.as_view:
            if grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                self.params[i].grad = view
        elif self.hook is None and self.world_size > 1:
            # Fold the division into the copy: one pass over memory, and torch's exact bits.
            torch.mul(grad, 1.0 / self.world_size, out=view)
        else:
            view.copy_(grad)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Launch strictly in bucket order: collectives must match across ranks one for one.
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self.futures[self.next_bucket] = self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: Bucket) -> torch.futures.Future | dist.Work:
        is_last = bucket.index == len(self.buckets) - 1
        if is_last:
            bucket.flat[-1:].fill_(len(self.params) - self.num_marked)
        if self.hook is not None:
            grads = GradBucket(
                bucket.index,
                bucket.buffer,
                [self.params[i] for i in bucket.params],
                bucket.views,
                is_last,
            )
            fut = self.hook(self.hook_state, grads)
            if is_last and self.world_size > 1:
                # A user hook may transform the buffer; the flag travels on its own.
                flag = dist.all_reduce(bucket.flat[-1:], group=self.group, async_op=True)
                return torch.futures.collect_all([fut, flag.get_future()]).then(
                    lambda f: f.value()[0].value()
                )
            return fut
        if self.world_size == 1:
            return completed(bucket.flat)
        if self.as_view:
            bucket.buffer.mul_(1.0 / self.world_size)
        # The default path keeps the Work, not work.get_future(): waiting on the future costs
        # measurably more CPU per bucket with Gloo (benchmarks/ddp_throughput.py).
        return dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def _finalize(self) -> None:
        self.mode = None
        self.finalize_queued = False
        missing: list[int] = []
        if self.num_marked < len(self.params):
            missing = [i for i, m in enumerate(self.marked) if not m]
            # Launch what is left, with zeros for the missing gradients, so that no rank waits
            # on a collective this rank would never issue; the flag in the last bucket (the
            # count of missing gradients, summed over ranks) tells every rank what happened.
            for i in missing:
                b, slot = self.where[i]
                self.buckets[b].views[slot].zero_()
                self.buckets[b].pending = 0
            self._launch_ready_buckets()
        # Write each bucket's means back as soon as that bucket is done: the copies then run
        # while the later buckets are still on the wire.
        write_back_now = not missing and not self.find_unused
        for bucket, fut in zip(self.buckets, self.futures, strict=True):
            assert fut is not None
            if isinstance(fut, dist.Work):
                fut.wait()  # reduced in place
                result = bucket.flat
            else:
                result = fut.wait()
                if isinstance(result, list):  # a hook returned work.get_future() as is
                    result = result[0]
            if result.data_ptr() != bucket.flat.data_ptr():
                bucket.buffer.copy_(result[: bucket.numel])
            if write_back_now:
                self._write_back(bucket.params, None)
        # Drop the finished work handles: held past the last step, they keep the process
        # group's threads busy with their tensors while the interpreter shuts down.
        self.futures = []
        self._check_flag(missing)
        if write_back_now:
            self.used = [False] * len(self.params)
            return

        used = self.used
        if self.find_unused and self.world_size > 1:
            t = torch.tensor(used, dtype=torch.int32, device=self.params[0].device)
            dist.all_reduce(t, group=self.group)
            used = [bool(u) for u in t.tolist()]
        self.used = [False] * len(self.params)
        self._write_back(range(len(self.params)), used)

    def _write_back(self, indices: Sequence[int], used: list[bool] | None) -> None:
        """Give parameters ``indices`` their mean gradient (``used``: who had one anywhere)."""
        grads, means = [], []
        for i in indices:
            p, view = self.params[i], self.views[i]
            if p.grad is None:
                if used is not None and used[i]:
                    # Unused here but used on another rank: this rank steps with the mean too.
                    p.grad = view if self.as_view else view.clone()
            elif p.grad is not view:
                grads.append(p.grad)
                means.append(view)
        if grads:
            torch._foreach_copy_(grads, means)  # one call, not one per parameter

    def _check_flag(self, missing: list[int]) -> None:
        """Raise on every rank if any rank missed gradients (the flag is their summed count).

        On the CPU the flag is read at once and the error comes out of backward. On a GPU,
        reading it here would make the CPU wait for the GPU every step; it is copied to host
        memory in the background instead and read at the next forward.
        """
        flag = self.buckets[-1].flat[-1:]
        if flag.device.type == "cpu":
            if flag.item() != 0:
                self._raise_missing(missing)
            return
        if self._flag_host is None:
            self._flag_host = torch.zeros(1, dtype=flag.dtype, pin_memory=True)
        self._flag_host.copy_(flag, non_blocking=True)
        self._flag_event = torch.cuda.Event()
        self._flag_event.record()
        self._missing = missing

    def check_previous_step(self) -> None:
        """Raise the missing-gradient error deferred from the previous backward (GPU only)."""
        if self._flag_event is None:
            return
        self._flag_event.synchronize()
        self._flag_event = None
        if self._flag_host is not None and self._flag_host.item() != 0:
            self._raise_missing(self._missing)

    def _raise_missing(self, missing: list[int]) -> None:
        names = [self.names[i] for i in missing]
        per_rank: list[Any] = [names]
        if self.world_size > 1:
            per_rank = [None] * self.world_size
            dist.all_gather_object(per_rank, names, group=self.group)
        lines = [f"rank {r}: {', '.join(n)}" for r, n in enumerate(per_rank) if n]
        raise UnusedParametersError(
            "tandem.DDP: these parameters received no gradient in this backward, so their "
            "gradients could not be averaged:\n  " + "\n  ".join(lines) + "\n"
            "If some parameters are legitimately unused in some steps, pass "
            "find_unused_parameters=True to tandem.DDP; otherwise make sure the loss depends "
            "on every parameter (e.g. every output of forward is used in the loss)."
        )

    def remove_hooks(self) -> None:
        """Detach from the parameters (the wrapper is being discarded)."""
        for handle in self._handles:
            handle.remove()


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def _reachable_params(outputs: Any) -> set[torch.Tensor]:
    """ids of the parameters whose gradient accumulators the graph of ``outputs`` reaches."""
    stack = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    seen: set[Any] = set()
    reached: set[int] = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
    return reached


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    if hasattr(obj, "__dataclass_fields__"):
        return _tensors(list(vars(obj).values()))
    return []
