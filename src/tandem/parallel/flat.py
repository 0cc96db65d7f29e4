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

Example::

    unit = FlatUnit(0, entries, group=None, device=cpu)  # entries: (fqn, locations, param)
    unit.gather()                                        # all-gather; attributes are views
    leaf = unit.attach(requires_grad=True)
    unit.free()                                          # stage 3, after forward
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tandem._dist import global_rank, group_rank, group_size
from tandem.parallel.sharding import flat_shard, padded_numel

# torch 2.13 renamed the flat collectives; older versions (tandem supports 2.4+) lack the new
# names, and the old ones warn on new versions.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def mean_divisors(dtype: torch.dtype, world_size: int) -> tuple[float | None, float | None]:
    """The divisors ``(before, after)`` that make a reduce-scatter's sum a mean (None: none).

    torch FSDP2's rule, so that the two agree bit for bit: float32 and bfloat16 sum first and
    divide the slice after (1/N of the elements to divide; on Gloo exactly what FSDP2's
    ``ReduceOp.AVG`` computes). Other dtypes, float16's narrow range in mind, divide by a power
    of two near sqrt(N) before the sum and by the rest after, so that the sum neither overflows
    nor underflows.
    """
    if world_size == 1:
        return None, None
    if dtype in (torch.float32, torch.bfloat16):
        return None, float(world_size)
    before = 1
    while world_size % before == 0 and world_size / before > before:
        before *= 2
    after = world_size / before
    return (float(before) if before > 1 else None), (after if after != 1 else None)


@dataclass(frozen=True)
class Entry:
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


class FlatUnit:
    """The flat, sharded parameters of one unit (see the module docstring).

    Args:
        index: the unit's position in its wrapper (names its shard parameter).
        params: ``(fqn, locations, parameter)`` of every trainable parameter of the unit, with
            ``locations`` the ``(module, name)`` pairs it is registered as (several when tied);
            identical values on every rank, one dtype.
        group: the process group sharing the unit.
        device: where the shard and the gathered buffer live.
    """

    def __init__(
        self,
        index: int,
        params: list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter]],
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        dtypes = {p.dtype for *_, p in params}
        if len(dtypes) != 1:
            described = ", ".join(f"{fqn} ({p.dtype})" for fqn, *_, p in params)
            raise ValueError(
                f"tandem.FullyShardedDataParallel: one wrapped unit holds parameters of several "
                f"dtypes: {described}. Give them one dtype (module.to(dtype)) or wrap the "
                "submodules of each dtype as their own units (auto_wrap)"
            )
        self.index = index
        self.group = group
        self.world_size = group_size(group)
        self.rank = group_rank(group)
        self.entries: list[Entry] = []
        offset = 0
        for fqn, locations, p in params:
            self.entries.append(Entry(fqn, tuple(locations), p.shape, offset))
            offset += p.numel()
        self.numel = offset
        self.padded = padded_numel(self.numel, self.world_size)
        # This rank's slice of the flat buffer: the one sharding rule, asked once.
        self.own = slice(*flat_shard(self.numel, self.world_size, self.rank))
        self.split_sizes = [e.numel for e in self.entries]
        if self.padded > self.numel:
            self.split_sizes.append(self.padded - self.numel)
        with torch.no_grad():
            flat = self._flatten({fqn: p for fqn, _, p in params}, dtypes.pop(), device)
            if self.world_size > 1:
                # Rank 0's values everywhere, one unit at a time on ``device``: a model built on
                # the CPU never has to fit on the device whole.
                dist.broadcast(flat, src=global_rank(group, 0), group=group)
            self.shard = nn.Parameter(flat[self.own].clone())
        for entry in self.entries:
            for module, name in entry.locations:
                del module._parameters[name]
        # The broadcast buffer already holds every rank's values: it is the first gathered
        # ``full``, so construction needs no all-gather.
        self.full = flat
        self._gathering: dist.Work | None = None  # a prefetch's all-gather in flight
        # The shard's version when ``full`` was last filled from it: unchanged means ``full`` is
        # still current (stage 2 keeps it between steps and skips the all-gather).
        self._gathered_version: int | None = self.shard._version

    def _flatten(
        self, values: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | None
    ) -> torch.Tensor:
        """One padded flat buffer from full-size ``values`` by fqn, in the unit's layout."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for e in self.entries:
            flat[e.offset : e.offset + e.numel].copy_(values[e.fqn].reshape(-1))
        return flat

    # -- the gathered buffer -------------------------------------------------------------------

    @property
    def is_gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    @property
    def is_current(self) -> bool:
        return self.is_gathered and self._gathered_version == self.shard._version

    def gather(self, async_op: bool = False) -> None:
        """Fill ``full`` from every rank's shard (one all-gather), unless it is current.

        With ``async_op`` the all-gather is only started (a prefetch); the next plain
        ``gather()`` or ``free()`` waits for it.
        """
        if self._gathering is not None:
            if not async_op:
                self._gathering.wait()
                self._gathering = None
            return
        if self.is_current:
            return
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.padded * self.full.element_size())
        target = _alias(self.full)
        with torch.no_grad():
            if self.world_size == 1:
                target.copy_(self.shard)
            else:
                work = all_gather_flat(
                    target, self.shard.detach(), group=self.group, async_op=async_op
                )
                self._gathering = work if async_op else None
        self._gathered_version = self.shard._version

    def invalidate(self) -> None:
        """Mark ``full`` stale: the shard changed in a way its version counter does not show
        (fused optimizers write through kernels that do not bump it)."""
        self._gathered_version = None

    def free(self) -> None:
        """Release ``full``'s memory; views of it stay valid objects until the next gather."""
        if self._gathering is not None:  # never free what a collective is writing into
            self._gathering.wait()
            self._gathering = None
        self.full.untyped_storage().resize_(0)
        self._gathered_version = None

    def attach(self, requires_grad: bool) -> torch.Tensor | None:
        """Point the module attributes at views of ``full``; the autograd leaf, if any.

        With ``requires_grad`` the views come from a fresh leaf aliasing ``full``, whose
        gradient is the unit's flat gradient (see the module docstring).
        """
        leaf = _alias(self.full)
        if requires_grad:
            leaf.requires_grad_(True)
        pieces = torch.split(leaf, self.split_sizes)
        for entry, piece in zip(self.entries, pieces, strict=False):
            view = piece.view(entry.shape)
            for module, name in entry.locations:
                setattr(module, name, view)
        return leaf if requires_grad else None

    def writeback(self) -> None:
        """Copy this rank's slice of ``full`` into the shard (after the caller edited views)."""
        with torch.no_grad():
            self.shard.copy_(self.full[self.own])
        self._gathered_version = self.shard._version

    # -- gradients -----------------------------------------------------------------------------

    def reduce_scatter(
        self, flat_grad: torch.Tensor
    ) -> tuple[torch.Tensor, dist.Work | None, float | None]:
        """Start summing ``flat_grad`` over the ranks into this rank's slice.

        Returns the slice's buffer, the work to wait on and the divisor that makes the slice a
        mean once the work is done (:func:`mean_divisors`); (``flat_grad``, None, None) when
        there is nothing to send. ``flat_grad`` may be divided in place first.
        """
        if self.world_size == 1:
            return flat_grad, None, None
        before, after = mean_divisors(flat_grad.dtype, self.world_size)
        if before is not None:
            flat_grad.div_(before)
        out = torch.empty_like(self.shard)
        work = reduce_scatter_flat(out, flat_grad, group=self.group, async_op=True)
        return out, work, after

    def full_values(self) -> dict[str, torch.Tensor]:
        """The gathered parameters as ``{fqn: tensor}`` views of ``full`` (gather first)."""
        return {e.fqn: self.full[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries}

    def shard_of(
        self, values: dict[str, torch.Tensor], dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """This rank's slice of the flat buffer built from full-size ``values`` by fqn (CPU)."""
        return self._flatten(values, dtype or self.shard.dtype, None)[self.own]
