"""FSDP's hook machinery: what runs around every unit's forward and backward.

:class:`Hooks` is the part of :class:`~tandem.parallel.fsdp.wrapper.FullyShardedDataParallel` that
autograd and the module hooks call into; the wrapper builds it and keeps the public API. Per
unit, in the order the units run:

1. Pre-forward (a module pre-hook; the wrapper's forward for the root): cast the floating
   inputs (mixed precision), all-gather the unit's parameters, start the all-gather of the unit
   that ran next in the last forward (prefetch), point the module's attributes at a fresh
   autograd leaf over the gathered buffer.
2. Post-forward: in stage 3 free the parameters (not the last unit's, whose backward comes
   first; with ``reshard_after_forward=<int>`` keeping this rank's slice in the post-forward
   group when a backward follows), hook the outputs; the wrapper's outputs are cast to
   ``output_dtype`` last.
3. Pre-backward (the first gradient reaching an output): gather again, prefetch the unit whose
   backward follows, and queue the end-of-backward callback once per backward.
4. The leaf's post-accumulate hook (the unit's flat gradient is complete): start its
   reduce-scatter (or keep it, under ``no_sync``), free the parameters in stage 3.
5. End of backward: wait for the reduce-scatters, oldest first (hybrid: and for the
   all-reduce of each slice across the replicas, started as its reduce-scatter is found
   done), and add their mean slices to the shards' ``.grad``; free whatever is still gathered
   (stage 3).

Example::

    hooks = Hooks(layout, root_unit, policy)
    hooks.register(module, unit)            # every unit but the root's
    out = hooks.forward(module, args, kwargs)
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

from tandem._profile import OFF, backward_span, recording, span
from tandem.doctor import records, step_clock
from tandem.parallel.fsdp.flat import FlatUnit, Reduction
from tandem.parallel.fsdp.layout import FsdpLayout
from tandem.parallel.fsdp.precision import MixedPrecisionPolicy

log = logging.getLogger("tandem.fsdp")

# Reduce-scatters left running at once: each holds a unit's whole flat gradient, so an
# unbounded number would keep every gradient alive until backward ends, as DDP does.
REDUCES_IN_FLIGHT = 2


class _Use:
    """One forward of a unit in grad mode, tracked until its backward is done.

    ``before`` is the unit that ran just before it in that forward (None for the first; for
    the root, which runs around all others, the last): the one its backward is followed by,
    and so the one to prefetch when its backward starts.
    """

    __slots__ = ("before", "in_backward")

    def __init__(self, before: FlatUnit | None) -> None:
        self.before = before
        self.in_backward = False


class Hooks:
    """The per-unit forward and backward hooks of one FSDP model (see the module docstring).

    Args:
        layout: the model's units, stage and names.
        root: the root module's own unit (None when it has no parameters of its own).
        policy: the mixed precision policy (None: none).
    """

    def __init__(
        self, layout: FsdpLayout, root: FlatUnit | None, policy: MixedPrecisionPolicy | None
    ) -> None:
        self.layout = layout
        self.stage = layout.stage
        self.root = root
        self.policy = policy
        # False inside the wrapper's no_sync(): flat gradients are kept, not reduce-scattered.
        self.sync = True
        self.uses: dict[int, list[_Use]] = {u.index: [] for u in layout.units}
        # Reduce-scatters started and not yet added to their shard's .grad, oldest first.
        self.pending: list[tuple[FlatUnit, Reduction]] = []
        self.callback_queued = False
        # The nested units in the order the last forward ran them (whose next one to prefetch),
        # and those of the forward in progress.
        self.order: list[FlatUnit] = []
        self.running: list[FlatUnit] = []
        # The profiler ranges of the unit forwards in progress (innermost last).
        self.ranges: list[AbstractContextManager] = []

    def register(self, module: nn.Module, unit: FlatUnit) -> None:
        """Hook ``module``'s forward as ``unit``'s (every unit but the root's: the wrapper's
        forward runs the root's steps itself)."""

        def pre(_m: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
            self.pre_forward(unit)
            if self.policy is not None:
                return self.policy.cast_inputs(args, kwargs)
            return None

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(lambda _m, _a, out: self.post_forward(unit, out))

    # -- forward -------------------------------------------------------------------------------

    def forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run ``module`` (the root) with its unit's steps around it; the cast outputs."""
        self.running = []
        if self.policy is not None:
            args, kwargs = self.policy.cast_inputs(args, kwargs)
        try:
            if self.root is not None:
                self.pre_forward(self.root)
            elif self.order:
                self.prefetch(self.order[0], "the forward")
            out = module(*args, **kwargs)
        except BaseException:
            self.close_ranges()  # the failed units' post-forward hooks never ran
            raise
        self.order = self.running
        if self.root is not None:
            # The root's parameters are needed first in backward: keep them when one follows.
            keep = torch.is_grad_enabled() or self.stage == 2
            self.post_forward(self.root, out, free=not keep)
        else:
            self.hook_outputs(None, out)
        if self.policy is not None:
            # After the backward hooks went on: the cast is differentiable, and its gradient
            # reaches them in the units' dtype (torch FSDP2's order).
            out = self.policy.cast_output(out)
        backward_span("tandem.fsdp.backward", out)
        return out

    def pre_forward(self, unit: FlatUnit) -> None:
        # The range spans the unit's forward, closed by post_forward: hooks cannot hold a
        # `with` block open.
        span = self.span("forward", unit)
        span.__enter__()
        self.ranges.append(span)
        position = len(self.running)
        if unit is not self.root:
            self.running.append(unit)
        self.gather(unit)
        # Prefetch: the unit that ran next in the last forward starts gathering now, while this
        # one computes. Every rank runs the same units in the same order (required anyway), so
        # the collectives still match; a unit that does not come after all is gathered for
        # nothing and freed at the end of backward.
        after = position if unit is self.root else position + 1
        following = self.order[after] if after < len(self.order) else None
        if following is not None and following is not unit:
            self.prefetch(following, "the forward")
        leaf = unit.attach(requires_grad=torch.is_grad_enabled())
        if leaf is not None:
            nested = unit is not self.root and len(self.running) > 1
            use = _Use(self.running[-2] if nested else None)
            self.uses[unit.index].append(use)
            leaf.register_post_accumulate_grad_hook(lambda t, u=unit, s=use: self.reduce(u, s, t))

    def post_forward(self, unit: FlatUnit, out: Any, free: bool = True) -> Any:
        # The last unit of a forward is the first of its backward: keeping it saves freeing and
        # gathering it again back to back.
        last = torch.is_grad_enabled() and self.order[-1:] == [unit]
        if self.stage == 3 and free and not last:
            # In grad mode a backward follows: with reshard_after_forward=<int> the unit keeps
            # this rank's slice for it, to gather within its post-forward group (else frees all).
            self.free(unit, "after its forward", keep=torch.is_grad_enabled())
        elif self.stage == 3:
            self.debug("kept after its forward: its backward comes first", unit)
        # Outputs need grad only when this forward made a use (grad mode): hooks go on those.
        self.hook_outputs(unit if self.uses[unit.index] else None, out)
        if self.ranges:
            self.ranges.pop().__exit__(None, None, None)
        return out

    def close_ranges(self) -> None:
        while self.ranges:
            self.ranges.pop().__exit__(None, None, None)

    def hook_outputs(self, unit: FlatUnit | None, out: Any) -> None:
        use = self.uses[unit.index][-1] if unit is not None else None
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, u=unit, s=use: self.pre_backward(u, s))

    # -- backward ------------------------------------------------------------------------------

    def pre_backward(self, unit: FlatUnit | None, use: _Use | None) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self.finish_backward)
        if unit is None or use is None:
            return
        first = not use.in_backward
        use.in_backward = True
        # Usually gathered already by an earlier output's hook or a prefetch; again after a
        # retain_graph backward freed it.
        self.gather(unit)
        before = use.before
        if unit is self.root and self.order:
            before = self.order[-1]
        if first and before is not None and before is not unit:
            self.prefetch(before, "its backward, which comes next")

    def reduce(self, unit: FlatUnit, use: _Use, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        assert grad is not None  # this hook runs after the gradient was accumulated
        if self.sync:
            grad = unit.with_unsynced(grad)
            tag = records.tagged(f"FSDP reduce-scatter unit {unit.index}")
            with self.span("reduce_scatter", unit), tag:
                self.pending.append((unit, unit.reduce_scatter(grad)))
            self.fold(REDUCES_IN_FLIGHT)
        else:
            unit.accumulate(grad)  # reduce-scattered with the next synced backward's
        uses = self.uses[unit.index]
        if use in uses:  # not on a second backward through a retained graph
            uses.remove(use)
        if self.stage != 3:
            return
        # Another forward's backward of this unit may still need the parameters.
        if any(u.in_backward for u in uses):
            self.debug("kept after its backward: another use's backward is running", unit)
        else:
            self.free(unit, "resharded after its backward")

    def fold(self, limit: int) -> None:
        """Add finished reduce-scatters, divided into means, to the shards' ``.grad``, oldest
        first, and drop their flat gradients; wait for the oldest while more than ``limit`` are
        running.

        Always in the order they were started, so that a unit reduced twice (called twice in a
        forward) sums its parts in the same order on every run.
        """
        while self.pending:
            unit, reduction = self.pending[0]
            work = reduction.work
            if len(self.pending) <= limit and work is not None and not work.is_completed():
                return
            if work is not None:
                phase = "all_reduce" if reduction.all_reducing else "reduce_scatter"
                with self.span(f"{phase}_wait", unit), step_clock.waiting:
                    records.wait(work)  # on Gloo, a mismatch the doctor finds raises here
                if reduction.across is None:
                    reduction.advance()
                else:  # hybrid: the slice's all-reduce across the replicas starts
                    tag = records.tagged(f"FSDP all-reduce unit {unit.index} across replicas")
                    with self.span("all_reduce", unit), tag:
                        reduction.advance()
                continue  # looked at again: done, or its all-reduce in flight
            self.pending.pop(0)
            shard = unit.shard
            mean = reduction.result(shard.dtype)
            if shard.grad is None:
                shard.grad = mean
            else:
                shard.grad.add_(mean)

    def finish_backward(self) -> None:
        self.callback_queued = False
        with self.span("finish_backward"):
            self.fold(0)
            for unit in self.layout.units:
                self.uses[unit.index].clear()
                if self.stage == 3:
                    self.free(unit, "end of backward")

    # -- gathering and freeing, with their traces -----------------------------------------------

    def gather(self, unit: FlatUnit) -> None:
        """Whole parameters in ``unit`` now: waits for its prefetch, or all-gathers."""
        tag = records.tagged(f"FSDP all-gather unit {unit.index}")
        # A wait: on a prefetch, or in a blocking all-gather (counted once).
        with self.span("all_gather", unit), tag, step_clock.waiting:
            unit.unshard()

    def gather_exact(self, unit: FlatUnit) -> torch.Tensor:
        """``unit``'s whole flat values at the shard's precision (``gathered()``)."""
        tag = records.tagged(f"FSDP all-gather unit {unit.index} (whole values)")
        with self.span("all_gather", unit), tag, step_clock.waiting:
            return unit.gather_exact()

    def prefetch(self, unit: FlatUnit, why: str) -> None:
        """Start ``unit``'s all-gather without waiting for it (unless it is current already)."""
        if unit.is_current:  # gathered, or its all-gather already in flight
            return
        self.debug("prefetched for %s", unit, why)
        tag = records.tagged(f"FSDP all-gather unit {unit.index} (prefetch)")
        with self.span("all_gather_start", unit), tag:
            unit.unshard(async_op=True)

    def free(self, unit: FlatUnit, why: str, keep: bool = False) -> None:
        if unit.is_gathered:
            self.debug("freed (%s)", unit, why)
        unit.free(keep=keep)

    def span(self, phase: str, unit: FlatUnit | None = None) -> AbstractContextManager:
        """The profiler range ``tandem.fsdp.<phase>`` (``unit`` named in its argument), or
        nothing while no profiler records: a range costs microseconds even then, a real share
        of a small unit's step."""
        if not recording():
            return OFF
        return span(f"tandem.fsdp.{phase}", None if unit is None else self.layout.label(unit))

    def debug(self, message: str, unit: FlatUnit, *args: Any) -> None:
        if log.isEnabledFor(logging.DEBUG):  # no label built for nothing
            rank = self.layout.rank
            log.debug("rank %d, unit %s: " + message, rank, self.layout.label(unit), *args)
