"""FullyShardedDataParallel: parameters, gradients and optimizer state sharded flat (ZeRO 2, 3).

The model is cut into *units*: every submodule that ``auto_wrap`` picks, and the root for the
parameters left over. Each unit's trainable parameters become one flat buffer, sharded by the
rule in :mod:`tandem.parallel.sharding` (:class:`tandem.parallel.fsdp.flat.FlatUnit`); the wrapper's
``parameters()`` are the shards, so a plain ``torch.optim`` optimizer over them keeps state for
this rank's slice only. One training step, stage 3:

1. Forward, per unit: all-gather the unit's parameters, run it, free them again (the root's
   stay until backward, which needs them first).
2. Backward, per unit: the first gradient reaching one of the unit's outputs all-gathers its
   parameters again; when the unit's flat gradient is complete it is reduce-scattered, started
   asynchronously, and the parameters are freed.
3. End of backward (a callback queued in step 2): wait for the reduce-scatters and divide
   the sums by N (:func:`tandem.parallel.fsdp.flat.mean_divisors`: torch FSDP2's rule, the same
   bits); each shard's ``.grad`` is its slice of the mean gradient (added to, when gradients
   accumulate).
4. ``optimizer.step()`` updates the shards; the next forward gathers the new values.

The hooks that run these steps are :mod:`tandem.parallel.fsdp.hooks`; this module builds the
units and holds the public API. Stage 2 (``reshard_after_forward=False``) is the same without
the frees: every rank keeps the whole parameters between steps and skips the all-gathers while
its shard has not changed, so only gradients (reduce-scattered) and optimizer state are
sharded. With ``reshard_after_forward=k`` (an int, ZeRO++'s hpZ) step 1 keeps each unit's
parameters sharded over ``k`` ranks instead of freeing them, and step 2's all-gather runs
within those ``k`` ranks.

Hybrid sharding (``shard_group=`` with ``replicate_group=``, ``hybrid=True``, a 2-D
``device_mesh=``; :mod:`tandem.parallel.fsdp.mesh`) runs the steps above within each shard
group (a node, say), and adds one collective to step 3: each reduced slice is all-reduced
across the replicate group (the same slice on the other nodes) before it is divided into a
mean, the only collective that leaves the shard group. With ``mixed_precision``
(:mod:`tandem.parallel.fsdp.precision`) the shards stay float32 and the units gather, compute
and reduce in the policy's dtypes, as torch's ``fully_shard(mp_policy=...)`` does.

Collectives are issued in the order the units run, so every rank must run the same units in
the same order, forward and backward (as with torch's FSDP). Buffers are broadcast from rank 0
once, at construction; frozen parameters stay ordinary, replicated parameters.

What the model is made of (units, names, group) is one record, :class:`FsdpLayout`
(``model.layout``), which the checkpoints (:mod:`tandem.parallel.fsdp.state`) read. What it does
shows in torch's profiler as ranges ``tandem.fsdp.forward`` (one per unit forward, the unit
named in its argument), ``tandem.fsdp.all_gather`` (a gather waited for), ``.all_gather_start``
(a prefetch started), ``.reduce_scatter``, ``.reduce_scatter_wait``, ``.all_reduce`` and
``.all_reduce_wait`` (hybrid) and ``.finish_backward``; its decisions (prefetch, free, keep)
are logged at debug level on ``tandem.fsdp``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from tandem._dist import require_process_group
from tandem.doctor import step_clock
from tandem.parallel.fsdp import state as fsdp_state
from tandem.parallel.fsdp.flat import FlatUnit
from tandem.parallel.fsdp.hooks import Hooks
from tandem.parallel.fsdp.layout import FsdpLayout, PlainNames
from tandem.parallel.fsdp.mesh import FsdpMesh, post_forward_group, resolve
from tandem.parallel.fsdp.precision import MixedPrecisionPolicy
from tandem.parallel.fsdp.units import AutoWrap, agree_on_policy, check_fits, plan_agreed
from tandem.parallel.grad_norm import clip_sharded_grad_norm_
from tandem.parallel.replicas import broadcast_coalesced, verify_same_model

__all__ = ["FullyShardedDataParallel", "MixedPrecisionPolicy"]


class FullyShardedDataParallel(nn.Module):
    """Sharded data parallelism: each rank holds 1/N of parameters, gradients and optimizer state.

    Build the optimizer after wrapping, over the wrapper's ``parameters()`` (the flat shards).
    Every rank must call the model's forward and backward the same way: the units' collectives
    are issued in the order they run.

    Args:
        module: the model; the same parameters and buffers on every rank (checked), then rank
            0's values everywhere.
        stage: 3 (the default) frees each unit's parameters after its forward and its
            backward; 2 keeps whole parameters on every rank and shards gradients and
            optimizer state. The same as ``reshard_after_forward`` True and False (give one,
            or two that agree).
        reshard_after_forward: torch's ``fully_shard`` argument: True (stage 3), False (stage
            2), or an int ``k`` dividing the shard group's size: after its forward each unit
            stays sharded over ``k`` ranks (consecutive ranks of the shard group, e.g. a
            node's), so that its backward's all-gather runs within them (ZeRO++'s hpZ); it
            costs ``1/k`` of the unit's gathered parameters per rank until that backward. ``k``
            equal to the shard group's size is True, 1 is False (as in torch).
        auto_wrap: the submodules that become units of their own: module classes
            (``{nn.TransformerEncoderLayer}``) or a predicate ``module -> bool``; None makes
            the whole model one unit (sharded at rest, gathered whole for each step). The same
            units on every rank (checked).
        process_group: the group to shard over (default: the whole world).
        shard_group: with ``replicate_group``, hybrid sharding (torch's HSDP): parameters,
            gradients and optimizer state sharded within ``shard_group`` (this rank's), each
            gradient slice all-reduced across ``replicate_group`` (the ranks holding the same
            slice in the other shard groups) after its reduce-scatter. The groups must form a
            grid (checked on every rank): ``tandem.groups.partition(n)`` and
            ``tandem.groups.strided(n)`` do. Alone, the same as ``process_group``.
        replicate_group: see ``shard_group``.
        hybrid: hybrid sharding by node: shard within the launcher's nodes
            (``LOCAL_WORLD_SIZE`` ranks each), replicate across them. One node: flat.
        device_mesh: a torch ``DeviceMesh``, as ``fully_shard`` takes it: one dimension
            (shard over it) or two (replicate, shard: hybrid sharding).
        device: where shards and gathered parameters live (default: the parameters' device).
        mixed_precision: a :class:`~tandem.parallel.fsdp.precision.MixedPrecisionPolicy`
            (torch's ``torch.distributed.fsdp.MixedPrecisionPolicy`` or a dict of its fields
            too): parameters gathered and used in ``param_dtype``, gradients reduced in
            ``reduce_dtype`` into float32 shards, as torch's ``fully_shard`` applied with it
            to every unit and the root. Needs float32 parameters; the same on every rank
            (checked). None (default): everything in the parameters' dtype.

    Example::

        tandem.init()
        model = tandem.FullyShardedDataParallel(Net(), auto_wrap={Block})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # state for this rank's shards
        loss_fn(model(x), y).backward()                        # .grad: this rank's slices
        opt.step()
        opt.zero_grad()
        full = model.full_state_dict()                         # rank 0: a plain state_dict

        bf16 = tandem.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = tandem.FullyShardedDataParallel(Net(), auto_wrap={Block}, mixed_precision=bf16)

        # 4 nodes of 8: sharded over each node's 8 ranks, replicated across the 4 nodes
        model = tandem.FullyShardedDataParallel(Net(), auto_wrap={Block}, hybrid=True)
        # flat over all 32, but each unit kept sharded within the node for its backward
        model = tandem.FullyShardedDataParallel(Net(), auto_wrap={Block}, reshard_after_forward=8)

    Raises:
        ValueError: on every rank: conflicting arguments (``process_group`` with
            ``hybrid=True``, ``stage=2`` with ``reshard_after_forward=True``, ...), groups
            that do not form a grid, a node layout ``hybrid=True`` cannot cut, a
            ``reshard_after_forward`` that does not divide the shard group, or a model, units
            or settings that differ across ranks.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int | None = None,
        reshard_after_forward: bool | int | None = None,
        auto_wrap: AutoWrap | None = None,
        process_group: dist.ProcessGroup | None = None,
        shard_group: dist.ProcessGroup | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        hybrid: bool = False,
        device_mesh: Any = None,
        device: torch.device | str | None = None,
        mixed_precision: MixedPrecisionPolicy | Any | None = None,
    ) -> None:
        super().__init__()
        wrapper = "tandem.FullyShardedDataParallel"
        require_process_group(wrapper)
        reshard = _reshard_setting(stage, reshard_after_forward, wrapper)
        mesh = resolve(
            process_group=process_group,
            shard_group=shard_group,
            replicate_group=replicate_group,
            hybrid=hybrid,
            device_mesh=device_mesh,
            wrapper=wrapper,
        )
        reshard = _within_row(reshard, mesh, wrapper)
        self.module = module
        # Checks and broadcasts span the whole grid: the replicas must start alike too.
        everyone = mesh.everyone.group
        # Parameters and buffers: the buffers are broadcast below as one flat buffer, whose
        # size must match on every rank.
        verify_same_model(module, everyone, wrapper=wrapper)
        names = PlainNames.of(module)  # before flattening takes the parameters away
        sharding = f"reshard_after_forward={reshard!r} over {mesh.describe()}"
        planned, policy = plan_agreed(
            module, auto_wrap, mixed_precision, everyone, wrapper, sharding
        )
        self.mixed_precision = policy
        post = post_forward_group(mesh, reshard) if not isinstance(reshard, bool) else None
        units: list[FlatUnit] = []
        unit_of_module: dict[int, FlatUnit] = {}
        for _, m, params in planned:
            target = torch.device(device) if device is not None else params[0][2].device
            dtypes = (None, None) if policy is None else (policy.param_dtype, policy.reduce_dtype)
            unit = FlatUnit(len(units), params, mesh, target, *dtypes, post_forward=post)
            units.append(unit)
            unit_of_module[id(m)] = unit
        # What stays replicated (buffers, frozen parameters) moves whole and takes rank 0's
        # values; the trainable parameters were broadcast unit by unit above.
        if device is not None:
            module.to(device)
        broadcast_coalesced([*module.parameters(), *module.buffers()], everyone)
        self.layout = FsdpLayout(
            module=module,
            units=tuple(units),
            unit_names=tuple(name for name, _, _ in planned),
            stage=2 if reshard is False else 3,
            process_group=mesh.shard.group,
            rank=mesh.shard.rank,
            world_size=mesh.shard.size,
            state_keys=names.state_keys,
            param_fqns=names.param_fqns,
            key_fqn=names.key_fqn(units),
            mesh=mesh,
            reshard_after_forward=reshard,
        )
        self.flat_params = nn.ParameterList([u.shard for u in units])
        self._hooks = Hooks(self.layout, unit_of_module.get(id(module)), policy)
        for _, m, _ in planned:
            if m is not module:  # the root's unit is gathered by forward itself
                self._hooks.register(m, unit_of_module[id(m)])
        for unit in units:  # gathered since construction
            unit.attach(requires_grad=False)
            if self.layout.stage == 3:
                unit.free()
        # Fused optimizers update the shards without bumping their version counters, so the
        # version alone cannot tell stage 2 that its gathered parameters went stale.
        handle = register_optimizer_step_post_hook(_StepWatcher(self))
        weakref.finalize(self, handle.remove)
        self._steps = step_clock.clock("tandem.FullyShardedDataParallel forwards", priority=1)

    # -- the layout (read-only) -----------------------------------------------------------------

    @property
    def units(self) -> tuple[FlatUnit, ...]:
        """The flat units, in construction order (each with its shard and its entries)."""
        return self.layout.units

    @property
    def stage(self) -> int:
        """2 (whole parameters kept between steps) or 3 (sharded between uses)."""
        return self.layout.stage

    @property
    def reshard_after_forward(self) -> bool | int:
        """True, False, or the size of the groups that keep a unit from forward to backward."""
        return self.layout.reshard_after_forward

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group the units are sharded over (hybrid: this rank's shard group)."""
        return self.layout.process_group

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """The group the shards are replicated across (None: flat sharding)."""
        return self.layout.mesh.replicate.group if self.layout.mesh.hybrid else None

    @property
    def mesh(self) -> FsdpMesh:
        """This rank's shard group, replicate group and the grid's ranks, as records."""
        return self.layout.mesh

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    # -- forward and backward ------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module, gathering each unit's parameters around its own forward."""
        if torch.is_grad_enabled():
            self._steps.tick()
        return self._hooks.forward(self.module, args, kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep their gradients unreduced; the first one outside
        reduce-scatters their sum with its own (torch FSDP2's ``set_requires_gradient_sync``).

        It saves the communication of accumulation micro-steps at the price of memory: every
        unit keeps its whole flat gradient (in the reduce dtype) until then, as with torch. Without
        it, every backward reduce-scatters and the shards' ``.grad`` add up, which accumulates
        the same gradient in 1/N of the memory.

        Example::

            with model.no_sync():
                loss_fn(model(x0), y0).backward()     # no communication
            loss_fn(model(x1), y1).backward()         # reduce-scatters both micro-batches
            opt.step()
        """
        before, self._hooks.sync = self._hooks.sync, False
        try:
            yield
        finally:
            self._hooks.sync = before

    # -- mixed precision -----------------------------------------------------------------------

    def set_mixed_precision(self, mixed_precision: MixedPrecisionPolicy | Any | None) -> None:
        """Gather, compute and reduce in ``mixed_precision``'s dtypes from the next forward on,
        as if the wrapper had been built with it (a collective: every rank calls it alike).

        What ``mixed_precision=`` of the constructor takes (None: no mixed precision). Call it
        between steps: not inside forward or backward, nor while ``no_sync()`` keeps gradients
        back. The shards, and so the optimizer over them, are untouched: they stay the float32
        master weights. The :class:`tandem.Trainer` calls it for ``precision="bf16-mixed"``
        and ``"fp16-mixed"`` on a wrapper built without a policy (Lightning's FSDP precision).

        Raises:
            ValueError: on every rank, if the policy differs across ranks, is not a policy, or
                does not fit the model (parameters not float32, frozen ones of another dtype).
            RuntimeError: a forward's backward, or a no_sync gradient, is still pending.

        Example::

            model = tandem.FullyShardedDataParallel(net, auto_wrap={Block})
            model.set_mixed_precision(tandem.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
            loss_fn(model(x), y).backward()          # gathered in bfloat16, reduced in bfloat16
        """
        hooks = self._hooks
        busy = hooks.pending or hooks.callback_queued or any(hooks.uses.values())
        if busy or any(u.unsynced is not None for u in self.units):
            raise RuntimeError(
                "set_mixed_precision() inside a step: a forward's backward, or gradients kept "
                "back by no_sync(), are pending; call it between optimizer steps"
            )
        wrapper = "tandem.FullyShardedDataParallel.set_mixed_precision"
        policy = agree_on_policy(mixed_precision, self.mesh.everyone.group, wrapper)
        if policy is not None:
            trainable = [(e.fqn, u.shard) for u in self.units for e in u.entries]
            check_fits(policy, self.module, trainable)
        dtypes = (None, None) if policy is None else (policy.param_dtype, policy.reduce_dtype)
        for unit in self.units:
            unit.set_dtypes(*dtypes)
        self.mixed_precision = hooks.policy = policy

    # -- whole parameters ----------------------------------------------------------------------

    @contextmanager
    def gathered(self, writeback: bool = True) -> Iterator[nn.Module]:
        """Whole parameters in the module for the block (a collective: every rank enters).

        Changes made to them inside the block reach the shards when ``writeback`` is set. With
        mixed precision they are the float32 values of the shards, not the ``param_dtype``
        copies the forward uses.

        Example::

            with model.gathered() as net:
                print(net.head.weight.norm())
        """
        whole = [self._hooks.gather_exact(unit) for unit in self.units]
        for unit, values in zip(self.units, whole, strict=True):
            unit.attach(requires_grad=False, values=values)
        try:
            yield self.module
        finally:
            for unit, values in zip(self.units, whole, strict=True):
                if writeback:
                    unit.writeback(values)
                elif not unit.mixed:
                    unit.invalidate()  # the edits must not outlive the block
                if self.stage == 3:
                    unit.free()
                elif unit.mixed:
                    unit.attach(requires_grad=False)  # back to the gathered param_dtype copy

    # -- checkpoints (tandem.parallel.fsdp.state) ----------------------------------------------

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
        adds the ranks' partial sums (one all-reduce) first (``parallel/grad_norm.py``).

        Example::

            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
        """
        return clip_sharded_grad_norm_(
            self.parameters(), max_norm, norm_type, group=self.process_group
        )


def _reshard_setting(stage: Any, reshard_after_forward: Any, wrapper: str) -> bool | int:
    """``stage`` and ``reshard_after_forward`` as one setting (True, False or an int); a
    ValueError when either is not one or they disagree (no communication)."""
    if stage is not None and (isinstance(stage, bool) or stage not in (2, 3)):
        raise ValueError(
            f"stage={stage!r}: FullyShardedDataParallel implements stage 2 (gradients and "
            "optimizer state sharded) and stage 3 (parameters too); for stage 1 use "
            "tandem.DDP with tandem.ShardedOptimizer"
        )
    value = reshard_after_forward
    if value is not None and (not isinstance(value, int) or (type(value) is int and value < 1)):
        raise ValueError(
            f"{wrapper}: reshard_after_forward={value!r}: give True (stage 3), False (stage 2) "
            "or a positive int, the number of ranks a unit stays sharded over between its "
            "forward and its backward"
        )
    if stage is not None and value is not None and value is not (stage == 3):
        raise ValueError(
            f"{wrapper}: stage={stage} and reshard_after_forward={value!r} disagree: stage=3 "
            "is reshard_after_forward=True and stage=2 is False; pass one of them"
        )
    if value is None:
        return stage != 2
    return value


def _within_row(reshard: bool | int, mesh: FsdpMesh, wrapper: str) -> bool | int:
    """An int ``reshard_after_forward`` checked against the shard group; torch's rule: 1 is
    False, the group's size True."""
    if isinstance(reshard, bool):
        return reshard
    size = mesh.shard.size
    if size % reshard:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(
            f"{wrapper}: reshard_after_forward={reshard} does not divide the {size} ranks of the "
            f"shard group, so they cannot keep equal slices; give one of {divisors}, True or "
            "False"
        )
    return False if reshard == 1 else True if reshard == size else reshard


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
