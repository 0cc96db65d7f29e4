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

Hybrid sharding (rows of ``S`` ranks cutting the units, ``R`` rows holding the same slices)
writes ``R`` copies: every rank its own file, so that each rank resumes from its own disk at
the layout that wrote them. Along the second dimension nothing is cut, so another layout reads
one copy: :func:`replica_ranks`, the row of saved rank 0, read as the files of a flat run of
``S`` ranks (:func:`one_copy`); the first dimension is then the flat resharding above. Any
layout reads any other this way: hybrid to flat, flat to hybrid, one node count to another.

Example::

    files = {q: torch.load(shard_file(q)) for q in source_ranks(model.layout, saved_world_size)}
    model.load_sharded_state_dict(
        reshard_sharded_state_dict(model.layout, {q: f["model"] for q, f in files.items()}))
    optimizer.load_state_dict(reshard_optim_state_dict(
        model.layout, optimizer, {q: f["optimizer"] for q, f in files.items()}, saved_world_size))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from tandem.parallel.fsdp.layout import FsdpLayout
from tandem.parallel.fsdp.state import SHARDED_FORMAT, aliases, mesh_record
from tandem.parallel.sharding import flat_shard, padded_numel

T = TypeVar("T")


def replica_ranks(first: Any, saved_world_size: int) -> list[int]:
    """The saved ranks whose files hold one copy of every slice, in slice order.

    That is the shard group of saved rank 0 (its ``"mesh"`` record,
    :func:`tandem.parallel.fsdp.state.mesh_record`): with hybrid sharding the other rows hold
    the same slices (their gradients all-reduced, their optimizers stepped alike), so one row
    is the whole model, whichever. Files without the record (flat runs, written before it
    existed) are one row of ``saved_world_size`` ranks.

    Args:
        first: saved rank 0's sharded state dict, or any mapping holding its ``"mesh"``.
        saved_world_size: how many shard files the checkpoint has.

    Raises:
        ValueError: the record is not a row of ranks among the files that contains rank 0 and
            divides them into rows of one size.

    Example::

        replica_ranks(torch.load(shard_file(0))["model"], 4)    # [0, 1] for 2 nodes x 2
    """
    record = first.get("mesh") if isinstance(first, Mapping) else None
    if record is None:
        return list(range(saved_world_size))
    row = list(record.get("shard_ranks", ())) if isinstance(record, Mapping) else []
    valid = all(isinstance(q, int) and 0 <= q < saved_world_size for q in row)
    if not valid or 0 not in row or len(set(row)) != len(row) or saved_world_size % len(row):
        raise ValueError(
            f"saved rank 0's shard file records the shard group {row} for a checkpoint of "
            f"{saved_world_size} shard files: not a row of them holding rank 0; the files are "
            "not one checkpoint's (load them where they were written, or save kind='full')"
        )
    return row


def one_copy(
    saved_world_size: int, read: Callable[[int], T], first: Callable[[T], Any]
) -> tuple[int, Callable[[int], T]]:
    """A checkpoint's shard files seen as a flat run's: ``(its shard group's size, read)``.

    ``read(q)`` gives saved rank ``q``'s file (or this object's part of it); the result's
    ``read(s)`` gives the file of slice ``s`` of one copy (:func:`replica_ranks`), so that
    :func:`source_ranks` and the reshard functions below, which know flat cuts only, take a
    hybrid run's files. ``first`` finds the sharded state dict (its ``"mesh"``) in saved rank
    0's part, which is read for it. A flat run's files come back as they are.

    Example::

        size, read = one_copy(4, lambda q: files[q], lambda part: part["model"])
        shard = reshard_sharded_state_dict(
            layout, {s: read(s)["model"] for s in source_ranks(layout, size)})
    """
    row = replica_ranks(first(read(0)), saved_world_size)
    if row == list(range(saved_world_size)):
        return saved_world_size, read
    return len(row), lambda s: read(row[s])


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
                    "it (replica_ranks(files[0], len(files)) names them; tandem.checkpoint does "
                    "this itself), or save a full checkpoint"
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
        "mesh": mesh_record(layout),
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
