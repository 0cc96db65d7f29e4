"""Checkpoints of a FullyShardedDataParallel model and its optimizer, full or sharded.

- **Full**: the plain module's ``state_dict()`` (same keys, same order, CPU tensors), gathered
  unit by unit on one rank, so that no rank ever holds more than one unit beyond its shards
  while the receiving rank builds the result. It loads into the unwrapped model, and back into
  a wrapper at *any* world size (each rank cuts its own slices out of it). The optimizer's full
  state is the state a plain optimizer over the plain module's ``parameters()`` would have:
  element-wise state (Adam's moments, momentum) is gathered and cut back into parameters;
  per-parameter scalars (Adam's ``step``) are copied to every parameter of the shard.
- **Sharded**: each rank's shards as they are, with the layout they were cut by (and the other
  keys of tied weights, which the layout names once: :func:`aliases`) and the grid they were
  cut on (:func:`mesh_record`); one file per rank, no communication, and it loads only at the
  same world size into the same model (both checked, with an error that points to the full
  form). With hybrid sharding every replica's file holds the same slices: each shard group's
  files are one copy of the model.
- **Resharded**: shards saved at another world size are cut anew for this rank by
  :mod:`tandem.parallel.fsdp.reshard`, into what :func:`sharded_state_dict` would hold here.

Every function takes the model's :class:`~tandem.parallel.fsdp.layout.FsdpLayout` (its units,
names and group), never the wrapper itself: the wrapper's methods of the same names call these.

Example::

    full = full_state_dict(model.layout, to=0)      # rank 0: loads into the plain module
    shard = sharded_state_dict(model.layout)        # every rank: save as its own file
    load_sharded_state_dict(model.layout, shard)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem._dist import agree, all_gather_flat
from tandem.parallel.fsdp.flat import FlatUnit
from tandem.parallel.fsdp.layout import FsdpLayout

SHARDED_FORMAT = "tandem.fsdp.sharded/1"


def _gathered_values(layout: FsdpLayout, to: int) -> dict[str, torch.Tensor]:
    """``{fqn: CPU tensor}`` of every flattened parameter on rank ``to`` (empty elsewhere)."""
    values: dict[str, torch.Tensor] = {}
    for unit in layout.units:
        was_current = unit.is_current
        unit.gather()
        if layout.rank == to:
            values.update({k: v.detach().cpu().clone() for k, v in unit.full_values().items()})
        if layout.stage == 3 and not was_current:
            unit.free()
    return values


def full_state_dict(layout: FsdpLayout, to: int = 0) -> dict[str, Any] | None:
    """The plain module's ``state_dict()`` on group rank ``to``, None elsewhere (a collective)."""
    if not 0 <= to < layout.world_size:
        raise ValueError(f"to={to} not in [0, {layout.world_size})")
    values = _gathered_values(layout, to)
    if layout.rank != to:
        return None
    rest = layout.module.state_dict()
    return {
        key: values[layout.key_fqn[key]] if key in layout.key_fqn else rest[key].detach().cpu()
        for key in layout.state_keys
    }


def load_full_state_dict(layout: FsdpLayout, state: dict[str, Any]) -> None:
    """Load a plain module's ``state_dict()`` on every rank, whatever world size saved it."""
    known = set(layout.state_keys)
    missing = [k for k in layout.state_keys if k not in state]
    unexpected = [k for k in state if k not in known]
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the wrapped module: missing keys {missing}, unexpected "
            f"keys {unexpected}. Load a state_dict() of the same (unwrapped) model"
        )
    by_fqn = {layout.key_fqn[k]: v for k, v in state.items() if k in layout.key_fqn}
    with torch.no_grad():
        for unit in layout.units:
            for e in unit.entries:
                got = tuple(by_fqn[e.fqn].shape)
                if got != tuple(e.shape):
                    raise ValueError(
                        f"state dict entry {e.fqn!r} has shape {got}; the model's parameter "
                        f"has shape {tuple(e.shape)}"
                    )
            unit.shard.copy_(unit.shard_of(by_fqn))
    layout.module.load_state_dict({k: v for k, v in state.items() if k not in layout.key_fqn})


def sharded_state_dict(layout: FsdpLayout) -> dict[str, Any]:
    """This rank's shards, buffers and frozen parameters, with the layout (no communication).

    ``"aliases"`` maps every other ``state_dict`` key of a flattened parameter (a tied weight's
    second name) to the fqn its unit holds it under: the layout names each parameter once, so a
    reader that puts the plain state dict back together (export) needs them for every key.
    """
    return {
        "format": SHARDED_FORMAT,
        "rank": layout.rank,
        "world_size": layout.world_size,
        "layout": layout.signature(),
        "aliases": aliases(layout),
        "shards": [unit.shard.detach().cpu().clone() for unit in layout.units],
        "rest": {k: v.detach().cpu() for k, v in layout.module.state_dict().items()},
        "mesh": mesh_record(layout),
    }


def mesh_record(layout: FsdpLayout) -> dict[str, list[int]]:
    """The grid a sharded state dict was cut on, as this rank sees it (global ranks).

    ``"shard_ranks"`` is this rank's shard group in slice order (its files, read in that order,
    tile every unit); ``"replicate_ranks"`` the ranks holding the same slices (this rank alone
    in flat sharding). A reader at another layout takes one copy of every slice from them:
    :func:`tandem.parallel.fsdp.reshard.replica_ranks`.

    Example::

        mesh_record(hybrid.layout)   # on rank 3 of 2 nodes x 2:
        # {"shard_ranks": [2, 3], "replicate_ranks": [1, 3]}
    """
    return {
        "shard_ranks": list(layout.mesh.shard.ranks),
        "replicate_ranks": list(layout.mesh.replicate.ranks),
    }


def aliases(layout: FsdpLayout) -> dict[str, str]:
    """``{state_dict key: fqn}`` for the keys of flattened parameters that are not their fqn.

    Example::

        aliases(tied.layout)     # {"lm_head.weight": "embed.weight"}: one tensor, two keys
    """
    return {key: fqn for key, fqn in layout.key_fqn.items() if key != fqn}


def load_sharded_state_dict(layout: FsdpLayout, state: dict[str, Any]) -> None:
    """Load what :func:`sharded_state_dict` saved on this rank (same world size and model)."""
    if not isinstance(state, dict) or state.get("format") != SHARDED_FORMAT:
        raise ValueError(
            "not a sharded FSDP state dict (no 'format': "
            f"{SHARDED_FORMAT!r}); a plain state_dict() loads with load_full_state_dict"
        )
    saved = (state["rank"], state["world_size"])
    if saved != (layout.rank, layout.world_size):
        raise ValueError(
            f"sharded state dict of rank {saved[0]} of {saved[1]} cannot load into rank "
            f"{layout.rank} of {layout.world_size}: a sharded checkpoint loads at the world size "
            "that wrote it; reshard it (tandem.parallel.fsdp.reshard) or load a full state dict "
            "to change the world size"
        )
    if [[(f, tuple(s)) for f, s in unit] for unit in state["layout"]] != layout.signature():
        raise ValueError(
            "sharded state dict was cut from another model or auto_wrap (its units differ): "
            "wrap the same model the same way, or load a full state dict"
        )
    with torch.no_grad():
        for unit, shard in zip(layout.units, state["shards"], strict=True):
            unit.shard.copy_(shard)
    layout.module.load_state_dict(state["rest"])


# -- optimizer ---------------------------------------------------------------------------------


class _PlainIndex:
    """How the wrapper's parameters map onto a plain optimizer's over the plain module.

    ``index[fqn]`` is the plain parameter's position (its id in a plain optimizer's state
    dict), ``names[id(p)]`` the fqns a wrapper parameter stands for (a shard: its unit's;
    a frozen parameter: itself), ``units[id(p)]`` the unit of a shard.
    """

    def __init__(self, layout: FsdpLayout) -> None:
        self.index = {fqn: i for i, fqn in enumerate(layout.param_fqns)}
        self.names = {id(u.shard): [e.fqn for e in u.entries] for u in layout.units}
        for fqn, p in layout.module.named_parameters():
            self.names[id(p)] = [fqn]
        self.units = {id(u.shard): u for u in layout.units}

    def group_ids(self, group: dict[str, Any]) -> list[int]:
        """The plain parameter ids an optimizer group over wrapper parameters stands for."""
        return sorted(self.index[n] for p in group["params"] for n in self.names[id(p)])


def _elementwise(key: str, values: list[Any], unit: FlatUnit) -> bool:
    """Whether a state entry holds one value per element (moments), not one per parameter.

    Told by shape; for a unit of 0-d parameters only, whose moments look like Adam's 0-d
    ``step``, by the name ``step`` too.
    """
    pairs = zip(values, unit.entries, strict=True)
    matching = all(isinstance(v, torch.Tensor) and v.shape == e.shape for v, e in pairs)
    if any(len(e.shape) for e in unit.entries):
        return matching
    return matching and key != "step"


def full_optim_state_dict(
    layout: FsdpLayout, optimizer: torch.optim.Optimizer, to: int = 0
) -> dict[str, Any] | None:
    """A plain optimizer's ``state_dict()`` over the plain module, on rank ``to`` (a collective).

    It loads into ``optimizer_class(plain_module.parameters())``, and into this optimizer at any
    world size through :func:`load_full_optim_state_dict`.
    """
    if not 0 <= to < layout.world_size:
        raise ValueError(f"to={to} not in [0, {layout.world_size})")
    plain = _PlainIndex(layout)
    index, names, units = plain.index, plain.names, plain.units
    keep = layout.rank == to  # the others only join the all-gathers
    saved = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    keys = sorted(
        (i, sorted(saved["state"].get(i, {}))) for i, p in enumerate(params) if id(p) in units
    )
    # The all-gathers below go shard by shard and key by key: a rank with other state would
    # hang in them, so the ranks compare first.
    agree(
        keys,
        "the optimizer's state (which shards hold it, under which keys)",
        layout.process_group,
        explain=_first_keys_difference,
        fix="Step the optimizer on every rank alike before saving",
    )
    state: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(params):
        own = saved["state"].get(i, {})
        unit = units.get(id(p))
        if unit is None:
            if own and keep:
                state[index[names[id(p)][0]]] = {k: _cpu(v) for k, v in own.items()}
            continue
        per_entry: list[dict[str, Any]] = [{} for _ in unit.entries]
        for key in sorted(own):
            value = own[key]
            if isinstance(value, torch.Tensor) and value.shape == unit.shard.shape:
                full = torch.empty(unit.padded, dtype=value.dtype, device=value.device)
                if layout.world_size > 1:
                    all_gather_flat(full, value.contiguous(), group=layout.process_group)
                else:
                    full.copy_(value)
                if keep:
                    for slot, e in zip(per_entry, unit.entries, strict=True):
                        piece = full[e.offset : e.offset + e.numel].view(e.shape)
                        slot[key] = piece.cpu().clone()
            elif keep:
                for slot in per_entry:
                    slot[key] = _cpu(value)
        if own and keep:
            for slot, e in zip(per_entry, unit.entries, strict=True):
                state[index[e.fqn]] = slot
    if not keep:
        return None
    groups = []
    for g, group in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": plain.group_ids(group)})
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def load_full_optim_state_dict(
    layout: FsdpLayout, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load a plain optimizer's state dict (see :func:`full_optim_state_dict`) on every rank."""
    load_by_plain_order(layout, optimizer, state, _cut)


def load_by_plain_order(
    layout: FsdpLayout,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    cut: Callable[[FlatUnit, list[dict[str, Any] | None], torch.Tensor], dict[str, Any]],
) -> None:
    """Load ``state``, keyed by the plain module's parameter positions, into ``optimizer`` over
    the layout's shards: a parameter outside the units takes its entry as it is, a unit's shard
    ``cut(unit, its parameters' entries, shard)`` (:func:`_cut` slices whole states; a reader of
    this rank's pieces hands its buffers instead).

    Example::

        load_by_plain_order(layout, opt, saved, _cut)
    """
    plain = _PlainIndex(layout)
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"optimizer state with {len(saved_groups)} param groups cannot load into an "
            f"optimizer with {len(optimizer.param_groups)}"
        )
    inner_state: dict[int, dict[str, Any]] = {}
    inner_groups = []
    j = 0
    for saved, group in zip(saved_groups, optimizer.param_groups, strict=True):
        expected = plain.group_ids(group)
        if sorted(saved["params"]) != expected:
            raise ValueError(
                f"optimizer state group with parameters {sorted(saved['params'])} does not "
                f"match this optimizer's group of parameters {expected} (plain module order)"
            )
        ids = []
        for p in group["params"]:
            unit = plain.units.get(id(p))
            entries = [state["state"].get(plain.index[n]) for n in plain.names[id(p)]]
            if unit is None:
                if entries[0] is not None:
                    inner_state[j] = dict(entries[0])
            elif any(s is not None for s in entries):
                inner_state[j] = cut(unit, entries, p)
            ids.append(j)
            j += 1
        inner_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})


def _cut(unit: FlatUnit, entries: list[dict[str, Any] | None], shard: torch.Tensor) -> dict:
    """This rank's slice of a unit's per-parameter optimizer states."""
    if any(s is None for s in entries):
        missing = [e.fqn for e, s in zip(unit.entries, entries, strict=True) if s is None]
        raise ValueError(f"optimizer state has no entry for parameters {missing}")
    out: dict[str, Any] = {}
    first = entries[0]
    assert first is not None  # checked above
    for key in first:
        values = [s[key] for s in entries]  # type: ignore[index]
        if _elementwise(key, values, unit):
            by_fqn = {e.fqn: v for e, v in zip(unit.entries, values, strict=True)}
            out[key] = unit.shard_of(by_fqn, dtype=values[0].dtype).to(shard.device)
        else:
            out[key] = values[0]
    return out


def _first_keys_difference(everyone: list[list[tuple[int, list[str]]]]) -> str:
    """Name the first optimizer parameter whose state keys differ from rank 0's, and where."""
    reference = dict(everyone[0])
    for rank, keys in enumerate(everyone):
        theirs = dict(keys)
        for i in sorted(set(reference) | set(theirs)):
            if reference.get(i) != theirs.get(i):
                return (
                    f"optimizer parameter #{i}: rank 0 has state {_keys(reference.get(i))}, "
                    f"rank {rank} has {_keys(theirs.get(i))}"
                )
    return "no difference found"  # agree calls this only when the ranks differ


def _keys(keys: list[str] | None) -> str:
    return "none" if not keys else "keys " + ", ".join(keys)


def _cpu(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
