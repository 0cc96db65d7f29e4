"""FullyShardedDataParallel: parameters, gradients and optimizer state sharded flat (ZeRO 2, 3).

The model is cut into *units*: every submodule that ``auto_wrap`` picks, and the root for the
parameters left over. Each unit's trainable parameters become one flat buffer, sharded by the
rule in :mod:`tandem.parallel.sharding` (:class:`tandem.parallel.flat.FlatUnit`); the wrapper's
``parameters()`` are the shards, so a plain ``torch.optim`` optimizer over them keeps state for
this rank's slice only. One training step, stage 3:

1. Forward, per unit: all-gather the unit's parameters, run it, free them again (the root's
   stay until backward, which needs them first).
2. Backward, per unit: the first gradient reaching one of the unit's outputs all-gathers its
   parameters again; when the unit's flat gradient is complete it is reduce-scattered, started
   asynchronously, and the parameters are freed.
3. End of backward (a callback queued in step 2): wait for the reduce-scatters and divide
   the sums by N (:func:`tandem.parallel.flat.mean_divisors`: torch FSDP2's rule, the same
   bits); each shard's
   ``.grad`` is its slice of the mean gradient (added to, when gradients accumulate).
4. ``optimizer.step()`` updates the shards; the next forward gathers the new values.

Stage 2 is the same without the frees: every rank keeps the whole parameters between steps and
skips the all-gathers while its shard has not changed, so only gradients (reduce-scattered) and
optimizer state are sharded.

Collectives are issued in the order the units run, so every rank must run the same units in
the same order, forward and backward (as with torch's FSDP). Buffers are broadcast from rank 0
once, at construction; frozen parameters stay ordinary, replicated parameters.

What the model is made of (units, names, group) is one record, :class:`FsdpLayout`
(``model.layout``), which the checkpoints (:mod:`tandem.parallel.fsdp_state`) read. What it does
shows in torch's profiler as ranges ``tandem.fsdp.forward`` (one per unit forward, the unit
named in its argument), ``tandem.fsdp.all_gather`` (a gather waited for), ``.all_gather_start``
(a prefetch started), ``.reduce_scatter``, ``.reduce_scatter_wait`` and ``.finish_backward``;
its decisions (prefetch, free, keep) are logged at debug level on ``tandem.fsdp``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten

from tandem._dist import group_rank, group_size, require_process_group
from tandem._profile import OFF, recording
from tandem.doctor import records
from tandem.parallel import fsdp_state
from tandem.parallel.flat import FlatUnit
from tandem.parallel.fsdp_layout import FsdpLayout, PlainNames
from tandem.parallel.fsdp_units import AutoWrap, agree_on_units, plan_units
from tandem.parallel.replicas import broadcast_coalesced, verify_same_model

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


class FullyShardedDataParallel(nn.Module):
    """Sharded data parallelism: each rank holds 1/N of parameters, gradients and optimizer state.

    Build the optimizer after wrapping, over the wrapper's ``parameters()`` (the flat shards).
    Every rank must call the model's forward and backward the same way: the units' collectives
    are issued in the order they run.

    Args:
        module: the model; the same parameters and buffers on every rank (checked), then rank
            0's values everywhere.
        stage: 3 (default) frees each unit's parameters after its forward and its backward;
            2 keeps whole parameters on every rank and shards gradients and optimizer state.
        auto_wrap: the submodules that become units of their own: module classes
            (``{nn.TransformerEncoderLayer}``) or a predicate ``module -> bool``; None makes
            the whole model one unit (sharded at rest, gathered whole for each step). The same
            units on every rank (checked).
        process_group: the group to shard over (default: the whole world).
        device: where shards and gathered parameters live (default: the parameters' device).

    Example::

        tandem.init()
        model = tandem.FullyShardedDataParallel(Net(), auto_wrap={Block})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # state for this rank's shards
        loss_fn(model(x), y).backward()                        # .grad: this rank's slices
        opt.step()
        opt.zero_grad()
        full = model.full_state_dict()                         # rank 0: a plain state_dict
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int = 3,
        auto_wrap: AutoWrap | None = None,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        wrapper = "tandem.FullyShardedDataParallel"
        require_process_group(wrapper)
        if stage not in (2, 3):
            raise ValueError(
                f"stage={stage!r}: FullyShardedDataParallel implements stage 2 (gradients and "
                "optimizer state sharded) and stage 3 (parameters too); for stage 1 use "
                "tandem.DDP with tandem.ShardedOptimizer"
            )
        self.module = module
        # Parameters and buffers: the buffers are broadcast below as one flat buffer, whose
        # size must match on every rank.
        verify_same_model(module, process_group, wrapper=wrapper)
        names = PlainNames.of(module)  # before flattening takes the parameters away

        refused = None
        try:
            planned = plan_units(module, auto_wrap)
        except ValueError as error:
            planned, refused = None, error
        # Each unit broadcasts its own flat buffer: the same model cut into other units (another
        # auto_wrap on one rank) would hang there, so the ranks compare their units first.
        try:
            agree_on_units(planned, process_group, wrapper)
        except ValueError:
            if refused is None:
                raise
        if refused is not None:  # its own error on the rank that refused auto_wrap
            raise refused
        assert planned is not None  # a rank without a plan raised above
        units: list[FlatUnit] = []
        unit_of_module: dict[int, FlatUnit] = {}
        for _, m, params in planned:
            target = torch.device(device) if device is not None else params[0][2].device
            unit = FlatUnit(len(units), params, process_group, target)
            units.append(unit)
            unit_of_module[id(m)] = unit
        # What stays replicated (buffers, frozen parameters) moves whole and takes rank 0's
        # values; the trainable parameters were broadcast unit by unit above.
        if device is not None:
            module.to(device)
        broadcast_coalesced([*module.parameters(), *module.buffers()], process_group)
        self.layout = FsdpLayout(
            module=module,
            units=tuple(units),
            unit_names=tuple(name for name, _, _ in planned),
            stage=stage,
            process_group=process_group,
            rank=group_rank(process_group),
            world_size=group_size(process_group),
            state_keys=names.state_keys,
            param_fqns=names.param_fqns,
            key_fqn=names.key_fqn(units),
        )
        self.flat_params = nn.ParameterList([u.shard for u in units])
        self._root = unit_of_module.get(id(module))
        self._uses: dict[int, list[_Use]] = {u.index: [] for u in units}
        # Reduce-scatters started and not yet added to their shard's .grad: (unit, slice,
        # work, divisor after, the flat gradient the collective reads from).
        self._pending: list[tuple[FlatUnit, torch.Tensor, Any, float | None, torch.Tensor]] = []
        self._callback_queued = False
        # The nested units in the order the last forward ran them (whose next one to prefetch),
        # and those of the forward in progress.
        self._order: list[FlatUnit] = []
        self._running: list[FlatUnit] = []
        # The profiler ranges of the unit forwards in progress (innermost last).
        self._ranges: list[AbstractContextManager] = []
        for _, m, _ in planned:
            if m is not module:  # the root's unit is gathered by forward itself
                unit = unit_of_module[id(m)]
                m.register_forward_pre_hook(lambda _m, _a, u=unit: self._pre_forward(u))
                m.register_forward_hook(lambda _m, _a, out, u=unit: self._post_forward(u, out))
        for unit in units:  # gathered since construction
            unit.attach(requires_grad=False)
            if stage == 3:
                unit.free()
        # Fused optimizers update the shards without bumping their version counters, so the
        # version alone cannot tell stage 2 that its gathered parameters went stale.
        handle = register_optimizer_step_post_hook(_StepWatcher(self))
        weakref.finalize(self, handle.remove)

    # -- the layout (read-only) -----------------------------------------------------------------

    @property
    def units(self) -> tuple[FlatUnit, ...]:
        """The flat units, in construction order (each with its shard and its entries)."""
        return self.layout.units

    @property
    def stage(self) -> int:
        return self.layout.stage

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self.layout.process_group

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    # -- forward and backward ------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module, gathering each unit's parameters around its own forward."""
        self._running = []
        try:
            if self._root is not None:
                self._pre_forward(self._root)
            elif self._order:
                self._prefetch(self._order[0], "the forward")
            out = self.module(*args, **kwargs)
        except BaseException:
            self._close_ranges()  # the failed units' post-forward hooks never ran
            raise
        self._order = self._running
        if self._root is not None:
            # The root's parameters are needed first in backward: keep them when one follows.
            keep = torch.is_grad_enabled() or self.stage == 2
            return self._post_forward(self._root, out, free=not keep)
        self._hook_outputs(None, out)
        return out

    def _pre_forward(self, unit: FlatUnit) -> None:
        # The range spans the unit's forward, closed by _post_forward: hooks cannot hold a
        # `with` block open.
        span = self._span("forward", unit)
        span.__enter__()
        self._ranges.append(span)
        position = len(self._running)
        if unit is not self._root:
            self._running.append(unit)
        self._gather(unit)
        # Prefetch: the unit that ran next in the last forward starts gathering now, while this
        # one computes. Every rank runs the same units in the same order (required anyway), so
        # the collectives still match; a unit that does not come after all is gathered for
        # nothing and freed at the end of backward.
        after = position if unit is self._root else position + 1
        following = self._order[after] if after < len(self._order) else None
        if following is not None and following is not unit:
            self._prefetch(following, "the forward")
        leaf = unit.attach(requires_grad=torch.is_grad_enabled())
        if leaf is not None:
            nested = unit is not self._root and len(self._running) > 1
            use = _Use(self._running[-2] if nested else None)
            self._uses[unit.index].append(use)
            leaf.register_post_accumulate_grad_hook(lambda t, u=unit, s=use: self._reduce(u, s, t))

    def _post_forward(self, unit: FlatUnit, out: Any, free: bool = True) -> Any:
        # The last unit of a forward is the first of its backward: keeping it saves freeing and
        # gathering it again back to back.
        last = torch.is_grad_enabled() and self._order[-1:] == [unit]
        if self.stage == 3 and free and not last:
            self._free(unit, "after its forward")
        elif self.stage == 3:
            self._debug("kept after its forward: its backward comes first", unit)
        # Outputs need grad only when this forward made a use (grad mode): hooks go on those.
        self._hook_outputs(unit if self._uses[unit.index] else None, out)
        if self._ranges:
            self._ranges.pop().__exit__(None, None, None)
        return out

    def _close_ranges(self) -> None:
        while self._ranges:
            self._ranges.pop().__exit__(None, None, None)

    def _hook_outputs(self, unit: FlatUnit | None, out: Any) -> None:
        use = self._uses[unit.index][-1] if unit is not None else None
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, u=unit, s=use: self._pre_backward(u, s))

    def _pre_backward(self, unit: FlatUnit | None, use: _Use | None) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)
        if unit is None or use is None:
            return
        first = not use.in_backward
        use.in_backward = True
        # Usually gathered already by an earlier output's hook or a prefetch; again after a
        # retain_graph backward freed it.
        self._gather(unit)
        before = use.before
        if unit is self._root and self._order:
            before = self._order[-1]
        if first and before is not None and before is not unit:
            self._prefetch(before, "its backward, which comes next")

    def _reduce(self, unit: FlatUnit, use: _Use, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        assert grad is not None  # this hook runs after the gradient was accumulated
        tag = records.tagged(f"FSDP reduce-scatter unit {unit.index}")
        with self._span("reduce_scatter", unit), tag:
            out, work, after = unit.reduce_scatter(grad)
        self._pending.append((unit, out, work, after, grad))
        self._fold(REDUCES_IN_FLIGHT)
        uses = self._uses[unit.index]
        if use in uses:  # not on a second backward through a retained graph
            uses.remove(use)
        if self.stage != 3:
            return
        # Another forward's backward of this unit may still need the parameters.
        if any(u.in_backward for u in uses):
            self._debug("kept after its backward: another use's backward is running", unit)
        else:
            self._free(unit, "resharded after its backward")

    def _fold(self, limit: int) -> None:
        """Add finished reduce-scatters, divided into means, to the shards' ``.grad``, oldest
        first, and drop their flat gradients; wait for the oldest while more than ``limit`` are
        running.

        Always in the order they were started, so that a unit reduced twice (called twice in a
        forward) sums its parts in the same order on every run.
        """
        while self._pending:
            unit, out, work, after, _grad = self._pending[0]
            if len(self._pending) <= limit and work is not None and not work.is_completed():
                return
            if work is not None:
                with self._span("reduce_scatter_wait", unit):
                    work.wait()
            if after is not None:
                out.div_(after)
            self._pending.pop(0)
            shard = unit.shard
            if shard.grad is None:
                shard.grad = out
            else:
                shard.grad.add_(out)

    def _finish_backward(self) -> None:
        self._callback_queued = False
        with self._span("finish_backward"):
            self._fold(0)
            for unit in self.units:
                self._uses[unit.index].clear()
                if self.stage == 3:
                    self._free(unit, "end of backward")

    # -- gathering and freeing, with their traces -----------------------------------------------

    def _gather(self, unit: FlatUnit) -> None:
        """Whole parameters in ``unit`` now: waits for its prefetch, or all-gathers."""
        with self._span("all_gather", unit), records.tagged(f"FSDP all-gather unit {unit.index}"):
            unit.gather()

    def _prefetch(self, unit: FlatUnit, why: str) -> None:
        """Start ``unit``'s all-gather without waiting for it (unless it is current already)."""
        if unit.is_current:  # gathered, or its all-gather already in flight
            return
        self._debug("prefetched for %s", unit, why)
        tag = records.tagged(f"FSDP all-gather unit {unit.index} (prefetch)")
        with self._span("all_gather_start", unit), tag:
            unit.gather(async_op=True)

    def _free(self, unit: FlatUnit, why: str) -> None:
        if unit.is_gathered:
            self._debug("freed (%s)", unit, why)
        unit.free()

    def _span(self, phase: str, unit: FlatUnit | None = None) -> AbstractContextManager:
        """The profiler range ``tandem.fsdp.<phase>`` (``unit`` named in its argument), or
        nothing while no profiler records: a range costs microseconds even then, a real share
        of a small unit's step."""
        if not recording():
            return OFF
        return record_function(
            f"tandem.fsdp.{phase}", None if unit is None else self.layout.label(unit)
        )

    def _debug(self, message: str, unit: FlatUnit, *args: Any) -> None:
        if log.isEnabledFor(logging.DEBUG):  # no label built for nothing
            log.debug("rank %d, unit %s: " + message, self.rank, self.layout.label(unit), *args)

    # -- whole parameters ----------------------------------------------------------------------

    @contextmanager
    def gathered(self, writeback: bool = True) -> Iterator[nn.Module]:
        """Whole parameters in the module for the block (a collective: every rank enters).

        Changes made to them inside the block reach the shards when ``writeback`` is set.

        Example::

            with model.gathered() as net:
                print(net.head.weight.norm())
        """
        for unit in self.units:
            self._gather(unit)
            unit.attach(requires_grad=False)
        try:
            yield self.module
        finally:
            for unit in self.units:
                if writeback:
                    unit.writeback()
                else:
                    unit.invalidate()  # the edits must not outlive the block
                if self.stage == 3:
                    unit.free()

    # -- checkpoints (tandem.parallel.fsdp_state) ----------------------------------------------

    def full_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """The plain module's ``state_dict()``, gathered on group rank ``to`` (a collective).

        Example::

            full = model.full_state_dict()
            if tandem.world().is_main:
                torch.save(full, "model.pt")        # loads into the unwrapped model
        """
        return fsdp_state.full_state_dict(self.layout, to)

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Load a plain module's ``state_dict()`` on every rank (any world size saved it).

        Example::

            model.load_full_state_dict(torch.load("model.pt", weights_only=True))
        """
        fsdp_state.load_full_state_dict(self.layout, state)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards with their layout: one file per rank, same world size to load.

        Example::

            torch.save(model.sharded_state_dict(), f"ckpt/rank{tandem.world().rank}.pt")
        """
        return fsdp_state.sharded_state_dict(self.layout)

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Load this rank's :meth:`sharded_state_dict` (checked: same world size and units).

        Example::

            rank = tandem.world().rank
            model.load_sharded_state_dict(torch.load(f"ckpt/rank{rank}.pt", weights_only=True))
        """
        fsdp_state.load_sharded_state_dict(self.layout, state)

    def full_optim_state_dict(
        self, optimizer: torch.optim.Optimizer, to: int = 0
    ) -> dict[str, Any] | None:
        """``optimizer``'s state as a plain optimizer over the plain module's (a collective).

        Returns the dict on group rank ``to``, None elsewhere.

        Example::

            full = model.full_optim_state_dict(opt)
            if tandem.world().is_main:
                torch.optim.AdamW(plain.parameters()).load_state_dict(full)
        """
        return fsdp_state.full_optim_state_dict(self.layout, optimizer, to)

    def load_full_optim_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load a plain optimizer's state dict into ``optimizer`` (over this wrapper's shards).

        Every rank passes the whole dict and keeps its own slices, whatever world size saved it.

        Example::

            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model.load_full_optim_state_dict(opt, torch.load("optim.pt", weights_only=True))
        """
        fsdp_state.load_full_optim_state_dict(self.layout, optimizer, state)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their norm over all ranks' shards; the total norm.

        ``torch.nn.utils.clip_grad_norm_`` on the shards would see 1/N of the gradient: this
        adds the ranks' partial sums (one all-reduce) first.

        Example::

            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
        """
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        device = self.units[0].shard.device if self.units else torch.device("cpu")
        if norm_type == float("inf"):
            local = max((g.abs().max() for g in grads), default=torch.zeros((), device=device))
            total = local.clone().float()
            if self.world_size > 1:
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.process_group)
        else:
            local = sum(
                (g.float().norm(norm_type) ** norm_type for g in grads),
                torch.zeros((), device=device),
            )
            total = local.clone()
            if self.world_size > 1:
                dist.all_reduce(total, group=self.process_group)
            total = total ** (1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coefficient.to(g.dtype))
        return total


class _StepWatcher:
    """After any optimizer's step, mark the wrapper's units it stepped as stale (weakly held)."""

    def __init__(self, model: FullyShardedDataParallel) -> None:
        self.model = weakref.ref(model)

    def __call__(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        model = self.model()
        if model is None:
            return
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for unit in model.units:
            if id(unit.shard) in stepped:
                unit.invalidate()
