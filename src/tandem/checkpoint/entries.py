"""Each value of a ``tandem.checkpoint`` state dict: what is saved of it, what fits, how it loads.

:func:`classify` sorts every value into one of five types; each knows what goes into rank 0's
file (its record's ``"state"``), what into each rank's own shard file in the sharded kind, how
to check a saved state against the live object without touching it, and how to load it:

=========  ========================================  ==========================================
type       values                                    ``record["state"]`` (rank 0's file)
=========  ========================================  ==========================================
model      ``nn.Module``, tandem.DDP, DataParallel,  ``{"model": the plain module's
           FSDP, torch's DDP, ``torch.compile``'d    state_dict(), "engine": tandem.DDP's
                                                     bucket order or None}``
optimizer  a torch optimizer, ShardedOptimizer,      ``{"optimizer": a plain optimizer's
           one over an FSDP model's shards           state_dict() over the plain module}``
engine     a :class:`~tandem.parallel.engine.Engine` ``{"model", "optimizer", "engine"}``
stateful   anything with ``state_dict()`` and        its ``state_dict()`` (rank 0's); every
           ``load_state_dict()``: scheduler,         rank's ``rank_state_dict()``, if it has
           sampler, GradScaler, RNG                  one, in ``record["ranks"]``
value      tensors, numbers, strings, None, and      the value (rank 0's)
           lists, tuples and dicts of them
=========  ========================================  ==========================================

The full kind gathers what is sharded, so the states above load at any world size and into the
unwrapped model. In the sharded kind what is sharded stays on its rank: an FSDP model's shards
(``{"model": ...}``) and a ShardedOptimizer's or an FSDP optimizer's state (``{"optimizer":
...}``) go into that rank's file under the value's key, and None takes their place above; at
another world size each rank cuts its part anew from the saved parts overlapping it (reshard).

An optimizer over an FSDP model's shards needs that model in the same state dict: its full
state names the plain module's parameters, which only the model can map the shards onto.

Hybrid sharding (an FSDP model on a grid of shard groups that replicate each other) writes its
sharded kind on every rank, so the files hold as many copies of each slice as there are shard
groups. At another world size an FSDP entry reads one copy: the files of saved rank 0's shard
group, seen as a flat run's (:func:`tandem.parallel.fsdp.reshard.one_copy`), which is why its
optimizer's part carries the grid too (``"mesh"``: the model's record).

How each wrapper's state is saved, checked, loaded and resharded is not written here: every
model and optimizer entry holds its wrapper's adapter (:mod:`tandem.parallel.adapters`), the
same one the engines use, so this module never asks which wrapper it holds (the grid above
too is the adapter's: ``grid()``, ``one_copy()``).

Example::

    entries = classify({"model": model, "optimizer": opt, "step": 12})
    state, shard = entries[0].save("full")       # a collective for FSDP
    entries[0].check(state, shard)               # ValueError if it does not fit; nothing changed
    entries[0].load(state, shard)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from tandem.parallel.adapters import ModelState, OptimizerState, model_state, optimizer_state
from tandem.parallel.engine import Engine, Kind

_PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.Tensor)


def is_plain(value: Any) -> bool:
    """Whether ``value`` is plain data that ``torch.load(weights_only=True)`` takes back.

    Example::

        >>> is_plain({"step": 3, "losses": [0.5, 0.25], "name": None})
        True
        >>> is_plain({"model": nn.Linear(1, 1)})
        False
    """
    if isinstance(value, _PLAIN_SCALARS):
        return True
    if isinstance(value, list | tuple):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str | int) and is_plain(v) for k, v in value.items())
    return False


class Entry:
    """One value of the state dict under ``key`` (subclasses: one per type)."""

    tag: ClassVar[str]

    def __init__(self, key: str, obj: Any) -> None:
        self.key = key
        self.obj = obj
        self.what = f"state[{key!r}]"

    def save(self, kind: Kind) -> tuple[Any, dict[str, Any] | None]:
        """(its part of rank 0's file, this rank's shard or None); a collective where sharded."""
        raise NotImplementedError

    @property
    def has_rank_state(self) -> bool:
        return False

    def rank_state(self) -> Any:
        """This rank's own part (RNG states), saved for every rank."""

    def sharded_in(self, state: Any) -> bool:
        """Whether its saved ``state`` left a part in the shard files (None stands there)."""
        return False

    def reshard(self, saved_world_size: int, read: Callable[[int], Any]) -> dict[str, Any]:
        """This rank's shard part cut from another world size's (``read(q)``: rank q's)."""
        raise ValueError(f"{self.what} is a {self.tag}; the checkpoint holds shards of it")

    def cut_alike(self, shard: dict[str, Any] | None) -> bool:
        """Whether this rank's own shard part (``shard``, saved at this world size) was cut on
        the layout the object has now; if not, the load cuts it anew as at another world size
        (a hybrid run's files read by a flat one of as many ranks, or the reverse)."""
        return True

    def check(self, state: Any, shard: dict[str, Any] | None) -> None:
        """ValueError, naming the key and what differs, unless the saved state fits."""

    def load(self, state: Any, shard: dict[str, Any] | None) -> None:
        raise NotImplementedError


class ModelEntry(Entry):
    tag = "model"

    def __init__(self, key: str, obj: nn.Module) -> None:
        super().__init__(key, obj)
        self.state = model_state(obj)

    def save(self, kind: Kind) -> tuple[Any, dict[str, Any] | None]:
        full, shard = self.state.save(kind)
        record = {"model": full, "engine": self.state.engine_state()}
        return record, None if shard is None else {"model": shard}

    def sharded_in(self, state: Any) -> bool:
        return _holds_none(state, "model")

    def reshard(self, saved_world_size: int, read: Callable[[int], Any]) -> dict[str, Any]:
        # One copy of a hybrid FSDP run's slices (every other model's files as they are).
        saved_world_size, read = self.state.one_copy(saved_world_size, read, _model_part)
        return {"model": self.state.reshard(self.what, saved_world_size, read)}

    def cut_alike(self, shard: dict[str, Any] | None) -> bool:
        return _grid_fits(self.state, _part(_part(shard, "model"), "mesh"))

    def check(self, state: Any, shard: dict[str, Any] | None) -> None:
        _same_grid(self.what, self.state, _part(_part(shard, "model"), "mesh"))
        self.state.check(self.what, _part(state, "model"), _part(shard, "model"))

    def load(self, state: Any, shard: dict[str, Any] | None) -> None:
        sharded = _part(shard, "model")
        self.state.load(None if sharded is not None else state["model"], sharded)
        if sharded is None:
            self.state.load_engine_state(state.get("engine"))


class OptimizerEntry(Entry):
    tag = "optimizer"

    def __init__(self, key: str, obj: torch.optim.Optimizer, owner: ModelState | None) -> None:
        super().__init__(key, obj)
        self.owner = owner  # the FSDP model whose shards it steps, or None
        self.state = optimizer_state(obj, owner)

    def save(self, kind: Kind) -> tuple[Any, dict[str, Any] | None]:
        full, shard = self.state.save(kind)
        if shard is None:
            return {"optimizer": full}, None
        part = {"optimizer": shard}
        grid = self.owner.grid() if self.owner is not None else None
        if grid is not None:
            # The optimizer's file part is read without the model's: it names its grid itself.
            part["mesh"] = grid
        return {"optimizer": full}, part

    def sharded_in(self, state: Any) -> bool:
        return _holds_none(state, "optimizer")

    def reshard(self, saved_world_size: int, read: Callable[[int], Any]) -> dict[str, Any]:
        try:
            if self.owner is not None:
                saved_world_size, read = self.owner.one_copy(saved_world_size, read, _itself)
            return {"optimizer": self.state.reshard(self.what, saved_world_size, read)}
        except ValueError as e:
            raise ValueError(f"{self.what}: {e}") from e

    def cut_alike(self, shard: dict[str, Any] | None) -> bool:
        if self.owner is not None:  # over an FSDP model's shards: cut on its grid
            return _grid_fits(self.owner, _part(shard, "mesh"))
        return self.state.cut_alike(_part(shard, "optimizer"))

    def check(self, state: Any, shard: dict[str, Any] | None) -> None:
        if self.owner is not None:
            _same_grid(self.what, self.owner, _part(shard, "mesh"))
        self.state.check(self.what, _part(state, "optimizer"), _part(shard, "optimizer"))

    def load(self, state: Any, shard: dict[str, Any] | None) -> None:
        sharded = _part(shard, "optimizer")
        self.state.load(None if sharded is not None else state["optimizer"], sharded)


class EngineEntry(Entry):
    """An engine: its own ``state_dict(kind)`` / ``load_state_dict`` (the engine contract)."""

    tag = "engine"
    obj: Engine

    def __init__(self, key: str, obj: Engine) -> None:
        super().__init__(key, obj)
        self.model: ModelState = obj.model_state
        self.optimizer: OptimizerState = obj.optimizer_state

    def save(self, kind: Kind) -> tuple[Any, dict[str, Any] | None]:
        # An engine with nothing sharded refuses the sharded kind; its full state is the same
        # on every rank, so rank 0's file holds it whole.
        parts = self.obj.state_dict(kind if self.obj.has_shards else "full")
        shard = parts.pop("shard")
        return parts, shard

    def sharded_in(self, state: Any) -> bool:
        return _holds_none(state, "optimizer")  # every sharded engine shards its optimizer

    def reshard(self, saved_world_size: int, read: Callable[[int], Any]) -> dict[str, Any]:
        try:
            # One copy of a hybrid FSDP run's slices (every other model's files as they are).
            saved_world_size, read = self.model.one_copy(saved_world_size, read, _model_part)
            return self.obj.reshard(saved_world_size, read)
        except ValueError as e:
            raise ValueError(f"{self.what}: {e}") from e

    def cut_alike(self, shard: dict[str, Any] | None) -> bool:
        return _grid_fits(self.model, _part(_part(shard, "model"), "mesh"))

    def check(self, state: Any, shard: dict[str, Any] | None) -> None:
        _same_grid(self.what, self.model, _part(_part(shard, "model"), "mesh"))
        self.model.check(self.what, _part(state, "model"), _part(shard, "model"))
        self.optimizer.check(self.what, _part(state, "optimizer"), _part(shard, "optimizer"))

    def load(self, state: Any, shard: dict[str, Any] | None) -> None:
        self.obj.load_state_dict({**state, "shard": shard})


class StatefulEntry(Entry):
    """A scheduler, sampler, GradScaler, RNG: ``state_dict()`` and its load; optionally each
    rank's own part: ``rank_state_dict()``, ``load_rank_state_dict(s)`` (see load_rank_states)."""

    tag = "stateful"

    def save(self, kind: Kind) -> tuple[Any, dict[str, Any] | None]:
        return self.obj.state_dict(), None

    @property
    def has_rank_state(self) -> bool:
        return callable(getattr(self.obj, "rank_state_dict", None))

    def rank_state(self) -> Any:
        return self.obj.rank_state_dict()

    def load(self, state: Any, shard: dict[str, Any] | None) -> None:
        self.obj.load_state_dict(state)

    def check_rank_states(self, states: list[Any], world_size: int) -> None:
        """ValueError unless the states of ``len(states)`` saved ranks map onto this world."""
        if len(states) != world_size and not hasattr(self.obj, "load_rank_state_dicts"):
            raise ValueError(
                f"{self.what} holds per-rank state of {len(states)} process(es) and this job "
                f"has {world_size}: {type(self.obj).__name__} has no load_rank_state_dicts() "
                "to map it onto another world size"
            )

    def load_rank_states(self, states: list[Any], rank: int) -> None:
        """Every saved rank's part, in rank order: the object's ``load_rank_state_dicts``
        maps them at any world size; without it each rank takes its own."""
        load_all = getattr(self.obj, "load_rank_state_dicts", None)
        if load_all is not None:
            load_all(states, rank)
        else:
            self.obj.load_rank_state_dict(states[rank])


class ValueEntry(Entry):
    """Plain data: saved as it is on rank 0, put back into the state dict on load."""

    tag = "value"

    def save(self, kind: Kind) -> tuple[Any, dict[str, Any] | None]:
        return self.obj, None

    def loaded(self, saved: Any) -> Any:
        """What the state dict holds after loading: the saved value; a tensor of the same
        shape and dtype is copied into the one there (it stays on its device, and references
        to it see the loaded values, as torch.distributed.checkpoint does)."""
        current = self.obj
        if (
            isinstance(current, torch.Tensor)
            and isinstance(saved, torch.Tensor)
            and current.shape == saved.shape
            and current.dtype == saved.dtype
        ):
            with torch.no_grad():
                current.copy_(saved)
            return current
        return saved

    def load(self, state: Any, shard: dict[str, Any] | None) -> None:
        raise AssertionError("a value is put back by the caller, through loaded()")


def classify(state: Mapping[str, Any]) -> list[Entry]:
    """One entry per value of ``state``, in its order (the same on every rank).

    Raises:
        ValueError: ``state`` is not a dict with string keys, a value is none of the five
            types, or an optimizer steps the shards of several FSDP models.
    """
    if not isinstance(state, Mapping):
        raise ValueError(
            f"state must be a dict of the objects to save, e.g. {{'model': model, 'optimizer': "
            f"opt}}; got a {type(state).__name__}"
        )
    owners: dict[int, ModelState] = {}  # id of a shard parameter -> its FSDP model's adapter
    for obj in state.values():
        if isinstance(obj, Engine):
            owners.update(obj.model_state.shard_owners())
        elif isinstance(obj, nn.Module):
            owners.update(model_state(obj).shard_owners())
    entries: list[Entry] = []
    for key, obj in state.items():
        if not isinstance(key, str):
            raise ValueError(f"state keys must be strings; got {key!r} ({type(key).__name__})")
        if isinstance(obj, Engine):
            entries.append(EngineEntry(key, obj))
        elif isinstance(obj, nn.Module):
            entries.append(ModelEntry(key, obj))
        elif isinstance(obj, torch.optim.Optimizer):
            entries.append(OptimizerEntry(key, obj, _owner(key, obj, owners)))
        elif is_plain(obj):
            entries.append(ValueEntry(key, obj))
        elif callable(getattr(obj, "state_dict", None)) and callable(
            getattr(obj, "load_state_dict", None)
        ):
            entries.append(StatefulEntry(key, obj))
        else:
            inside = ""
            if isinstance(obj, list | tuple | dict):
                inside = " (it holds objects that are not plain data: give each its own key)"
            raise ValueError(
                f"state[{key!r}] is of type {type(obj).__name__}, which tandem.checkpoint cannot "
                "save: give models, optimizers, engines, objects with state_dict() and "
                "load_state_dict(), or plain values (tensors, numbers, strings, None, and "
                f"lists, tuples and dicts of them){inside}"
            )
    return entries


def _owner(
    key: str, opt: torch.optim.Optimizer, owners: dict[int, ModelState]
) -> ModelState | None:
    params = [p for group in opt.param_groups for p in group["params"]]
    found = {id(owners[id(p)]): owners[id(p)] for p in params if id(p) in owners}
    if len(found) > 1:
        raise ValueError(
            f"state[{key!r}] steps the shards of {len(found)} FullyShardedDataParallel models; "
            "give each model its own optimizer, so that each state maps onto one plain module"
        )
    return next(iter(found.values()), None)


def _part(parts: Any, name: str) -> Any:
    return parts.get(name) if isinstance(parts, Mapping) else None


def _model_part(part: Any) -> Any:
    return _part(part, "model")


def _itself(part: Any) -> Any:
    return part


def _grid_fits(owner: ModelState, saved: Any) -> bool:
    mine = owner.grid()
    return saved is None or mine is None or saved == mine


def _same_grid(what: str, owner: ModelState, saved: Any) -> None:
    """ValueError unless this rank's own shard file was cut on the grid the model has now.

    Called where the checkpoint has as many shard files as there are processes: each rank then
    loads its own file, which fits only the layout that wrote it (flat over 4 and 2 nodes x 2
    have the same count and other slices).
    """
    mine = owner.grid()
    if saved is None or mine is None:
        return  # no shard here, or written before files named their grid
    if saved == mine:
        return
    raise ValueError(
        f"{what}: this rank's shard file was cut on {_grid(saved)}, and the model is "
        f"{_grid(mine)}: with as many processes as shard files each rank loads its own, which "
        "fits only the layout that wrote it. Load it with that layout (then save kind='full' "
        "to change it), or at another number of processes, where the shards are cut anew"
    )


def _grid(record: Mapping[str, Any]) -> str:
    shard, replicate = list(record["shard_ranks"]), list(record["replicate_ranks"])
    if len(replicate) == 1:
        return f"flat sharding over ranks {shard}"
    return (
        f"hybrid sharding of {len(replicate)} x {len(shard)} ranks (shard group {shard}, "
        f"replicate group {replicate})"
    )


def _holds_none(state: Any, name: str) -> bool:
    return isinstance(state, Mapping) and name in state and state[name] is None
