"""What a FullyShardedDataParallel model is made of, as data: its units, names and group.

The wrapper builds one :class:`FsdpLayout` at construction and hands it to everything that
works on the sharded model from outside its forward and backward (the checkpoints in
:mod:`tandem.parallel.fsdp.state`), so that those read a record, not the wrapper's attributes,
and never import the wrapper back.

The plain module's names (its ``state_dict()`` keys, its parameters' order) must be read
*before* the units are built: flattening removes the trainable parameters from their modules.
:class:`PlainNames` is that reading; :meth:`PlainNames.key_fqn` maps it onto the units after.

Example::

    names = PlainNames.of(module)                        # before flattening
    units = [FlatUnit(...), ...]                         # removes the parameters
    layout = FsdpLayout(module, tuple(units), unit_names, 3, group, rank, world_size,
                        names.state_keys, names.param_fqns, names.key_fqn(units), mesh, True)
    layout.signature()                                   # [[(fqn, shape), ...] per unit]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch.distributed as dist
from torch import nn

from tandem.parallel.fsdp.flat import FlatUnit
from tandem.parallel.fsdp.mesh import FsdpMesh

# Per unit, its parameters' (fqn, shape) in flat-buffer order: what a sharded checkpoint was cut
# by, and must match to load.
Signature = list[list[tuple[str, tuple[int, ...]]]]


@dataclass(frozen=True)
class PlainNames:
    """The unwrapped module's names, read before its trainable parameters are flattened.

    ``registrations`` holds ``(state_dict key, fqn)`` for every registration of a parameter,
    the fqn being its first registration's name (a tied weight has several keys, one fqn).
    """

    state_keys: tuple[str, ...]
    param_fqns: tuple[str, ...]
    registrations: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, module: nn.Module) -> PlainNames:
        first: dict[int, str] = {}
        registrations = tuple(
            (key, first.setdefault(id(p), key))
            for key, p in module.named_parameters(remove_duplicate=False)
        )
        return cls(
            state_keys=tuple(module.state_dict().keys()),
            param_fqns=tuple(name for name, _ in module.named_parameters()),
            registrations=registrations,
        )

    def key_fqn(self, units: Sequence[FlatUnit]) -> Mapping[str, str]:
        """Every ``state_dict`` key of a flattened parameter -> the fqn its unit knows it by."""
        flattened = {e.fqn for u in units for e in u.entries}
        return MappingProxyType({key: fqn for key, fqn in self.registrations if fqn in flattened})


@dataclass(frozen=True, eq=False)
class FsdpLayout:
    """One FullyShardedDataParallel model as data (built once, by the wrapper).

    Attributes:
        module: the wrapped module; it keeps the buffers and frozen parameters (replicated),
            and views of the units' gathered buffers under the flattened parameters' names.
        units: the flat units in construction order; each holds its shard (``unit.shard``,
            this rank's slice, the parameter the optimizer steps) and its parameters' names,
            shapes and offsets (``unit.entries``).
        unit_names: each unit's module name, in the same order (``""``: the root).
        stage: 2 (whole parameters kept between steps) or 3 (freed after use).
        process_group: the group the units are sharded over (None: the default group); with
            hybrid sharding the mesh's shard group (its row).
        rank: this process's rank in ``process_group``.
        world_size: the size of ``process_group``.
        state_keys: the plain module's ``state_dict()`` keys, in its order.
        param_fqns: the plain module's ``named_parameters()`` names, in order: the ids a plain
            optimizer over ``module.parameters()`` gives them.
        key_fqn: every ``state_dict`` key of a flattened parameter -> its fqn in its unit (tied
            weights: several keys, one fqn).
        mesh: the shard group, the replicate group (hybrid sharding) and the grid's ranks
            (:mod:`tandem.parallel.fsdp.mesh`).
        reshard_after_forward: torch's setting: True (stage 3), False (stage 2), or the size
            of the post-forward groups that keep a unit between its forward and its backward.
    """

    module: nn.Module
    units: tuple[FlatUnit, ...]
    unit_names: tuple[str, ...]
    stage: int
    process_group: dist.ProcessGroup | None
    rank: int
    world_size: int
    state_keys: tuple[str, ...]
    param_fqns: tuple[str, ...]
    key_fqn: Mapping[str, str]
    mesh: FsdpMesh
    reshard_after_forward: bool | int

    def label(self, unit: FlatUnit) -> str:
        """How messages name ``unit``: its index and module (``#0 'inp'``, ``#2 (root)``)."""
        name = self.unit_names[unit.index]
        return f"#{unit.index} {name!r}" if name else f"#{unit.index} (root)"

    def signature(self) -> Signature:
        """Per unit, its parameters' ``(fqn, shape)``: what the shards were cut by."""
        return [[(e.fqn, tuple(e.shape)) for e in unit.entries] for unit in self.units]
