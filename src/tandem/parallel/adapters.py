"""One state adapter per wrapper: how its model or optimizer is saved, checked, loaded, resharded.

Whatever wraps a model (nothing, tandem.DDP, DataParallel, torch's DDP, torch.compile,
tandem.FullyShardedDataParallel) and whatever optimizer steps it (a plain one, a
tandem.ShardedOptimizer, one over an FSDP model's shards), a checkpoint asks the same few
things of it: its full state (gathered where sharded), this rank's shard, whether a saved state
fits, how to load either, and how to cut a shard saved at another world size. Each wrapper
answers them in one class here:

- :class:`PlainModel`: a module, also under tandem.DDP (whose bucket order it saves too),
  DataParallel, torch's DDP or torch.compile: its ``state_dict()`` is whole on every rank;
- :class:`ShardedModel`: tandem.FullyShardedDataParallel: full (gathered to one rank) or
  sharded (each rank's flat shards), resharded across world sizes;
- :class:`PlainOptimizer`: any torch optimizer over whole parameters;
- :class:`ZeroOptimizer`: tandem.ShardedOptimizer (ZeRO-1): each rank holds its own
  parameters' state;
- :class:`ShardOptimizer`: an optimizer over an FSDP model's shards: element-wise state cut
  like the shards.

:func:`model_state` and :func:`optimizer_state` pick the adapter; they are the only places that
look at what they were given. The engines (:mod:`tandem.parallel.engine`) and the checkpoint
entries (:mod:`tandem.checkpoint.entries`) both go through the adapters, so the rule of each
checkpoint kind is written once, here (:meth:`StateAdapter.save`, :meth:`StateAdapter.load`),
and nothing outside ``tandem.parallel`` asks which wrapper it holds.

Example::

    model = model_state(fsdp_model)                    # ShardedModel
    optimizer = optimizer_state(opt, model)            # ShardOptimizer
    full, shard = model.save("sharded")                # None, this rank's flat shards
    model.check("state['model']", None, shard)         # ValueError if it does not fit
    model.load(None, shard)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem._dist import agree, global_ranks, group_rank
from tandem.parallel.ddp.wrapper import DistributedDataParallel
from tandem.parallel.dp.wrapper import DataParallel
from tandem.parallel.fsdp import reshard as fsdp_reshard
from tandem.parallel.fsdp.flat import FlatUnit
from tandem.parallel.fsdp.state import (
    SHARDED_FORMAT,
    _first_keys_difference,
    _PlainIndex,
    load_by_plain_order,
    mesh_record,
)
from tandem.parallel.fsdp.wrapper import FullyShardedDataParallel
from tandem.parallel.zero import ShardedOptimizer

#: ``read(q)``: saved rank q's shard file part for this object.
Reader = Callable[[int], dict[str, Any]]


def unwrap(model: nn.Module) -> tuple[nn.Module, Any]:
    """The module whose state a checkpoint holds, and tandem.DDP's reducer if it was wrapped.

    Wrappers that only prefix the keys (tandem.DDP, DataParallel, torch's DDP, torch.compile)
    are taken off; an FSDP model is returned as it is (its state is the plain module's).

    Example::

        >>> unwrap(nn.DataParallel(nn.Linear(2, 2)))[0]
        Linear(in_features=2, out_features=2, bias=True)
    """
    reducer = None
    while True:
        if isinstance(model, DistributedDataParallel):
            reducer = model.reducer
            model = model.module
        elif isinstance(
            model, DataParallel | nn.DataParallel | nn.parallel.DistributedDataParallel
        ):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(
            inner := getattr(model, "_orig_mod", None), nn.Module
        ):
            model = inner  # torch.compile's wrapper
        else:
            return model, reducer


class StateAdapter:
    """What a checkpoint needs of one model or optimizer (see the module doc).

    ``save(kind)`` gives ``(full, shard)``: what rank 0's file holds (None where the kind is
    ``"sharded"`` and the object is sharded) and this rank's shard (None unless then). ``load``
    takes the same pair, after ``check`` found that it fits.
    """

    #: Whether the object holds shards (so the ``"sharded"`` kind has something to write).
    sharded: bool = False
    #: Whether it gives this rank's elements of each tensor as :class:`FlatPiece` runs
    #: (``pieces()`` / ``empty_pieces()`` / ``load_pieces()``): what DCP's sharded
    #: checkpoints write and read, with no gather.
    pieced: bool = False

    def full(self, to: int = 0) -> Any:
        """The whole state on rank ``to`` (a collective where sharded); replicated objects
        give it on every rank."""
        raise NotImplementedError

    def shard(self) -> dict[str, Any]:
        """This rank's shard of the state (sharded objects only)."""
        raise NotImplementedError

    def load_full(self, state: Any) -> None:
        raise NotImplementedError

    def load_shard(self, shard: Any) -> None:
        raise NotImplementedError

    def check(self, what: str, saved: Any, shard: Any) -> None:
        """ValueError, naming ``what`` and what differs, unless the saved state fits."""
        raise NotImplementedError

    def reshard(self, what: str, saved_world_size: int, read: Reader) -> Any:
        """This rank's shard, cut from the saved ranks' parts that overlap it."""
        raise NotImplementedError

    def save(self, kind: str) -> tuple[Any, Any]:
        """``(full, None)``, or ``(None, this rank's shard)`` for a sharded object and kind."""
        if kind == "sharded" and self.sharded:
            return None, self.shard()
        return self.full(0), None

    def load(self, full: Any, shard: Any) -> None:
        """Load what :meth:`save` gave (this rank's shard where it gave one)."""
        if shard is not None:
            self.load_shard(shard)
        else:
            self.load_full(full)


# -- this rank's elements of each tensor (DCP's sharded checkpoints) -----------------------------


@dataclass(frozen=True)
class FlatPiece:
    """A run of one tensor's elements that this rank holds.

    ``values`` (1-D) are the elements ``[start, start + values.numel())`` of a tensor of
    ``shape``, counted in row-major order: a flat FSDP shard cuts each parameter so, wherever
    the unit's flat buffer was cut, not along its rows.

    Example::

        >>> piece = FlatPiece(torch.Size([3, 4]), 5, torch.arange(4.0))   # elements 5..8
        >>> piece.stop
        9
    """

    shape: torch.Size
    start: int
    values: torch.Tensor

    @property
    def stop(self) -> int:
        return self.start + self.values.numel()


def _unit_pieces(unit: FlatUnit, flat: torch.Tensor) -> dict[str, FlatPiece]:
    """``{fqn: piece}`` of every parameter of the unit: the elements of it that ``flat`` (a
    tensor shaped like this rank's shard: the shard, an optimizer state of it, a buffer to read
    into) holds, as a view of ``flat``; an empty run where it holds none. The padding belongs to
    no parameter and is left out."""
    own = unit.own
    out: dict[str, FlatPiece] = {}
    for e in unit.entries:
        lo, hi = max(own.start, e.offset), min(own.stop, e.offset + e.numel)
        if hi > lo:
            out[e.fqn] = FlatPiece(e.shape, lo - e.offset, flat[lo - own.start : hi - own.start])
        else:
            out[e.fqn] = FlatPiece(e.shape, 0, flat[:0])
    return out


#: Buffers an optimizer's state is read into, by ``(id(shard parameter), state key)``.
PieceBuffers = dict[tuple[int, str], torch.Tensor]


# -- models -------------------------------------------------------------------------------------


class ModelState(StateAdapter):
    """A model's adapter: its state, and what a training loop asks of its forward."""

    #: The module whose state is saved: the plain module, or the FSDP wrapper itself.
    target: nn.Module
    #: tandem.DDP's reducer (its bucket order is saved beside the model), or None.
    reducer: Any = None

    @property
    def eval_model(self) -> nn.Module:
        """What evaluation calls: the plain module (no collectives, so ranks' unequal shards of
        the evaluation set are fine), or a wrapper whose forward must run on every rank."""
        return self.target

    @property
    def forward_is_collective(self) -> bool:
        """Whether every forward is a collective (FSDP gathers its units): ranks must run the
        same number of them, evaluation included."""
        return False

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return None

    @property
    def layout_fixed(self) -> bool:
        """Whether a wrapper has laid out the parameters already (tandem.DDP's buckets, FSDP's
        flat shards): converting the module's dtype now would not reach them."""
        return self.reducer is not None

    @property
    def mixed_precision(self) -> Any:
        """The wrapper's own mixed precision policy (FSDP's), or None."""
        return None

    def set_mixed_precision(self, policy: Any) -> None:
        raise ValueError(f"{type(self.target).__name__} takes no mixed precision policy")

    def grad_scaler(self, device_type: str) -> torch.amp.GradScaler:
        """The GradScaler that fp16 needs with this model (one that agrees across ranks where
        gradients are sharded)."""
        return torch.amp.GradScaler(device_type)

    def plain_weights(self, to: int = 0) -> dict[str, torch.Tensor] | None:
        """The user's module's ``state_dict()``, whole, on rank ``to``; None on the others."""
        raise NotImplementedError

    def shard_owners(self) -> dict[int, ModelState]:
        """``id`` of each shard parameter an optimizer may step -> this model (FSDP's)."""
        return {}

    def pieces(self, flats: Sequence[torch.Tensor] | None = None) -> dict[str, FlatPiece]:
        """This rank's elements of each sharded tensor, by key (:attr:`pieced` models only)."""
        raise NotImplementedError

    def replicated(self) -> dict[str, torch.Tensor]:
        """The state every rank holds whole (:attr:`pieced` models only)."""
        raise NotImplementedError

    def empty_pieces(self) -> tuple[dict[str, FlatPiece], list[torch.Tensor]]:
        """Pieces to read into, and the buffers under them (:attr:`pieced` models only)."""
        raise NotImplementedError

    def load_pieces(self, flats: Sequence[torch.Tensor], replicated: Mapping[str, Any]) -> None:
        """Load what :meth:`empty_pieces` was read into (:attr:`pieced` models only)."""
        raise NotImplementedError

    def engine_state(self) -> Any:
        """tandem.DDP's bucket order (None without one)."""
        return self.reducer.state_dict() if self.reducer is not None else None

    def load_engine_state(self, state: Any) -> None:
        # A checkpoint of a model that was not wrapped in tandem.DDP has no bucket order: the
        # reducer then learns its buckets again, as after construction (bitwise resumes need
        # the saved ones at 3+ ranks, where Gloo's sums round differently when buckets move).
        if self.reducer is not None and state is not None:
            self.reducer.load_state_dict(state)

    def check(self, what: str, saved: Any, shard: Any) -> None:
        if shard is not None:
            self._check_shard(what, shard)
            return
        if not isinstance(saved, Mapping):
            raise ValueError(
                f"{what}: the checkpoint holds {type(saved).__name__} where a model's state "
                "dict belongs (a sharded model's state saved without its shard files?)"
            )
        check_keys_and_shapes(what, "model", self.expected_shapes(), saved)

    def expected_shapes(self) -> dict[str, tuple[int, ...] | None]:
        """The plain module's ``state_dict()`` keys and tensor shapes (None: not a tensor)."""
        return {k: _shape(v) for k, v in self.target.state_dict().items()}

    def _check_shard(self, what: str, shard: Any) -> None:
        raise self._not_sharded(what)

    def reshard(self, what: str, saved_world_size: int, read: Reader) -> Any:
        raise self._not_sharded(what)

    def grid(self) -> dict[str, list[int]] | None:
        """The grid its shard files are cut on (FSDP's shard and replicate groups, as global
        ranks), recorded in each file so that a load can tell layouts apart; None for a model
        that writes no shard files."""
        return None

    def one_copy(
        self, saved_world_size: int, read: Reader, first: Callable[[Any], Any]
    ) -> tuple[int, Reader]:
        """The saved shard files as one copy of every slice (``(count, read)``): a hybrid
        run's files hold a copy per replica (:func:`tandem.parallel.fsdp.reshard.one_copy`);
        the files of any other model come back as they are."""
        return saved_world_size, read

    def _not_sharded(self, what: str) -> ValueError:
        return ValueError(
            f"{what}: the checkpoint holds the shards of a tandem.FullyShardedDataParallel "
            f"model (kind='sharded'), and this is a {type(self.target).__name__}: load it into "
            "an FSDP model of the same module (at any world size), or save with "
            "kind='full', which loads into any model"
        )


class PlainModel(ModelState):
    """A module whose every rank holds it whole (plain, or under a wrapper that only prefixes
    its keys; tandem.DDP's bucket order is saved as the engine's state)."""

    def __init__(self, module: nn.Module, reducer: Any = None) -> None:
        self.target = module
        self.reducer = reducer

    def full(self, to: int = 0) -> dict[str, Any]:
        return self.target.state_dict()

    def load_full(self, state: Any) -> None:
        self.target.load_state_dict(state)

    def plain_weights(self, to: int = 0) -> dict[str, torch.Tensor] | None:
        if group_rank() != to:
            return None
        return {k: v.detach().clone() for k, v in self.target.state_dict().items()}


class ShardedModel(ModelState):
    """tandem.FullyShardedDataParallel: the full state gathered to one rank, or each rank's
    flat shards as they are; a sharded state is cut anew for another world size."""

    sharded = True
    pieced = True

    def __init__(self, fsdp: FullyShardedDataParallel) -> None:
        self.target = fsdp
        self.fsdp = fsdp

    @property
    def forward_is_collective(self) -> bool:
        return True

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self.fsdp.process_group

    @property
    def layout_fixed(self) -> bool:
        return True

    @property
    def mixed_precision(self) -> Any:
        return self.fsdp.mixed_precision

    def set_mixed_precision(self, policy: Any) -> None:
        self.fsdp.set_mixed_precision(policy)

    def grad_scaler(self, device_type: str) -> torch.amp.GradScaler:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type, process_group=self.fsdp.process_group)

    def full(self, to: int = 0) -> dict[str, Any] | None:
        return self.fsdp.full_state_dict(to)

    def shard(self) -> dict[str, Any]:
        return self.fsdp.sharded_state_dict()

    def load_full(self, state: Any) -> None:
        self.fsdp.load_full_state_dict(state)

    def load_shard(self, shard: Any) -> None:
        self.fsdp.load_sharded_state_dict(shard)

    def plain_weights(self, to: int = 0) -> dict[str, torch.Tensor] | None:
        return self.fsdp.full_state_dict(to)

    def shard_owners(self) -> dict[int, ModelState]:
        return {id(unit.shard): self for unit in self.fsdp.units}

    def pieces(self, flats: Sequence[torch.Tensor] | None = None) -> dict[str, FlatPiece]:
        """This rank's elements of every flattened parameter, by ``state_dict`` key (each key
        of a tied parameter), as views of ``flats`` (one shard-shaped tensor per unit; default:
        the shards themselves). No communication: no rank ever holds a whole parameter here."""
        units = self.fsdp.layout.units
        flats = [u.shard.detach() for u in units] if flats is None else flats
        by_fqn: dict[str, FlatPiece] = {}
        for unit, flat in zip(units, flats, strict=True):
            by_fqn.update(_unit_pieces(unit, flat))
        return {key: by_fqn[fqn] for key, fqn in self.fsdp.layout.key_fqn.items()}

    def replicated(self) -> dict[str, torch.Tensor]:
        """The state every rank holds whole: buffers and frozen parameters, by key."""
        return dict(self.fsdp.layout.module.state_dict())

    def empty_pieces(self) -> tuple[dict[str, FlatPiece], list[torch.Tensor]]:
        """Pieces to read this rank's elements into (:meth:`pieces` of fresh zeroed buffers)
        and those buffers, for :meth:`load_pieces`."""
        flats = [torch.zeros_like(u.shard, requires_grad=False) for u in self.fsdp.layout.units]
        return self.pieces(flats), flats

    def load_pieces(self, flats: Sequence[torch.Tensor], replicated: Mapping[str, Any]) -> None:
        """Load the buffers of :meth:`empty_pieces`, read, as the shards, and the
        replicated state (buffers, frozen parameters) into the module."""
        layout = self.fsdp.layout
        with torch.no_grad():
            for unit, flat in zip(layout.units, flats, strict=True):
                unit.shard.copy_(flat)  # a new version: a kept ``full`` (stage 2) is stale now
        layout.module.load_state_dict(dict(replicated))

    def expected_shapes(self) -> dict[str, tuple[int, ...] | None]:
        layout = self.fsdp.layout
        by_fqn = {e.fqn: tuple(e.shape) for unit in layout.units for e in unit.entries}
        rest = layout.module.state_dict()  # buffers and frozen parameters, whole on every rank
        return {
            key: by_fqn[layout.key_fqn[key]] if key in layout.key_fqn else _shape(rest.get(key))
            for key in layout.state_keys
        }

    def _check_shard(self, what: str, shard: Any) -> None:
        layout = self.fsdp.layout
        if not isinstance(shard, Mapping) or shard.get("format") != SHARDED_FORMAT:
            raise ValueError(f"{what}: the shard file does not hold FSDP shards ({SHARDED_FORMAT})")
        saved = (shard["rank"], shard["world_size"])
        if saved != (layout.rank, layout.world_size):
            raise ValueError(
                f"{what}: the shards of rank {saved[0]} of {saved[1]} cannot load into rank "
                f"{layout.rank} of {layout.world_size}"
            )
        cut = [[(f, tuple(s)) for f, s in unit] for unit in shard["layout"]]
        if cut != layout.signature():
            raise ValueError(
                f"{what}: the shards were cut from another model or auto_wrap (units "
                f"{_units(cut)}; this model's: {_units(layout.signature())}): wrap the same "
                "model the same way, or save with kind='full'"
            )
        rest = {k: _shape(v) for k, v in layout.module.state_dict().items()}
        check_keys_and_shapes(what, "model (buffers, frozen parameters)", rest, shard["rest"])

    def grid(self) -> dict[str, list[int]] | None:
        return mesh_record(self.fsdp.layout)

    def one_copy(
        self, saved_world_size: int, read: Reader, first: Callable[[Any], Any]
    ) -> tuple[int, Reader]:
        return fsdp_reshard.one_copy(saved_world_size, read, first)

    def reshard(self, what: str, saved_world_size: int, read: Reader) -> dict[str, Any]:
        """This rank's ``sharded_state_dict()``, cut from the ``"model"`` parts of the saved
        ranks that overlap this one (:mod:`tandem.parallel.fsdp.reshard`)."""
        layout = self.fsdp.layout
        files = {q: read(q) for q in fsdp_reshard.source_ranks(layout, saved_world_size)}
        return fsdp_reshard.reshard_sharded_state_dict(layout, parts(files, "model"))


# -- optimizers ---------------------------------------------------------------------------------


class OptimizerState(StateAdapter):
    """An optimizer's adapter (see the module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def cut_alike(self, shard: Any) -> bool:
        """Whether this rank's own saved shard fits it as it is (only a sharded optimizer's
        may not: :class:`ZeroOptimizer`)."""
        return True

    def full(self, to: int = 0) -> dict[str, Any] | None:
        return self.optimizer.state_dict()

    def shard(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_full(self, state: Any) -> None:
        self.optimizer.load_state_dict(state)

    def load_shard(self, shard: Any) -> None:
        self.optimizer.load_state_dict(shard)

    def param_counts(self) -> list[int]:
        """Parameters per group, as the full state dict counts them."""
        return [len(g["params"]) for g in self.optimizer.param_groups]

    def pieces(self) -> dict[str, Any]:
        """The state by parameter name, element-wise values as pieces (:attr:`pieced` only)."""
        raise NotImplementedError

    def empty_pieces(
        self, saved: Mapping[str, Mapping[str, tuple[torch.Size, torch.dtype]]]
    ) -> tuple[dict[str, dict[str, FlatPiece]], PieceBuffers]:
        """Pieces to read into, and the buffers under them (:attr:`pieced` only)."""
        raise NotImplementedError

    def load_pieces(self, state: Mapping[str, Any], buffers: PieceBuffers) -> None:
        """Load what :meth:`empty_pieces` was read into (:attr:`pieced` only)."""
        raise NotImplementedError

    def full_names(self) -> list[str] | None:
        """The parameter name of each position of the full state dict, where this adapter
        knows them; None: the positions are the optimizer's own parameters, in order (the
        model that holds them names them)."""
        return None

    def full_positions(self, group: dict[str, Any]) -> list[int] | None:
        """The positions in the full state dict of ``group``'s parameters; None: the groups'
        parameters in order."""
        return None

    def owned(self) -> list[bool] | None:
        """Where each rank holds only its own parameters' state (ZeRO-1): whether this rank
        holds each parameter's, by position in the full state dict. None: the state is held
        whole on every rank, or in pieces (:attr:`pieced`)."""
        return None

    def owned_state(self) -> dict[int, dict[str, Any]]:
        """The state of the parameters this rank owns (:meth:`owned`), by position in the full
        state dict, gathering nothing; empty where another rank writes the same state (a
        hybrid optimizer's nodes each hold all of it: global rank 0's node gives it)."""
        raise NotImplementedError

    def check(self, what: str, saved: Any, shard: Any) -> None:
        if shard is not None:
            self._check_shard(what, shard)
            return
        check_groups(what, self.param_counts(), saved)

    def _check_shard(self, what: str, shard: Any) -> None:
        raise ValueError(
            f"{what}: the checkpoint holds one rank's shard of a sharded optimizer's state "
            f"(kind='sharded'), and this {type(self.optimizer).__name__} is not sharded: save "
            "with kind='full', which loads into any optimizer over the same parameters"
        )

    def reshard(self, what: str, saved_world_size: int, read: Reader) -> dict[str, Any]:
        raise ValueError(
            f"the checkpoint holds a sharded optimizer state, and this optimizer "
            f"{type(self.optimizer).__name__} is not sharded: load it with the set-up that wrote "
            "it (a tandem.ShardedOptimizer, or an optimizer over a "
            "tandem.FullyShardedDataParallel model's shards), or save a full checkpoint"
        )


class PlainOptimizer(OptimizerState):
    """Any torch optimizer over whole parameters: its ``state_dict()`` on every rank."""


class ZeroOptimizer(OptimizerState):
    """tandem.ShardedOptimizer: the full state gathered to one rank, or this rank's own
    parameters' state; a saved shard is regrouped by the parameters' owners at another size."""

    sharded = True
    optimizer: ShardedOptimizer

    def full(self, to: int = 0) -> dict[str, Any] | None:
        return self.optimizer.full_state_dict(to)

    def load_full(self, state: Any) -> None:
        self.optimizer.load_full_state_dict(state)

    def owned(self) -> list[bool] | None:
        opt = self.optimizer
        return [owner == opt.rank for owner in opt.owners]

    def owned_state(self) -> dict[int, dict[str, Any]]:
        opt = self.optimizer
        if 0 not in global_ranks(opt.process_group):
            return {}  # another node's ranks hold the same state, and write it
        inner = opt.optimizer.state_dict()  # by inner position: this rank's own parameters
        index = {id(p): i for i, p in enumerate(opt.params)}
        where = [index[id(p)] for g in opt.optimizer.param_groups for p in g["params"]]
        return {where[k]: dict(s) for k, s in inner["state"].items()}

    def cut_alike(self, shard: Any) -> bool:
        """Whether this rank's own saved shard was cut for the place it has now (the same rank,
        world size and owners within the group the state is sharded over): at the same world
        size on another layout (2 nodes x 2 against one node of 4) it was not, and the load
        regroups the state as at another world size (:meth:`reshard`)."""
        opt = self.optimizer
        if not isinstance(shard, Mapping):
            return True  # no shard of it here: check() names what is wrong
        got = (shard.get("rank"), shard.get("world_size"), shard.get("owners"))
        return got == (opt.rank, opt.world_size, list(opt.owners))

    def _check_shard(self, what: str, shard: Any) -> None:
        opt = self.optimizer
        got = (shard.get("rank"), shard.get("world_size"), shard.get("owners"))
        mine = (opt.rank, opt.world_size, list(opt.owners))
        if got != mine:
            raise ValueError(
                f"{what}: the optimizer shard of rank {got[0]} of {got[1]} (owners "
                f"{got[2]}) cannot load into rank {mine[0]} of {mine[1]} (owners {mine[2]}); "
                "ranks and world sizes count within the group the state is sharded over (a "
                "hybrid run's node): at the same world size the layout must be the one that "
                "saved it; save with kind='full' to load into any layout"
            )

    def reshard(self, what: str, saved_world_size: int, read: Reader) -> dict[str, Any]:
        """The state of the parameters this rank owns now, from their old owners
        (:meth:`tandem.parallel.zero.ShardedOptimizer.reshard_state_dicts`).

        The saved state was cut over the ``row`` saved rank 0's file names (a hybrid run's
        node; every rank of a flat run, whose older files name none): each slice is read from
        that row's files, whatever the other nodes hold (the same again)."""
        first = read(0)
        if isinstance(first, dict) and "model" in first:
            raise ValueError(
                "the shard files hold FSDP model shards; this model is not a "
                "tandem.FullyShardedDataParallel"
            )
        row = list(parts({0: first}, "optimizer")[0].get("row") or range(saved_world_size))
        needed = self.optimizer.source_ranks(len(row))
        files = {s: read(row[s]) for s in needed}  # keyed by the saved rank within the row
        return self.optimizer.reshard_state_dicts(parts(files, "optimizer"))


class ShardOptimizer(OptimizerState):
    """An optimizer over an FSDP model's shards: the full state names the plain module's
    parameters (gathered to one rank); a shard's element-wise state is cut like the shards."""

    sharded = True
    pieced = True

    def __init__(self, optimizer: torch.optim.Optimizer, owner: ShardedModel) -> None:
        super().__init__(optimizer)
        self.fsdp = owner.fsdp

    def full(self, to: int = 0) -> dict[str, Any] | None:
        return self.fsdp.full_optim_state_dict(self.optimizer, to)

    def load_full(self, state: Any) -> None:
        self.fsdp.load_full_optim_state_dict(self.optimizer, state)

    def param_counts(self) -> list[int]:
        # The full state names the plain module's parameters: a shard stands for its unit's.
        per_shard = {id(u.shard): len(u.entries) for u in self.fsdp.units}
        return [
            sum(per_shard.get(id(p), 1) for p in g["params"]) for g in self.optimizer.param_groups
        ]

    def full_names(self) -> list[str] | None:
        return list(self.fsdp.layout.param_fqns)  # the plain module's, in its order

    def full_positions(self, group: dict[str, Any]) -> list[int] | None:
        return _PlainIndex(self.fsdp.layout).group_ids(group)

    def _check_shard(self, what: str, shard: Any) -> None:
        check_groups(what, super().param_counts(), shard)

    def pieces(self) -> dict[str, Any]:
        """This optimizer's state in the plain layout by parameter name (what
        ``get_state_dict`` gives a plain optimizer: ``{"state": {name: {key: value}},
        "param_groups": [{..., "params": [names]}]}``), with each element-wise value (Adam's
        moments) as this rank's :class:`FlatPiece` of it and the per-parameter values (Adam's
        ``step``) as they are: the same on every rank. A collective: the ranks first compare
        which state they hold (a rank with other keys would write a checkpoint with holes)."""
        layout = self.fsdp.layout
        plain = _PlainIndex(layout)
        saved = self.optimizer.state_dict()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        agree(
            sorted(
                (i, sorted(saved["state"].get(i, {})))
                for i, p in enumerate(params)
                if id(p) in plain.units
            ),
            "the optimizer's state (which shards hold it, under which keys)",
            layout.process_group,
            explain=_first_keys_difference,
            fix="Step the optimizer on every rank alike before saving",
        )
        state: dict[str, dict[str, Any]] = {}
        for p in params:
            own = self.optimizer.state.get(p, {})
            unit = plain.units.get(id(p))
            if not own:
                continue
            if unit is None:  # a whole parameter (frozen in FSDP's eyes): the same everywhere
                state[plain.names[id(p)][0]] = dict(own)
                continue
            per_entry: dict[str, dict[str, Any]] = {e.fqn: {} for e in unit.entries}
            for key, value in own.items():
                if isinstance(value, torch.Tensor) and value.shape == unit.shard.shape:
                    for fqn, piece in _unit_pieces(unit, value.detach()).items():
                        per_entry[fqn][key] = piece
                else:
                    for slot in per_entry.values():
                        slot[key] = value
            state.update(per_entry)
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [layout.param_fqns[i] for i in plain.group_ids(group)],
            }
            for g, group in zip(saved["param_groups"], self.optimizer.param_groups, strict=True)
        ]
        names = {n: i for i, n in enumerate(layout.param_fqns)}
        return {
            "state": dict(sorted(state.items(), key=lambda kv: names[kv[0]])),
            "param_groups": groups,
        }

    def empty_pieces(
        self, saved: Mapping[str, Mapping[str, tuple[torch.Size, torch.dtype]]]
    ) -> tuple[dict[str, dict[str, FlatPiece]], PieceBuffers]:
        """Pieces to read this rank's elements of the checkpoint's element-wise state into,
        by parameter name and key, and the buffers under them (one shard-shaped tensor per
        shard and key) for :meth:`load_pieces`.

        ``saved``: the shape and dtype of every tensor of the checkpoint's state, by parameter
        name and key. A value shaped like its parameter is element-wise (for 0-d parameters,
        any but ``step``: tandem's rule for the full state); a 0-d one is per parameter, read
        whole. ValueError for one of any other shape: it fits no optimizer over this model.
        """
        out: dict[str, dict[str, FlatPiece]] = {}
        buffers: PieceBuffers = {}
        for unit in self.fsdp.layout.units:
            keys: dict[str, torch.dtype] = {}
            for e in unit.entries:
                for key, (shape, dtype) in saved.get(e.fqn, {}).items():
                    if tuple(shape) == tuple(e.shape) and (len(e.shape) or key != "step"):
                        keys[key] = dtype
                    elif len(shape):
                        raise ValueError(
                            f"the checkpoint's optimizer state {key!r} of {e.fqn} has shape "
                            f"{tuple(shape)}, its parameter {tuple(e.shape)}: it belongs to "
                            "another model"
                        )
            for key, dtype in keys.items():
                flat = torch.zeros(unit.shard.shape, dtype=dtype, device=unit.shard.device)
                buffers[(id(unit.shard), key)] = flat
                pieces = _unit_pieces(unit, flat)
                for e in unit.entries:
                    if key in saved.get(e.fqn, {}):
                        out.setdefault(e.fqn, {})[key] = pieces[e.fqn]
        return out, buffers

    def load_pieces(self, state: Mapping[str, Any], buffers: PieceBuffers) -> None:
        """Load a plain optimizer state dict by position (see :meth:`full`) whose element-wise
        values are the pieces of :meth:`empty_pieces`, read into ``buffers``: each shard's
        state is its buffers, its per-parameter values its first parameter's."""

        def pieced(unit: FlatUnit, held: list[dict[str, Any] | None], p: Any) -> dict:
            if any(s is None for s in held):
                missing = [e.fqn for e, s in zip(unit.entries, held, strict=True) if s is None]
                raise ValueError(f"optimizer state has no entry for parameters {missing}")
            first = held[0]
            assert first is not None  # checked above
            return {
                k: buffers[(id(p), k)] if isinstance(v, FlatPiece) else v for k, v in first.items()
            }

        load_by_plain_order(self.fsdp.layout, self.optimizer, dict(state), pieced)

    def reshard(self, what: str, saved_world_size: int, read: Reader) -> dict[str, Any]:
        layout = self.fsdp.layout
        files = {q: read(q) for q in fsdp_reshard.source_ranks(layout, saved_world_size)}
        return fsdp_reshard.reshard_optim_state_dict(
            layout, self.optimizer, parts(files, "optimizer"), saved_world_size
        )


# -- choosing the adapter ----------------------------------------------------------------------


def model_state(model: nn.Module) -> ModelState:
    """The adapter for ``model``, however it is wrapped.

    Example::

        >>> type(model_state(nn.DataParallel(nn.Linear(2, 2)))).__name__
        'PlainModel'
    """
    target, reducer = unwrap(model)
    if isinstance(target, FullyShardedDataParallel):
        return ShardedModel(target)
    return PlainModel(target, reducer)


def optimizer_state(
    optimizer: torch.optim.Optimizer, owner: ModelState | None = None
) -> OptimizerState:
    """The adapter for ``optimizer``; ``owner``: the FSDP model whose shards it steps, if any.

    Example::

        >>> net = nn.Linear(2, 2)
        >>> type(optimizer_state(torch.optim.SGD(net.parameters(), lr=0.1))).__name__
        'PlainOptimizer'
    """
    if isinstance(optimizer, ShardedOptimizer):
        return ZeroOptimizer(optimizer)
    if isinstance(owner, ShardedModel):
        return ShardOptimizer(optimizer, owner)
    return PlainOptimizer(optimizer)


def check_scaler(model: nn.Module, scaler: Any) -> None:
    """Raise unless ``scaler`` (a ``torch.amp.GradScaler`` or None) fits ``model``: with a
    FullyShardedDataParallel model it must be torch's ``ShardedGradScaler``.

    A plain GradScaler looks for inf and nan in this rank's gradients only, which under FSDP
    are this rank's shards: one rank could find an overflow and skip the step while the others
    take it, and their scales part. ``ShardedGradScaler`` sums the ranks' findings (one
    all-reduce) before any of them decides. It works with tandem.DDP too.

    Example::

        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        check_scaler(fsdp_model, ShardedGradScaler("cuda"))           # fine
        check_scaler(fsdp_model, torch.amp.GradScaler("cuda"))        # ValueError
    """
    if scaler is None or not isinstance(model, FullyShardedDataParallel):
        return
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if not isinstance(scaler, ShardedGradScaler):
        raise ValueError(
            f"scaler={type(scaler).__name__} with a FullyShardedDataParallel model: a "
            "GradScaler sees only this rank's gradient shards, so ranks could disagree on "
            "skipping a step; pass torch.distributed.fsdp.sharded_grad_scaler."
            "ShardedGradScaler(device, init_scale=...), which agrees across ranks (the Trainer "
            "makes one for precision='fp16-mixed' when scaler= is left unset)"
        )


# -- the checks' shared pieces ------------------------------------------------------------------


def check_keys_and_shapes(
    what: str, label: str, expected: Mapping[str, tuple[int, ...] | None], saved: Mapping
) -> None:
    """ValueError naming the missing, unexpected and reshaped keys of ``saved``, if any."""
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    if missing or unexpected:
        differences = listed(
            [(missing, "that the checkpoint lacks"), (unexpected, "that only the checkpoint has")],
            prefix="keys ",
        )
        raise ValueError(
            f"{what}: the {label} here has {differences}: load into the same (unwrapped) model"
        )
    wrong = [
        f"{k}: checkpoint {tuple(saved[k].shape)}, here {shape}"
        for k, shape in expected.items()
        if shape is not None
        and isinstance(saved[k], torch.Tensor)
        and tuple(saved[k].shape) != shape
    ]
    if wrong:
        raise ValueError(
            f"{what}: the checkpoint's {label} state has other shapes: " + "; ".join(wrong)
        )


def check_groups(what: str, want: list[int], saved: Any) -> None:
    """ValueError unless ``saved`` is an optimizer state dict with ``want`` parameters per group."""
    if not isinstance(saved, Mapping) or not {"state", "param_groups"} <= set(saved):
        raise ValueError(f"{what}: the checkpoint holds no optimizer state dict there")
    got = [len(g["params"]) for g in saved["param_groups"]]
    if got != want:
        raise ValueError(
            f"{what}: the checkpoint's optimizer has param groups of {got} parameters, this "
            f"one {want}: build it over the same parameters, in the same groups"
        )


def listed(groups: list[tuple[list[str], str]], prefix: str = "") -> str:
    """``"keys ['a'] that the checkpoint lacks and keys ['b'] that ..."``: the non-empty groups
    of names, each with what it says, for a message.

    Example::

        >>> listed([(["a"], "that the state lacks"), ([], "that the checkpoint lacks")])
        "['a'] that the state lacks"
    """
    return " and ".join(f"{prefix}{names} {where}" for names, where in groups if names)


def parts(files: dict[int, dict[str, Any]], part: str) -> dict[int, Any]:
    """Every saved rank's file's ``part``; ValueError naming the file that lacks it."""
    for q, f in files.items():
        if not isinstance(f, dict) or part not in f:
            held = sorted(f) if isinstance(f, dict) else type(f).__name__
            raise ValueError(
                f"saved rank {q}'s shard holds no {part!r} part (it holds {held}): it was "
                f"written by another set-up (a ShardedOptimizer run holds no FSDP model shards)"
            )
    return {q: f[part] for q, f in files.items()}


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _units(signature: list[list[tuple[str, tuple[int, ...]]]]) -> str:
    return "; ".join(", ".join(f for f, _ in unit) or "(empty)" for unit in signature)
