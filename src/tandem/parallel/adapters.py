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

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem._dist import group_rank
from tandem.parallel.ddp.wrapper import DistributedDataParallel
from tandem.parallel.dp.wrapper import DataParallel
from tandem.parallel.fsdp import reshard as fsdp_reshard
from tandem.parallel.fsdp.state import SHARDED_FORMAT, _PlainIndex
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

    def full_names(self) -> list[str] | None:
        """The parameter name of each position of the full state dict, where this adapter
        knows them; None: the positions are the optimizer's own parameters, in order (the
        model that holds them names them)."""
        return None

    def full_positions(self, group: dict[str, Any]) -> list[int] | None:
        """The positions in the full state dict of ``group``'s parameters; None: the groups'
        parameters in order."""
        return None

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

    def _check_shard(self, what: str, shard: Any) -> None:
        opt = self.optimizer
        got = (shard.get("rank"), shard.get("world_size"), shard.get("owners"))
        mine = (opt.rank, opt.world_size, list(opt.owners))
        if got != mine:
            raise ValueError(
                f"{what}: the optimizer shard of rank {got[0]} of {got[1]} (owners "
                f"{got[2]}) cannot load into rank {mine[0]} of {mine[1]} (owners {mine[2]})"
            )

    def reshard(self, what: str, saved_world_size: int, read: Reader) -> dict[str, Any]:
        """The state of the parameters this rank owns now, from their old owners
        (:meth:`tandem.parallel.zero.ShardedOptimizer.reshard_state_dicts`)."""
        files = {q: read(q) for q in self.optimizer.source_ranks(saved_world_size)}
        if any("model" in f for f in files.values() if isinstance(f, dict)):
            raise ValueError(
                "the shard files hold FSDP model shards; this model is not a "
                "tandem.FullyShardedDataParallel"
            )
        return self.optimizer.reshard_state_dicts(parts(files, "optimizer"))


class ShardOptimizer(OptimizerState):
    """An optimizer over an FSDP model's shards: the full state names the plain module's
    parameters (gathered to one rank); a shard's element-wise state is cut like the shards."""

    sharded = True

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
