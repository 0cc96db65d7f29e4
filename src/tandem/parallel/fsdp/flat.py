"""One wrapped unit's parameters as one flat buffer, sharded across ranks.

A :class:`FlatUnit` owns the trainable parameters of one module (those not in a nested unit).
At construction they are concatenated into one flat buffer, padded to a multiple of the world
size, and cut by :func:`tandem.parallel.sharding.flat_shard`; this rank keeps only its slice,
as the ``shard`` ``nn.Parameter`` the optimizer steps. The originals are removed from their
modules: while the unit is *gathered*, the module attributes of the same names are views into
``full``, the whole flat buffer, refilled from every rank's shard by one all-gather.

Memory is released by resizing ``full``'s storage to zero bytes, not by dropping the tensor:
autograd has saved views of it for backward (a linear layer saves its weight), and the
backward all-gather refills the very storage those saved views point to.

Each forward in grad mode makes a fresh autograd leaf aliasing ``full`` (its own version
counter, so that refilling ``full`` does not trip autograd's in-place check) and splits it into
the parameter views with one ``torch.split``: in backward the split's single node concatenates
the parameters' gradients into one flat gradient, which the leaf's post-accumulate hook
reduce-scatters to the owners.

Mixed precision (:mod:`tandem.parallel.fsdp.precision`): ``full`` is in ``param_dtype``, filled
by an all-gather of the shards cast to it (half the bytes in bfloat16), so forward and backward
compute in it; gradients are cast to ``reduce_dtype`` for the reduce-scatter, and the reduced
slice to the shard's dtype. Readers of the whole values (checkpoints, ``gathered()``) must not
see them rounded: they gather the shards as they are (:meth:`FlatUnit.gather`,
:meth:`FlatUnit.gather_exact`) into a buffer of their own.

Hybrid sharding (:mod:`tandem.parallel.fsdp.mesh`): the buffer is cut over the mesh's row (its
shard group) only, and each reduced slice is all-reduced across the column (its replicate group)
before it becomes a mean (:func:`gradient_divisors`, torch's rule, applied in two steps as
torch's HSDP does). With ``reshard_after_forward=<int>`` a unit freed after its forward keeps
the slice of ``full`` that its post-forward group assigns this rank (:meth:`FlatUnit.free`'s
``keep``), and its backward's all-gather refills ``full`` from those slices within that group.

Example::

    unit = FlatUnit(0, entries, mesh.flat(None), cpu)    # entries: (fqn, locations, param)
    unit.unshard()                                       # all-gather; attributes are views
    leaf = unit.attach(requires_grad=True)
    unit.free()                                          # stage 3, after forward
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from tandem._dist import all_gather_flat, reduce_scatter_flat
from tandem.doctor import records
from tandem.groups import GroupInfo
from tandem.parallel.fsdp.mesh import FsdpMesh
from tandem.parallel.sharding import flat_shard, padded_numel


def mean_divisors(dtype: torch.dtype, world_size: int) -> tuple[float | None, float | None]:
    """The divisors ``(before, after)`` that make a reduce-scatter's sum a mean (None: none):
    :func:`gradient_divisors` of flat sharding over ``world_size`` ranks.

    torch FSDP2's rule, so that the two agree bit for bit: float32 and bfloat16 sum first and
    divide the slice after (1/N of the elements to divide; on Gloo exactly what FSDP2's
    ``ReduceOp.AVG`` computes). Other dtypes, float16's narrow range in mind, divide by a power
    of two near sqrt(N) before the sum and by the rest after, so that the sum neither overflows
    nor underflows.
    """
    before, scattered, reduced = gradient_divisors(dtype, world_size, 1)
    return before, scattered or reduced


def gradient_divisors(
    dtype: torch.dtype, shard_size: int, replicate_size: int
) -> tuple[float | None, float | None, float | None]:
    """The divisors ``(before, after the reduce-scatter, after the all-reduce)`` that make the
    gradient summed over ``shard_size x replicate_size`` ranks a mean (None: none).

    torch FSDP2's rule (``_get_gradient_divide_factors``): float32 and bfloat16 average in each
    collective (``ReduceOp.AVG``, on Gloo the sum divided by the group's size), so the slice is
    divided by the shard group's size after the reduce-scatter, then by the replicate group's
    after the all-reduce. Other dtypes divide by a power of two near sqrt(N) (N all the ranks)
    before the sum and by the rest at the very end.

    Example::

        >>> gradient_divisors(torch.float32, 2, 2)
        (None, 2.0, 2.0)
        >>> gradient_divisors(torch.float16, 4, 1)
        (2.0, None, 2.0)
    """
    total = shard_size * replicate_size
    if total == 1:
        return None, None, None
    if dtype in (torch.float32, torch.bfloat16):
        return (
            None,
            float(shard_size) if shard_size > 1 else None,
            float(replicate_size) if replicate_size > 1 else None,
        )
    before = 1
    while total % before == 0 and total / before > before:
        before *= 2
    after = total / before
    return (float(before) if before > 1 else None), None, (after if after != 1 else None)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> Any:
    """Start summing ``tensor`` in place over ``group`` (asynchronous: the work)."""
    return dist.all_reduce(tensor, group=group, async_op=True)


@dataclass(frozen=True)
class FlatParam:
    """One original parameter inside a unit's flat buffer."""

    fqn: str
    locations: tuple[tuple[nn.Module, str], ...]  # every (module, name) it is registered as
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return self.shape.numel()


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s storage with its own autograd version counter."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )


@dataclass
class Reduction:
    """A started reduction of one unit's flat gradient: a reduce-scatter, then (hybrid) an
    all-reduce of its slice across the replicas.

    ``out`` is this rank's slice (in the reduce dtype) once ``work``, the collective in flight,
    is done (None: nothing in flight; one rank, nothing sent, ``out`` is the gradient itself);
    ``after`` divides it then; ``sent`` is the flat gradient the reduce-scatter reads from, held
    until it is done. ``across`` is the replicate group still to all-reduce ``out`` over after
    that (None: none), and ``after_across`` the divisor that follows that all-reduce.
    """

    out: torch.Tensor
    work: Any
    after: float | None
    sent: torch.Tensor | None
    across: dist.ProcessGroup | None = None
    after_across: float | None = None
    all_reducing: bool = False  # whether ``work`` is the all-reduce (else the reduce-scatter)

    def advance(self) -> None:
        """``work`` is done: start the all-reduce across the replicas, if one follows, once
        the slice is divided (torch's HSDP order: a mean per group, the same bits)."""
        self.work = self.sent = None
        if self.across is None:
            return
        if self.after is not None:
            self.out.div_(self.after)
        self.after, self.after_across = self.after_across, None
        self.work, self.across = all_reduce_sum(self.out, self.across), None
        self.all_reducing = True

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """The mean slice in ``dtype`` (call when nothing is left in flight): divided in the
        reduce dtype first, then cast (torch FSDP2's order, the same bits)."""
        assert self.work is None and self.across is None, "reduction still in flight"
        if self.after is not None:
            self.out.div_(self.after)
        return self.out.to(dtype)


class FlatUnit:
    """The flat, sharded parameters of one unit (see the module docstring).

    Args:
        index: the unit's position in its wrapper (names its shard parameter).
        params: ``(fqn, locations, parameter)`` of every trainable parameter of the unit, with
            ``locations`` the ``(module, name)`` pairs it is registered as (several when tied);
            identical values on every rank, one dtype.
        mesh: the ranks sharing the unit: cut over ``mesh.shard``, replicated across
            ``mesh.replicate`` (:mod:`tandem.parallel.fsdp.mesh`).
        device: where the shard and the gathered buffer live.
        param_dtype: the dtype of ``full``, the gathered parameters forward and backward use
            (None: the parameters' own).
        reduce_dtype: the dtype gradients are reduce-scattered in (None: ``param_dtype``).
        post_forward: the group whose ranks keep slices of ``full`` between the unit's forward
            and its backward (``reshard_after_forward=<int>``; None: nothing kept).
    """

    # The unit whose whole values :meth:`gather` last gathered at the shard's precision under
    # mixed precision: one such buffer at a time in the process, so that a checkpoint, which
    # gathers unit after unit and never frees at stage 2, holds one unit's, not the model's.
    _exact_holder: ClassVar[weakref.ref[FlatUnit] | None] = None

    def __init__(
        self,
        index: int,
        params: list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter]],
        mesh: FsdpMesh,
        device: torch.device,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        post_forward: GroupInfo | None = None,
    ) -> None:
        dtypes = {p.dtype for *_, p in params}
        if len(dtypes) != 1:
            described = ", ".join(f"{fqn} ({p.dtype})" for fqn, *_, p in params)
            raise ValueError(
                f"tandem.FullyShardedDataParallel: one wrapped unit holds parameters of several "
                f"dtypes: {described}. Give them one dtype (module.to(dtype)) or wrap the "
                "submodules of each dtype as their own units (auto_wrap)"
            )
        dtype = dtypes.pop()
        self.index = index
        self.mesh = mesh
        self.group = mesh.shard.group
        self.world_size = mesh.shard.size
        self.rank = mesh.shard.rank
        self.post_forward = post_forward
        self.param_dtype = param_dtype or dtype
        # torch's rule: the gradients come in param_dtype and are reduced in it unless told.
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.entries: list[FlatParam] = []
        offset = 0
        for fqn, locations, p in params:
            self.entries.append(FlatParam(fqn, tuple(locations), p.shape, offset))
            offset += p.numel()
        self.numel = offset
        self.padded = padded_numel(self.numel, self.world_size)
        # This rank's slice of the flat buffer: the one sharding rule, asked once.
        self.own = slice(*flat_shard(self.numel, self.world_size, self.rank))
        self.split_sizes = [e.numel for e in self.entries]
        if self.padded > self.numel:
            self.split_sizes.append(self.padded - self.numel)
        with torch.no_grad():
            flat = self._flatten({fqn: p for fqn, _, p in params}, dtype, device)
            everyone = mesh.everyone
            if everyone.size > 1:
                # Rank 0's values everywhere, one unit at a time on ``device``: a model built on
                # the CPU never has to fit on the device whole.
                dist.broadcast(flat, src=everyone.leader, group=everyone.group)
            self.shard = nn.Parameter(flat[self.own].clone())
        for entry in self.entries:
            for module, name in entry.locations:
                del module._parameters[name]
        # The broadcast buffer already holds every rank's values: it is the first gathered
        # ``full`` (cast element by element: what gathering the cast shards would give), so
        # construction needs no all-gather.
        self.full = flat.to(self.param_dtype)
        self._gathering: dist.Work | None = None  # a prefetch's all-gather in flight
        self._sending: torch.Tensor | None = None  # its input, alive until it is done
        # The shard's version when ``full`` was last filled from it: unchanged means ``full`` is
        # still current (stage 2 keeps it between steps and skips the all-gather).
        self._gathered_version: int | None = self.shard._version
        # Mixed precision only: the whole values at the shard's precision, for full_values().
        self._exact: torch.Tensor | None = None
        # reshard_after_forward=<int>: this rank's slice of ``full`` in the post-forward group,
        # kept from a forward for its backward, and the shard's version it was cut from.
        self._kept: torch.Tensor | None = None
        self._kept_version: int | None = None
        # no_sync: the flat gradients of the micro-steps not reduced yet, summed.
        self.unsynced: torch.Tensor | None = None

    def set_dtypes(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
        """Gather in ``param_dtype`` and reduce in ``reduce_dtype`` from now on (None: as in
        the constructor); between steps only, with no gradient kept back (``no_sync``).

        ``full`` is made anew in the new dtype, and the module attributes become views of it:
        still current (stage 2) when it held the shards' own values, which cast element by
        element are what an all-gather of the cast shards gives; otherwise freed, to be
        gathered by the next forward.
        """
        assert self.unsynced is None, "set_dtypes with gradients kept back by no_sync"
        new_param = param_dtype or self.shard.dtype
        current = self.is_current and not self.mixed
        old = self.full
        if self._gathering is not None:
            self._wait_gathering()
        self.param_dtype = new_param
        self.reduce_dtype = reduce_dtype or new_param
        self._exact = self._kept = None
        if current:
            self.full = old.to(new_param)  # old itself when the dtype is the same
        else:
            self.full = torch.empty(self.padded, dtype=new_param, device=self.shard.device)
            self.full.untyped_storage().resize_(0)
            self._gathered_version = None
        if self.full is not old:
            old.untyped_storage().resize_(0)
        self.attach(requires_grad=False)

    def _flatten(
        self, values: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | None
    ) -> torch.Tensor:
        """One padded flat buffer from full-size ``values`` by fqn, in the unit's layout."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for e in self.entries:
            flat[e.offset : e.offset + e.numel].copy_(values[e.fqn].reshape(-1))
        return flat

    @property
    def mixed(self) -> bool:
        """Whether ``full`` is in another dtype than the shard (mixed precision)."""
        return self.param_dtype != self.shard.dtype

    # -- the gathered buffer, in param_dtype (forward and backward) ----------------------------

    @property
    def is_gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    @property
    def is_current(self) -> bool:
        return self.is_gathered and self._gathered_version == self.shard._version

    def unshard(self, async_op: bool = False) -> None:
        """Fill ``full`` from every rank's shard (one all-gather), unless it is current.

        The shard is cast to ``param_dtype`` before it is sent. With ``async_op`` the
        all-gather is only started (a prefetch); the next plain ``unshard()`` or ``free()``
        waits for it. After a forward that kept slices (:meth:`free`'s ``keep``) the slices are
        gathered instead, within the post-forward group: the same values, from nearer ranks.
        """
        if self._gathering is not None:
            if not async_op:
                self._wait_gathering()
            return
        if self.is_current:
            return
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.padded * self.full.element_size())
        target = _alias(self.full)
        with torch.no_grad():
            group, size = self.group, self.world_size
            if self._kept is not None and self._kept_version == self.shard._version:
                assert self.post_forward is not None  # only kept with a post-forward group
                source, group, size = self._kept, self.post_forward.group, self.post_forward.size
            else:
                source = self.shard.detach().to(self.param_dtype)
            self._kept = None  # in ``full`` from now on (or stale)
            if size == 1:
                target.copy_(source)
            else:
                work = all_gather_flat(target, source, group=group, async_op=async_op)
                if async_op:
                    self._gathering, self._sending = work, source
        self._gathered_version = self.shard._version

    def _wait_gathering(self) -> None:
        assert self._gathering is not None
        records.wait(self._gathering)
        self._gathering = self._sending = None

    def invalidate(self) -> None:
        """Mark ``full`` stale: the shard changed in a way its version counter does not show
        (fused optimizers write through kernels that do not bump it)."""
        self._gathered_version = self._kept_version = None

    def free(self, keep: bool = False) -> None:
        """Release ``full``'s memory (and :meth:`gather`'s values); views of it stay valid
        objects until the next unshard.

        With ``keep`` (after a forward, ``reshard_after_forward=<int>``) this rank's slice of it
        in the post-forward group is kept first, for the backward's all-gather (torch's
        ``_to_sharded_post_forward``); without it, a kept slice is dropped too.
        """
        if self._gathering is not None:  # never free what a collective is writing into
            self._wait_gathering()
        post = self.post_forward
        if keep and post is not None and self.is_current:
            start, end = flat_shard(self.padded, post.size, post.rank)
            self._kept = self.full[start:end].clone()
            self._kept_version = self.shard._version
        elif not keep:
            self._kept = None
        self.full.untyped_storage().resize_(0)
        self._gathered_version = None
        self._exact = None

    def attach(
        self, requires_grad: bool, values: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Point the module attributes at views of ``full`` (or of ``values``, a whole flat
        buffer of the unit); the autograd leaf, if any.

        With ``requires_grad`` the views come from a fresh leaf aliasing ``full``, whose
        gradient is the unit's flat gradient (see the module docstring).
        """
        leaf = _alias(self.full if values is None else values)
        if requires_grad:
            leaf.requires_grad_(True)
        pieces = torch.split(leaf, self.split_sizes)
        for entry, piece in zip(self.entries, pieces, strict=False):
            view = piece.view(entry.shape)
            for module, name in entry.locations:
                setattr(module, name, view)
        return leaf if requires_grad else None

    # -- whole values at the shard's precision (checkpoints, gathered()) -----------------------

    def gather_exact(self) -> torch.Tensor:
        """The whole flat buffer at the shard's precision (a collective: every rank calls it).

        Without mixed precision that is ``full``, unsharded; with it, a buffer of its own,
        all-gathered from the shards as they are: the whole values are never seen rounded.
        """
        if not self.mixed:
            self.unshard()
            return self.full
        out = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
        with torch.no_grad():
            if self.world_size == 1:
                out.copy_(self.shard)
            else:
                all_gather_flat(out, self.shard.detach(), group=self.group)
        return out

    def gather(self) -> None:
        """Whole values at the shard's precision for :meth:`full_values` (a collective).

        Without mixed precision: :meth:`unshard`. With it, the values are kept aside until
        :meth:`free`, or until any unit gathers again this way (one such buffer at a time).
        """
        if not self.mixed:
            self.unshard()
            return
        holder = FlatUnit._exact_holder() if FlatUnit._exact_holder is not None else None
        if holder is not None:
            holder._exact = None
        self._exact = self.gather_exact()
        FlatUnit._exact_holder = weakref.ref(self)

    def full_values(self) -> dict[str, torch.Tensor]:
        """The whole parameters as ``{fqn: tensor}`` views, at the shard's precision (call
        :meth:`gather` first)."""
        flat = self._exact if self.mixed else self.full
        assert flat is not None, "gather() first"
        return {e.fqn: flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries}

    def writeback(self, values: torch.Tensor | None = None) -> None:
        """Copy this rank's slice of ``full`` (or of ``values``, a whole flat buffer at the
        shard's precision) into the shard, after the caller edited views of it."""
        with torch.no_grad():
            self.shard.copy_((self.full if values is None else values)[self.own])
        if values is None or values is self.full:
            self._gathered_version = self.shard._version

    def shard_of(
        self, values: dict[str, torch.Tensor], dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """This rank's slice of the flat buffer built from full-size ``values`` by fqn (CPU)."""
        return self._flatten(values, dtype or self.shard.dtype, None)[self.own]

    # -- gradients -----------------------------------------------------------------------------

    def reduce_scatter(self, flat_grad: torch.Tensor) -> Reduction:
        """Start summing ``flat_grad`` over the ranks, in ``reduce_dtype``, into this rank's
        slice: a reduce-scatter over the shard group, then (hybrid) an all-reduce across the
        replicas, started by :meth:`Reduction.advance`; ``flat_grad`` may be divided in place
        first (:func:`gradient_divisors`)."""
        sent = flat_grad.to(self.reduce_dtype)  # itself when it has that dtype already
        replicate = self.mesh.replicate
        before, scattered, reduced = gradient_divisors(
            self.reduce_dtype, self.world_size, replicate.size
        )
        if before is not None:
            sent.div_(before)
        across = replicate.group if replicate.size > 1 else None
        if self.world_size == 1:
            reduction = Reduction(sent, None, scattered, None, across, reduced)
            reduction.advance()  # nothing to scatter: the all-reduce, if any, starts now
            return reduction
        if across is None:  # flat: one divisor after the reduce-scatter
            scattered, reduced = scattered or reduced, None
        out = torch.empty(self.shard.numel(), dtype=self.reduce_dtype, device=sent.device)
        work = reduce_scatter_flat(out, sent, group=self.group, async_op=True)
        return Reduction(out, work, scattered, sent, across, reduced)

    def accumulate(self, flat_grad: torch.Tensor) -> None:
        """Keep a micro-step's flat gradient for the next reduce-scatter (``no_sync``), summed
        in ``reduce_dtype`` as torch FSDP2 accumulates without gradient sync."""
        if self.unsynced is None:
            self.unsynced = flat_grad.to(self.reduce_dtype)
        else:
            self.unsynced.add_(flat_grad)

    def with_unsynced(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """``flat_grad`` plus the gradients :meth:`accumulate` kept (which it hands over)."""
        if self.unsynced is None:
            return flat_grad
        total, self.unsynced = self.unsynced, None
        return total.add_(flat_grad)
