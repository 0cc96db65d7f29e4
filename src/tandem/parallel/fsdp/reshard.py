"""FullyShardedDataParallel checkpoints across world sizes: shards cut anew, nothing gathered.

A sharded checkpoint (:func:`tandem.parallel.fsdp.state.sharded_state_dict`, one file per rank)
holds each unit's flat buffer cut into ``W`` equal slices. At ``W'`` ranks, rank ``r`` owns
another slice of each buffer (:func:`tandem.parallel.sharding.flat_shard`, the one rule, asked
for both cuts), and builds it from the saved slices that overlap it:

1. :func:`source_ranks`: which saved ranks' files this rank reads (no rank reads them all
   unless ``W' = 1``);
2. :func:`reshard_sharded_state_dict`: each unit's new slice, copied piece by piece from the
   overlapping old ones, the padding zero as a fresh wrapper builds it;
3. :func:`reshard_optim_state_dict`: the optimizer's state of each shard cut the same way where
   it holds one value per element (Adam's moments), copied where it is one value per parameter
   (Adam's ``step``).

The results are exactly what ``sharded_state_dict`` and ``optimizer.state_dict()`` would give
on this rank had the run been at ``W'`` ranks all along, so the ordinary loading (with its
checks) takes them. No communication: each rank reads files, so the files of the ranks it
needs must be visible to it (a shared file system).

Example::

    files = {q: torch.load(shard_file(q)) for q in source_ranks(model.layout, saved_world_size)}
    model.load_sharded_state_dict(
        reshard_sharded_state_dict(model.layout, {q: f["model"] for q, f in files.items()}))
    optimizer.load_state_dict(reshard_optim_state_dict(
        model.layout, optimizer, {q: f["optimizer"] for q, f in files.items()}, saved_world_size))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tandem.parallel.fsdp.layout import FsdpLayout
from tandem.parallel.fsdp.state import SHARDED_FORMAT, aliases
from tandem.parallel.sharding import flat_shard, padded_numel


def source_ranks(layout: FsdpLayout, world_size: int) -> list[int]:
    """The ranks of a ``world_size``-rank run whose shards overlap this rank's (sorted).

    A rank whose slices are all padding still needs one file (buffers, hyperparameters):
    rank 0's.

    Example::

        files = {q: torch.load(shard_file(q)) for q in source_ranks(model.layout, 2)}
    """
    needed: set[int] = set()
    for unit in layout.units:
        start, end = flat_shard(unit.numel, layout.world_size, layout.rank)
        needed.update(_overlapping(unit.numel, world_size, start, end))
    return sorted(needed) or [0]


def _overlapping(numel: int, world_size: int, start: int, end: int) -> list[int]:
    """Ranks of a ``world_size``-way cut whose slices hold data of ``[start, end)``."""
    end = min(end, numel)  # padding is zeros: nobody needs to send it
    ranks = []
    for rank in range(world_size):
        lo, hi = flat_shard(numel, world_size, rank)
        if max(lo, start) < min(hi, end):
            ranks.append(rank)
    return ranks


def _reslice(
    pieces: Mapping[int, torch.Tensor], numel: int, saved_world_size: int, layout: FsdpLayout
) -> torch.Tensor:
    """This rank's slice of a flat buffer, cut from the ``saved_world_size``-way ``pieces``."""
    start, end = flat_shard(numel, layout.world_size, layout.rank)
    like = pieces[min(pieces)]
    out = torch.zeros(end - start, dtype=like.dtype)  # the padding stays zero, as built
    for rank in _overlapping(numel, saved_world_size, start, end):
        lo, hi = flat_shard(numel, saved_world_size, rank)
        a, b = max(lo, start), min(hi, end, numel)
        out[a - start : b - start] = pieces[rank][a - lo : b - lo]
    return out


def reshard_sharded_state_dict(layout: FsdpLayout, saved: Mapping[int, Any]) -> dict[str, Any]:
    """This rank's :func:`sharded_state_dict` built from shards of a run of another world size.

    Args:
        layout: the model's layout here.
        saved: ``{saved rank: its sharded_state_dict()}``, at least :func:`source_ranks`'.

    Raises:
        ValueError: not sharded FSDP state dicts, shards of different runs, or shards cut from
            another model or auto_wrap.

    Example::

        shard = reshard_sharded_state_dict(model.layout, {q: f["model"] for q, f in files.items()})
        model.load_sharded_state_dict(shard)
    """
    first = saved[min(saved)]
    world = first.get("world_size") if isinstance(first, dict) else None
    for rank, state in sorted(saved.items()):
        if not isinstance(state, dict) or state.get("format") != SHARDED_FORMAT:
            raise ValueError(
                f"rank {rank}'s file holds no sharded FSDP state dict ('format': "
                f"{SHARDED_FORMAT!r}); was it written by a ShardedOptimizer run?"
            )
        if (state["rank"], state["world_size"]) != (rank, world):
            hybrid = rank >= state["world_size"] == world  # one copy per shard group
            raise ValueError(
                f"the shard read as rank {rank} of {world} says it is rank {state['rank']} of "
                f"{state['world_size']}"
                + (
                    ": a hybrid-sharded model wrote these files, every shard group a copy of "
                    f"the {world} slices; pass one shard group's shards here, by their rank in "
                    "it, or save a full checkpoint to load at another world size"
                    if hybrid
                    else ""
                )
            )
        if [[(f, tuple(s)) for f, s in unit] for unit in state["layout"]] != layout.signature():
            raise ValueError(
                f"rank {rank}'s shards were cut from another model or auto_wrap (their units "
                "differ): wrap the same model the same way, or load a full state dict"
            )
    assert isinstance(world, int)  # checked against every shard above
    shards = [
        _reslice({q: s["shards"][i] for q, s in saved.items()}, unit.numel, world, layout)
        for i, unit in enumerate(layout.units)
    ]
    return {
        "format": SHARDED_FORMAT,
        "rank": layout.rank,
        "world_size": layout.world_size,
        "layout": layout.signature(),
        "aliases": aliases(layout),
        "shards": shards,
        "rest": first["rest"],
    }


def reshard_optim_state_dict(
    layout: FsdpLayout,
    optimizer: torch.optim.Optimizer,
    saved: Mapping[int, dict[str, Any]],
    saved_world_size: int,
) -> dict[str, Any]:
    """This rank's ``optimizer.state_dict()`` built from a run of ``saved_world_size`` ranks.

    The optimizer is over the wrapper's parameters, in the same order as the saved ones (the
    same model wrapped the same way, its optimizer built the same way). State of a shard is cut
    like the shard where it holds one value per element (its shape is the saved shard's) and
    copied otherwise (Adam's ``step``); state of a parameter that is not a shard (frozen,
    replicated) is copied from the lowest saved rank.

    Args:
        layout: the model's layout here.
        optimizer: this rank's optimizer over ``layout``'s shards.
        saved: ``{saved rank: its optimizer.state_dict()}``, at least :func:`source_ranks`'.
        saved_world_size: the world size that saved them.

    Raises:
        ValueError: the saved groups hold other numbers of parameters, or ranks disagree on
            which parameters have state.

    Example::

        saved = {q: f["optimizer"] for q, f in files.items()}
        optimizer.load_state_dict(reshard_optim_state_dict(model.layout, optimizer, saved, 2))
    """
    first = saved[min(saved)]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if [len(g["params"]) for g in first["param_groups"]] != sizes:
        raise ValueError(
            f"optimizer state with groups of {[len(g['params']) for g in first['param_groups']]} "
            f"parameters does not match this optimizer's groups of {sizes}"
        )
    units = {id(u.shard): u for u in layout.units}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(params):
        entries = {q: s["state"].get(i) for q, s in saved.items()}
        unit = units.get(id(p))
        if unit is None:  # replicated (frozen, not flattened): every rank holds the same
            if entries[min(entries)] is not None:
                state[i] = entries[min(entries)]
            continue
        held = [q for q, e in entries.items() if e is not None]
        if not held:  # never stepped
            continue
        if len(held) != len(entries):
            raise ValueError(_state_held(i, entries))
        saved_len = padded_numel(unit.numel, saved_world_size) // saved_world_size
        mine: dict[str, Any] = {}
        for key, value in entries[min(entries)].items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == (saved_len,):
                pieces = {q: e[key] for q, e in entries.items()}
                mine[key] = _reslice(pieces, unit.numel, saved_world_size, layout)
            else:
                mine[key] = value
        state[i] = mine
    return {"state": state, "param_groups": first["param_groups"]}


def _state_held(index: int, entries: Mapping[int, Any]) -> str:
    held = sorted(q for q, e in entries.items() if e is not None)
    return (
        f"optimizer parameter #{index} has state on saved ranks {held} of {sorted(entries)}: "
        "ranks that stepped alike hold state alike; the checkpoint is inconsistent"
    )
