"""Checkpoints in the format of ``torch.distributed.checkpoint`` (DCP), both ways.

:func:`save_dcp` writes a DCP directory that torch's own tools read; :func:`load_dcp` reads one
that torch wrote (from a plain model, torch's DDP, FSDP2 ``fully_shard``) into tandem's engines
at any world size; :func:`is_dcp` tells a DCP directory (one with DCP's ``.metadata`` file).

The layout is the one ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives a model
and its optimizer, under the keys of the state dict passed::

    {"model":     the plain module's state_dict(): parameter names without a wrapper prefix
                  ("module.", "_orig_mod."), whole tensors,
     "optimizer": {"state": {parameter name: {"step", "exp_avg", ...}},
                   "param_groups": [{hyperparameters..., "params": [parameter names]}]},
     "scheduler": its state_dict(), "step": a plain value, ...}

which DCP stores flattened (``model.fc.weight``, ``optimizer.state.fc.weight.exp_avg``,
``optimizer.param_groups.0.lr``) with each tensor's global shape in its ``.metadata``.

**Who writes what.** A tandem.FullyShardedDataParallel model and an optimizer over its shards
are written **sharded, with no gather**: each rank writes the elements of its own flat slices
to its own file (``__<rank>_0.distcp``), as DCP chunks; rank 0 adds what every rank holds alike
(buffers, frozen parameters, Adam's per-parameter ``step``, the parameter groups), so no
process ever holds the whole model. A flat slice is a run of each parameter's elements in
row-major order, which may start and end mid-row; DCP's chunks are N-d boxes, so each run is
written as the few boxes it is made of (:func:`boxes`: a partial first row, whole rows, a
partial last row, and so on one dimension down; at most ``2 * ndim - 1``). DCP's readers take
any boxes: torch's planner loads them into a plain state dict or into FSDP2's row shards at
any world size. A tandem.ShardedOptimizer's state is written **by each owner**, no gather:
each rank the state of the parameters it owns, as whole tensors under their parameters' names
(a hybrid optimizer: the ranks of global rank 0's node, each node holding the same state), and
rank 0 the parameter groups: the metadata a gathered save writes, so a plain optimizer reads
it. A plain module, tandem.DDP or torch's DDP (whole on every rank) and a plain optimizer are
written by rank 0 alone.

**In the background** (``async_=True``): the same writer as tandem's own format
(:mod:`tandem.checkpoint.async_save`): the call agrees, then copies what this rank writes into
the writer's staging memory; DCP's save runs in the writer thread from that copy, its
collectives over a Gloo group of their own (not the training's), rank 0's ``.metadata``
under the writer's commit. One save in flight, either format; errors on every rank at
``wait()``, the next save or load, or the exit. Staging memory: one copy of what this rank
writes, reused between saves of the same shapes: on rank 0 the replicated model and plain
optimizers (whole), on every rank its FSDP slices and the state of its ShardedOptimizer
parameters.

**Complete means ``.metadata``.** DCP's rank 0 writes it last, once every rank's files are
written and fsynced, to a temporary name renamed into place; this module then syncs the
directory. The data files of a save over an older checkpoint are written in place, so rank 0
first removes the older ``.metadata`` (before any rank writes: DCP's first collective waits for
rank 0). A save killed at any moment leaves the older checkpoint untouched or a directory with
no ``.metadata``, which :func:`load_dcp` refuses as not complete, and torch's ``dcp.load`` too.

**Who reads what.** Loading into a tandem FSDP model (and its optimizer), each rank asks DCP's
reader only for the elements of its own slices (the boxes of its runs; DCP reads the saved
chunks they overlap), at any world size, whoever wrote the checkpoint: tandem at another world
size, FSDP2 (row shards), one process. A ShardedOptimizer reads only the state of the
parameters this rank owns (its full-state load keeps no other). Other objects read the whole
tensors of their keys and load them through their full-state paths. Objects with per-rank state
(:class:`tandem.checkpoint.RNG`) and engines have no place in this layout and are refused; save
them with tandem's own format.

Safer than DCP's own loading: values that are not tensors (hyperparameters, a scheduler's
state) are unpickled with ``torch.load(weights_only=True)``, so no code in a checkpoint runs.
Unlike a ``tandem.checkpoint`` file, a DCP directory carries no checksum.

Every check (the state's keys against the checkpoint's, each model's keys and shapes, each
optimizer's parameter groups by name) runs on every rank before anything loads, and a problem
on any rank is raised on every rank (ValueError or CheckpointError, naming the path and key).

Example::

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    save_dcp({"model": tandem.DDP(net), "optimizer": opt}, "ckpt/dcp-100")
    model_sd, optim_sd = get_state_dict(plain, plain_opt)          # torch's side, any job
    dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id="ckpt/dcp-100")
    set_state_dict(plain, plain_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)

    load_dcp({"model": fsdp_model, "optimizer": fsdp_opt}, "torch_run/step-100")
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import math
import time
import warnings
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, overload

import torch

from tandem import _dist
from tandem._dist import gather_objects
from tandem.checkpoint.async_save import WRITER, AsyncSave, Meeting
from tandem.checkpoint.entries import (
    Entry,
    ModelEntry,
    OptimizerEntry,
    StatefulEntry,
    ValueEntry,
)
from tandem.checkpoint.phases import ERRORS, Collected, agree, classify_state, kind_of, settle
from tandem.checkpoint.run_dir import CheckpointError
from tandem.files import fsync_dir
from tandem.parallel.adapters import FlatPiece, OptimizerState, listed, unwrap

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


# torch.distributed.checkpoint is imported where it is used: 0.7 s that every process importing
# tandem.checkpoint would otherwise pay, saving DCP or not.

__all__ = ["boxes", "holds_dcp_files", "is_dcp", "load_dcp", "read_dcp_weights", "save_dcp"]

METADATA = ".metadata"

#: A flattened DCP key's place in the nested state dict, as DCP's planner records it.
Path_ = tuple[str | int, ...]


def is_dcp(path: str | Path) -> bool:
    """Whether ``path`` is a DCP checkpoint: a directory holding DCP's ``.metadata`` file.

    Example::

        >>> is_dcp("/nonexistent")
        False
    """
    path = Path(path)
    return path.is_dir() and (path / METADATA).is_file()


# -- saving -------------------------------------------------------------------------------------


@overload
def save_dcp(
    state: Mapping[str, Any], path: str | Path, *, async_: Literal[False] = ...
) -> Path: ...
@overload
def save_dcp(state: Mapping[str, Any], path: str | Path, *, async_: Literal[True]) -> AsyncSave: ...
@overload
def save_dcp(state: Mapping[str, Any], path: str | Path, *, async_: bool) -> Path | AsyncSave: ...


def save_dcp(
    state: Mapping[str, Any], path: str | Path, *, async_: bool = False
) -> Path | AsyncSave:
    """Save ``state`` to the DCP directory ``path`` in torch's layout (a collective).

    Args:
        state: what :func:`tandem.checkpoint.save` takes: key -> model (plain, tandem.DDP,
            torch's DDP, tandem.FullyShardedDataParallel), optimizer (plain,
            tandem.ShardedOptimizer, one over an FSDP model's shards), object with
            ``state_dict()`` (a scheduler), or plain value. An FSDP model and its optimizer
            are written by every rank, each its own slices, a ShardedOptimizer's state by
            each owner; the rest by rank 0 (see the module doc). The same keys on every rank.
        path: the directory; created. Each rank writes its own file; DCP writes
            ``.metadata`` last, on rank 0, once every rank's file is written and fsynced: a
            save that did not finish leaves no ``.metadata`` (an older one at ``path`` is
            removed before anything is written), so nothing loads it as complete.
        async_: return once the state is copied to host memory, and write the directory in
            the background (:mod:`tandem.checkpoint.async_save`'s writer, shared with the
            tandem format: at most one save in flight; errors raised on every rank by
            ``wait()``, else by the next save or load).

    Returns:
        ``path``, on every rank; with ``async_``: an :class:`AsyncSave` whose ``wait()``
        returns ``path`` once ``.metadata`` is written.

    Raises:
        ValueError: a value with no place in DCP's layout (an engine, per-rank state), an
            optimizer whose parameters belong to no model of ``state``, or ranks that
            disagree on the keys or on ``async_``; raised on every rank, before anything is
            written.
        OSError: DCP could not write (on every rank; with ``async_``, by ``wait()``).

    Example::

        save_dcp({"model": model, "optimizer": opt, "step": 100}, "ckpt/dcp-100")
        handle = save_dcp(state, "ckpt/dcp-200", async_=True)
        ...                                                   # training goes on
        handle.wait()
    """
    return write_dcp(state, path, async_=async_, problem=None, started=time.monotonic())


def write_dcp(
    state: Mapping[str, Any],
    path: str | Path,
    *,
    async_: bool,
    problem: Exception | None,
    started: float,
) -> Path | AsyncSave:
    """:func:`save_dcp`, with ``problem``: the caller's refusal of its arguments (None: none),
    raised on every rank with the ranks' own checks; ``started``: when the save was called
    (``time.monotonic()``), for the handle's ``blocked_s``."""
    path = Path(path)
    if problem is None and not isinstance(async_, bool):
        problem = ValueError(f"async_ must be True or False, not {async_!r}")
    WRITER.settle("tandem.checkpoint.save")  # at most one save in flight, either format
    # Phase 1: the ranks agree on the values, then on what each can write and on async_.
    entries, refused = classify_state(state)
    if problem is None:
        problem = refused if refused is not None else _refused(entries)
    agree(entries, problem, path, "save")
    local: Exception | None = None
    names: dict[str, list[str]] = {}
    try:
        names = {e.key: _optimizer_names(e.state, entries) for e in _optimizers(entries)}
    except ValueError as error:
        local = ValueError(f"cannot save DCP checkpoint {path}: {error}")
    _settle_alike(local, bool(async_), path)
    # Phase 2: what this rank writes; the tensors are the live ones (views of them).
    out = _written(entries, names, _dist.group_rank() == 0)
    if not async_:
        return _write(path, out, None, Meeting())
    # Phases 3 and 4 in the background, from a copy: the caller may change the objects now.
    group = _BACKGROUND.group()
    collected = Collected(states={}, parts={"dcp": _stageable(out)}, mine={})
    write = functools.partial(_write_staged, path, group)
    return WRITER.start(path, collected, write, _dist.group_rank(), started)


def _settle_alike(local: Exception | None, async_: bool, path: Path) -> None:
    """Raise on every rank if any rank's ``local`` is an error, or the ranks' ``async_``
    differ (one gather: those that would write in the background would wait in another group
    than those that would not)."""
    if _dist.group_size() == 1:
        if local is not None:
            raise local
        return
    everyone = gather_objects((None if local is None else (kind_of(local), str(local)), async_))
    failed = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if failed:
        text = "; ".join(f"rank {r}: {message}" for r, (_, message) in failed)
        raise ERRORS[failed[0][1][0]](text) from local
    if len({a for _, a in everyone}) > 1:
        seen = ", ".join(f"rank {r}: {a}" for r, (_, a) in enumerate(everyone))
        raise ValueError(
            f"tandem.checkpoint.save of DCP checkpoint {path}: the ranks pass different "
            f"async_ ({seen}); every rank passes the same"
        )


def _written(entries: list[Entry], names: dict[str, list[str]], lead: bool) -> dict[str, Any]:
    """What this rank writes, by key (``lead``: rank 0, which writes what all hold alike)."""
    out: dict[str, Any] = {}
    for e in entries:
        if _pieced(e):
            # Every rank its own elements; rank 0 what all hold alike (buffers, steps, groups).
            out[e.key] = _pieces_value(e, lead)
        elif isinstance(e, OptimizerEntry) and e.state.owned() is not None:
            # Every owner its own parameters' state; rank 0 the parameter groups.
            out[e.key] = _owners_value(e.state, names[e.key], lead)
        elif lead:
            # A whole state is rank 0's; the others write none of it.
            out[e.key] = _saved_value(e, names.get(e.key, []))
    return out


def _owners_value(adapter: OptimizerState, names: list[str], lead: bool) -> dict[str, Any]:
    """What this rank writes of an optimizer whose ranks each hold their own parameters' state
    (a ShardedOptimizer): that state, by name, as the gathered state names it (so the metadata
    is the gathered save's, and a plain optimizer's state dict reads it); ``lead`` adds the
    parameter groups."""
    out: dict[str, Any] = {"state": {names[k]: s for k, s in adapter.owned_state().items()}}
    if lead:
        # The outer groups: every parameter, the hyperparameters a scheduler set last.
        out["param_groups"], start = [], 0
        for g in adapter.optimizer.param_groups:
            hyper = {k: v for k, v in g.items() if k != "params"}
            out["param_groups"].append({**hyper, "params": names[start : start + len(g["params"])]})
            start += len(g["params"])
    return out


def _write(path: Path, out: dict[str, Any], group: Any, meeting: Meeting) -> Path:
    """Phases 3 and 4 (a collective over ``group``, None: the default one): every rank's file
    written and fsynced, then rank 0's ``.metadata``, which commits. An older ``.metadata`` is
    removed first: the data files are written over in place, and the old metadata would
    describe them as complete while they are half written."""
    import torch.distributed.checkpoint as torch_dcp

    if _dist.group_rank() == 0:
        # Before any rank writes: DCP's first collective (its plans) waits for rank 0's.
        stale = path / METADATA
        if stale.is_file():
            stale.unlink()
            fsync_dir(path)
    try:
        torch_dcp.save(
            out,
            storage_writer=_committing_writer()(path, meeting),
            planner=_pieces_save_planner(),
            process_group=group,
        )
    except torch_dcp.api.CheckpointException as e:  # raised on every rank by DCP
        raise OSError(f"could not save DCP checkpoint {path}: {e}") from e
    return path


def _write_staged(path: Path, group: Any, staged: Collected, meeting: Meeting) -> Path:
    """:func:`_write` in the background, from the staging copy."""
    return _write(path, _unstaged(staged.parts["dcp"]), group, meeting)


def _committing_writer() -> type:
    """DCP's file writer whose ``finish`` (rank 0 writing ``.metadata``: the commit) runs as
    a tandem save's commit does: refused once the save was given up, one at a time in the
    process, and the directory synced after, so a committed save outlives a power loss."""
    from torch.distributed.checkpoint import FileSystemWriter

    class CommittingWriter(FileSystemWriter):
        def __init__(self, path: Path, meeting: Meeting) -> None:
            super().__init__(str(path))
            self.meeting = meeting

        def _metadata_exists(self) -> bool:
            # DCP's check of an older checkpoint here only warns; rank 0 removes its
            # .metadata itself before any rank writes, and this check, on the other ranks,
            # races that removal.
            return False

        def finish(self, metadata: Any, results: Any) -> None:
            with self.meeting.commit():
                super().finish(metadata, results)
                fsync_dir(Path(self.path))

    return CommittingWriter


class _StagedPiece(NamedTuple):
    """A :class:`FlatPiece` as the staging memory copies it: a named tuple, whose tensor the
    staging copies into its reused memory (a FlatPiece it would deep-copy, and with it the
    whole flat shard its values are a view of)."""

    shape: torch.Size
    start: int
    values: torch.Tensor


def _stageable(tree: Any) -> Any:
    """``tree`` with its pieces as :class:`_StagedPiece`."""
    if isinstance(tree, FlatPiece):
        return _StagedPiece(tree.shape, tree.start, tree.values)
    if isinstance(tree, dict):
        return {k: _stageable(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_stageable(v) for v in tree]
    return tree


def _unstaged(tree: Any) -> Any:
    """:func:`_stageable` undone, on the staging copy."""
    if isinstance(tree, _StagedPiece):
        return FlatPiece(torch.Size(tree.shape), tree.start, tree.values)
    if isinstance(tree, dict):
        return {k: _unstaged(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_unstaged(v) for v in tree]
    return tree


class _BackgroundGroup:
    """The Gloo group the background writes' DCP collectives run in: not the training's, so
    that they never interleave with its collectives. Made at the first asynchronous DCP save
    (a collective), again in a new world."""

    def __init__(self) -> None:
        self._group: Any = None
        self._for: Any = None

    def group(self) -> Any:
        if _dist.group_size() == 1:
            return None
        import torch.distributed as dist

        world = dist.group.WORLD
        if self._group is None or self._for is not world:
            self._group = dist.new_group(backend="gloo", group_desc="tandem DCP writer")
            self._for = world
        return self._group


_BACKGROUND = _BackgroundGroup()


def _pieced(entry: Entry) -> bool:
    """Whether ``entry`` is saved and loaded as each rank's pieces (an FSDP model and an
    optimizer over its shards), not as one whole state."""
    return isinstance(entry, ModelEntry | OptimizerEntry) and entry.state.pieced


def _pieces_value(entry: Entry, lead: bool) -> Any:
    """What this rank writes of a pieced ``entry``: its pieces, and on ``lead`` (rank 0) the
    values every rank holds alike."""
    if isinstance(entry, ModelEntry):
        pieces: dict[str, Any] = dict(entry.state.pieces())
        return {**entry.state.replicated(), **pieces} if lead else pieces
    assert isinstance(entry, OptimizerEntry)
    tree = entry.state.pieces()
    if lead:
        return tree
    return {
        "state": {
            name: {k: v for k, v in s.items() if isinstance(v, FlatPiece)}
            for name, s in tree["state"].items()
        }
    }


def _saved_value(entry: Entry, names: list[str]) -> Any:
    """What ``entry`` is in DCP's layout, on rank 0 (a whole state: nothing collective)."""
    if isinstance(entry, ModelEntry):
        return entry.state.full(0)
    if isinstance(entry, OptimizerEntry):
        full = entry.state.full(0)
        return None if full is None else _by_name(full, names)
    if isinstance(entry, StatefulEntry):
        return entry.obj.state_dict()
    return entry.obj


def _by_name(full: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """A plain optimizer state dict (parameters by position) keyed by parameter name."""
    return {
        "state": {names[i]: dict(s) for i, s in full["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in full["param_groups"]
        ],
    }


def _agreed_entries(state: Mapping[str, Any], path: Path, verb: str) -> list[Entry]:
    """``state``'s entries; ValueError on every rank if a rank refused its state, a value has
    no place in DCP's layout, or the ranks' keys differ."""
    entries, problem = classify_state(state)
    if problem is None:
        problem = _refused(entries)
    agree(entries, problem, path, verb)
    return entries


def _refused(entries: list[Entry]) -> ValueError | None:
    """Why a value has no place in DCP's layout, or None."""
    for e in entries:
        if isinstance(e, StatefulEntry) and e.has_rank_state:
            return ValueError(
                f"{e.what} ({type(e.obj).__name__}) holds per-rank state, which DCP's layout "
                "has no place for: leave it out of a DCP checkpoint, or save with tandem's "
                "own format"
            )
        if not isinstance(e, ModelEntry | OptimizerEntry | StatefulEntry | ValueEntry):
            return ValueError(
                f"{e.what} is a {type(e.obj).__name__}: a DCP checkpoint takes its model and "
                "optimizer under keys of their own ({'model': engine.model, 'optimizer': "
                "engine.optimizer})"
            )
    return None


def _optimizers(entries: list[Entry]) -> list[OptimizerEntry]:
    return [e for e in entries if isinstance(e, OptimizerEntry)]


def _optimizer_names(adapter: OptimizerState, entries: list[Entry]) -> list[str]:
    """The parameter name of each position of the optimizer's full (plain) state dict."""
    known = adapter.full_names()  # over FSDP's shards: the plain module's parameters
    if known is not None:
        return known
    by_id = {
        id(p): name
        for e in entries
        if isinstance(e, ModelEntry)
        for name, p in unwrap(e.obj)[0].named_parameters()
    }
    params = [p for g in adapter.optimizer.param_groups for p in g["params"]]
    strays = sum(id(p) not in by_id for p in params)
    if strays:
        raise ValueError(
            f"{strays} of the optimizer's {len(params)} parameters belong to no model of the "
            "state: DCP names an optimizer's state by its parameters' names, so put the model "
            "it steps in the same state dict"
        )
    return [by_id[id(p)] for p in params]


def _group_names(adapter: OptimizerState, names: list[str]) -> list[list[str]]:
    """The names of each of the live optimizer's groups, in its full state dict's order."""
    groups = adapter.optimizer.param_groups
    positions = [adapter.full_positions(g) for g in groups]
    if all(p is not None for p in positions):
        return [[names[i] for i in p] for p in positions if p is not None]
    sizes = [len(g["params"]) for g in adapter.optimizer.param_groups]
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return [names[s : s + n] for s, n in zip(starts, sizes, strict=True)]


# -- a rank's pieces as DCP chunks -------------------------------------------------------------
#
# DCP describes what a rank writes of a tensor as chunks: N-d boxes (offsets and sizes per
# dimension) of the whole tensor. tandem's flat shards cut a unit's flat buffer, so a rank holds
# a run of each parameter's elements in row-major order, not a box: a run that starts and ends
# mid-row. Every such run is a few boxes, each itself a run: the partial first row, the whole
# rows, the partial last row, and the same again one dimension down for the partial rows of a
# 3-d or higher tensor (at most 2*ndim - 1 boxes). The boxes of all ranks tile the tensor
# exactly, so DCP's own check of a save plan (no overlap, full cover) holds, and any reader
# (torch's planner with DTensor rows, another tandem world size) takes the parts of each box
# it overlaps. A rank's pieces are never copied whole anywhere: each box is a view of them.


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[list[int], list[int]]]:
    """The boxes ``(offsets, sizes)`` that the elements ``[start, stop)`` (row-major) of a tensor
    of ``shape`` are made of, in order: each box is itself a run of consecutive elements.

    Example::

        >>> boxes((3, 4), 2, 11)       # the end of row 0, row 1 whole, the start of row 2
        [([0, 2], [1, 2]), ([1, 0], [1, 4]), ([2, 0], [1, 3])]
    """
    if start >= stop:
        return []
    if not shape:
        return [([], [])]  # a 0-d tensor's one element
    inner = math.prod(shape[1:])  # elements per row (per index of the first dimension)
    out: list[tuple[list[int], list[int]]] = []
    row = start // inner
    if start % inner:  # a partial first row: its own runs, one dimension down
        end = min(stop, (row + 1) * inner)
        for offsets, sizes in boxes(shape[1:], start - row * inner, end - row * inner):
            out.append(([row, *offsets], [1, *sizes]))
        start, row = end, row + 1
    whole = stop // inner - row
    if whole > 0 and start < stop:
        out.append(([row, *[0] * (len(shape) - 1)], [whole, *shape[1:]]))
        start, row = (row + whole) * inner, row + whole
    if start < stop:  # a partial last row
        for offsets, sizes in boxes(shape[1:], 0, stop - row * inner):
            out.append(([row, *offsets], [1, *sizes]))
    return out


def _piece_boxes(piece: FlatPiece) -> list[tuple[torch.Size, torch.Size, int]]:
    """The boxes of ``piece`` with where each begins in ``piece.values``. A tensor with no
    elements is one empty box (every rank gives it; DCP keeps one)."""
    if piece.shape.numel() == 0:
        return [(torch.Size([0] * len(piece.shape)), piece.shape, 0)]
    out, begin = [], 0
    for offsets, sizes in boxes(tuple(piece.shape), piece.start, piece.stop):
        out.append((torch.Size(offsets), torch.Size(sizes), begin))
        begin += math.prod(sizes)
    return out


def _box_view(piece: FlatPiece, offsets: torch.Size | None) -> torch.Tensor:
    """The box of ``piece`` at ``offsets``, a view of its values (written and read in place)."""
    for at, sizes, begin in _piece_boxes(piece):
        if at == offsets:
            return piece.values[begin : begin + sizes.numel()].view(sizes)
    raise ValueError(f"no box at {offsets} in {piece.shape} elements [{piece.start}, {piece.stop})")


def _pieces_save_planner() -> Any:
    """DCP's save planner, with this rank's :class:`FlatPiece` values written as their boxes."""
    from torch.distributed.checkpoint.default_planner import (
        DefaultSavePlanner,
        create_default_local_save_plan,
    )
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class PiecesSavePlanner(DefaultSavePlanner):
        def create_local_plan(self) -> Any:
            whole = {k: v for k, v in self.state_dict.items() if not isinstance(v, FlatPiece)}
            plan = create_default_local_save_plan(whole, self.is_coordinator)
            items = list(plan.items)
            for fqn, piece in self.state_dict.items():
                if not isinstance(piece, FlatPiece):
                    continue
                properties = TensorProperties.create_from_tensor(piece.values)
                for offsets, sizes, _ in _piece_boxes(piece):
                    items.append(
                        WriteItem(
                            index=MetadataIndex(fqn, offsets),
                            type=WriteItemType.SHARD,  # several boxes of one tensor
                            tensor_data=TensorWriteData(
                                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                properties=properties,
                                size=piece.shape,
                            ),
                        )
                    )
            self.plan = dataclasses.replace(plan, items=items, planner_data=self.mappings)
            return self.plan

        def lookup_object(self, index: Any) -> Any:
            value = self.state_dict[index.fqn]
            if isinstance(value, FlatPiece):
                return _box_view(value, index.offset)
            return super().lookup_object(index)

    return PiecesSavePlanner()


# -- loading ------------------------------------------------------------------------------------


def _safe_load_planner() -> Any:
    """DCP's planner over a flat dict of its keys, unpickling values with ``weights_only``, that
    reads into a :class:`FlatPiece` only the boxes of the saved chunks its elements overlap."""
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        create_default_local_load_plan,
    )
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SafeLoadPlanner(DefaultLoadPlanner):
        def set_up_planner(
            self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
        ) -> None:
            # Not DefaultLoadPlanner's: it turns every value it does not know (a piece) into
            # None on the way to materialising meta tensors, which this dict never holds.
            self.original_state_dict = self.state_dict = state_dict
            self.metadata = metadata
            self.is_coordinator = is_coordinator

        def create_local_plan(self) -> Any:
            assert self.metadata is not None  # DCP sets the planner up with it
            whole = {k: v for k, v in self.state_dict.items() if not isinstance(v, FlatPiece)}
            items = list(create_default_local_load_plan(whole, self.metadata, True).items)
            for fqn, piece in self.state_dict.items():
                if not isinstance(piece, FlatPiece) or piece.shape.numel() == 0:
                    continue
                held = self.metadata.state_dict_metadata[fqn]
                if not isinstance(held, TensorStorageMetadata) or held.size != piece.shape:
                    raise ValueError(f"{fqn}: the checkpoint holds {held}, not {piece.shape}")
                chunks = [
                    ChunkStorageMetadata(offsets=offsets, sizes=sizes)
                    for offsets, sizes, _ in _piece_boxes(piece)
                ]
                items += create_read_items_for_chunk_list(fqn, held, chunks)
            return LoadPlan(items)

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            value = self.state_dict[index.fqn]
            if isinstance(value, FlatPiece):
                return _box_view(value, index.offset)
            return super().lookup_tensor(index)

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def load_dcp(state: MutableMapping[str, Any], path: str | Path) -> None:
    """Load the DCP checkpoint at ``path`` into the values of ``state``, in place (a collective).

    Each key of ``state`` is read from the checkpoint's entry of that name, in torch's layout
    (see the module doc): an FSDP model and its optimizer by slices (each rank reads only the
    elements of its own), other models through their full-state load, optimizers by parameter
    name, stateful objects through ``load_state_dict``, plain values put back into
    ``state``. Keys the checkpoint holds and ``state`` lacks (a data loader's
    state, say) are not read. Every process must see the directory; any world size.

    Args:
        state: key -> model, optimizer, stateful object or placeholder, as for
            :func:`save_dcp`.
        path: a DCP directory, written by torch (``dcp.save``) or by :func:`save_dcp`.

    Raises:
        CheckpointError: no DCP checkpoint at ``path``, or one DCP could not read.
        ValueError: it does not fit ``state``: a key it lacks, a model's missing, unexpected or
            reshaped keys, an optimizer's parameter groups (each names the key and what
            differs). Nothing has changed then.

    Example::

        state = {"model": tandem.DDP(net), "optimizer": opt, "step": 0}
        load_dcp(state, "torch_run/step-100")
        start = state["step"]
    """
    path = Path(path)
    WRITER.settle("tandem.checkpoint.load")  # a save still being written first
    entries = _agreed_entries(state, path, "load")
    local: Exception | None = None
    targets: dict[str, Any] = {}  # the buffers a pieced entry's pieces are read into
    pieces: dict[str, FlatPiece] = {}  # by DCP key
    skipped: set[str] = set()  # the DCP keys this rank does not read
    try:
        metadata = _metadata(path)
        _check_keys(path, metadata, [e.key for e in entries])
        # Models' keys and shapes from the metadata, before any piece is cut to their shapes.
        for e in entries:
            if isinstance(e, ModelEntry):
                _checked(path, e, _shapes(metadata, e.key), entries)
        for e in entries:
            if _pieced(e):
                mine, targets[e.key] = _empty_pieces(path, e, metadata)
                pieces.update(mine)
            elif isinstance(e, OptimizerEntry) and (owned := e.state.owned()) is not None:
                names = _optimizer_names(e.state, entries)
                skipped |= _not_owned(metadata, e.key, owned, names)
    except (ValueError, CheckpointError) as error:
        local = error
    settle(local)
    keys = [e.key for e in entries]
    saved = _read(path, metadata, keys, no_dist=False, pieces=pieces, skipped=skipped)
    loaded: dict[str, Any] = {}
    local = None
    try:
        loaded = {e.key: _checked(path, e, saved[e.key], entries) for e in entries}
    except ValueError as error:
        local = error
    except (TypeError, KeyError, IndexError) as error:  # not torch's layout where it should be
        local = ValueError(
            f"DCP checkpoint {path} does not hold torch's state dict layout: {error!r}"
        )
    settle(local)
    local = None
    try:
        for entry in entries:
            _load_entry(state, entry, loaded[entry.key], targets.get(entry.key))
    except Exception as error:  # an object's own refusal: raised on every rank
        local = error
    settle(local)


def _not_owned(metadata: Metadata, key: str, owned: list[bool], names: list[str]) -> set[str]:
    """The DCP keys under ``key`` of the state of the parameters this rank does not own
    (``owned``, ``names``: by position): it keeps only its own parameters' state, so it reads
    only theirs."""
    mine = {n for n, own in zip(names, owned, strict=True) if own}
    return {
        fqn
        for fqn, where in _places(metadata).items()
        if where[:2] == (key, "state") and len(where) > 2 and where[2] not in mine
    }


def _shapes(metadata: Metadata, key: str) -> dict[str, Any]:
    """The model state dict under ``key`` as the metadata describes it: a meta tensor (shape,
    dtype, no memory) for each tensor, None for other values."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, Any] = {}
    for fqn, where in _places(metadata).items():
        if where[0] == key and len(where) > 1:
            item = metadata.state_dict_metadata[fqn]
            out[str(where[1])] = (
                torch.empty(item.size, dtype=item.properties.dtype, device="meta")
                if isinstance(item, TensorStorageMetadata) and len(where) == 2
                else None
            )
    return out


def _empty_pieces(path: Path, entry: Entry, metadata: Metadata) -> tuple[dict[str, FlatPiece], Any]:
    """The pieces a pieced ``entry`` reads this rank's elements into, by DCP key, and what
    they are views of (for its ``load_pieces``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    fqn_of = {where: fqn for fqn, where in _places(metadata).items()}
    if isinstance(entry, ModelEntry):
        by_name, flats = entry.state.empty_pieces()
        return {fqn_of[(entry.key, name)]: piece for name, piece in by_name.items()}, flats
    assert isinstance(entry, OptimizerEntry)
    held: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = {}
    for fqn, where in _places(metadata).items():
        item = metadata.state_dict_metadata[fqn]
        # (key, "state", parameter name, state key): a tensor of an optimizer's state
        state_tensor = where[:2] == (entry.key, "state") and len(where) == 4
        if state_tensor and isinstance(item, TensorStorageMetadata):
            held.setdefault(str(where[2]), {})[str(where[3])] = (item.size, item.properties.dtype)
    try:
        by_key, buffers = entry.state.empty_pieces(held)
    except ValueError as e:
        raise ValueError(f"DCP checkpoint {path}: {entry.what}: {e}") from e
    out = {
        fqn_of[(entry.key, "state", name, k)]: piece
        for name, per_key in by_key.items()
        for k, piece in per_key.items()
    }
    return out, buffers


def holds_dcp_files(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding DCP's data files (``*.distcp``), complete or
    not: a DCP save that did not finish leaves them without ``.metadata``.

    Example::

        >>> holds_dcp_files("/nonexistent")
        False
    """
    path = Path(path)
    return path.is_dir() and any(path.glob("*.distcp"))


def _metadata(path: Path) -> Metadata:
    if not is_dcp(path):
        if holds_dcp_files(path):
            raise CheckpointError(
                f"{path} is not a complete DCP checkpoint: it holds DCP's data files but no "
                f"{METADATA}, which is written last (its save did not finish); load an "
                "older checkpoint"
            )
        what = "no such directory" if not path.exists() else f"no {METADATA} file in it"
        raise CheckpointError(f"{path} is not a DCP checkpoint ({what})")
    import torch.distributed.checkpoint as torch_dcp

    try:
        return torch_dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a truncated or foreign .metadata: any unpickling error
        raise CheckpointError(f"could not read DCP metadata {path / METADATA}: {e}") from e


def _check_keys(path: Path, metadata: Metadata, keys: list[str]) -> None:
    """ValueError naming the ``keys`` the checkpoint lacks, if any."""
    held = {p[0] for p in _places(metadata).values()}
    missing = [k for k in keys if k not in held]
    if missing:
        raise ValueError(
            f"DCP checkpoint {path} holds no {missing} (it holds {sorted(map(str, held))}): "
            "pass a state with its keys"
        )


def _placeholders(
    path: Path,
    metadata: Metadata,
    keys: list[str],
    pieces: Mapping[str, FlatPiece],
    skipped: set[str],
) -> dict[str, Any]:
    """A flat dict of the DCP keys under ``keys`` but ``skipped``: ``pieces[key]`` where
    given, else an empty tensor for each tensor (read whole)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    _check_keys(path, metadata, keys)
    places = _places(metadata)
    flat: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if places.get(fqn, (None,))[0] not in keys or fqn in skipped:
            continue
        if fqn in pieces:
            flat[fqn] = pieces[fqn]
        elif isinstance(item, TensorStorageMetadata):
            flat[fqn] = torch.empty(item.size, dtype=item.properties.dtype)
        elif isinstance(item, BytesStorageMetadata):
            flat[fqn] = None
        else:
            raise ValueError(f"DCP checkpoint {path}: {fqn} is a {type(item).__name__}")
    return flat


def _places(metadata: Metadata) -> dict[str, Path_]:
    return {k: tuple(p) for k, p in (metadata.planner_data or {}).items()}


def _read(
    path: Path,
    metadata: Metadata,
    keys: list[str],
    *,
    no_dist: bool,
    pieces: Mapping[str, FlatPiece] | None = None,
    skipped: set[str] | None = None,
) -> dict[str, Any]:
    """The entries ``keys`` of the checkpoint, nested as saved: whole tensors, but the DCP keys
    of ``pieces`` read into them, this rank's elements only, and those ``skipped`` not read
    (a collective unless ``no_dist``)."""
    wanted = _placeholders(path, metadata, keys, pieces or {}, skipped or set())
    import torch.distributed.checkpoint as torch_dcp

    planner = _safe_load_planner()
    try:
        with warnings.catch_warnings():
            if no_dist or not _dist.initialized():  # DCP's note that it reads in one process
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            torch_dcp.load(wanted, checkpoint_id=path, planner=planner, no_dist=no_dist)
    except torch_dcp.api.CheckpointException as e:  # raised on every rank by DCP
        raise CheckpointError(f"could not read DCP checkpoint {path}: {e}") from e
    # Tensors were read in place; the other values are in the planner's copy of the dict.
    return _nested(planner.state_dict, _places(metadata))


def read_dcp_weights(path: str | Path, key: str = "model") -> dict[str, torch.Tensor]:
    """The model state dict under ``key`` of the DCP checkpoint ``path``, read in this process
    alone (no collective): what ``tandem export`` writes out of a DCP directory.

    Raises:
        CheckpointError: no DCP checkpoint at ``path``, or one DCP could not read.
        ValueError: it holds no ``key``, or no state dict of tensors there.

    Example::

        weights = read_dcp_weights("torch_run/step-100")
        net.load_state_dict(weights, strict=True)
    """
    path = Path(path)
    weights = _read(path, _metadata(path), [key], no_dist=True)[key]
    if not isinstance(weights, dict) or not all(
        isinstance(v, torch.Tensor) for v in weights.values()
    ):
        raise ValueError(f"DCP checkpoint {path}: {key!r} holds no model state dict of tensors")
    return weights


def _nested(flat: dict[str, Any], places: dict[str, Path_]) -> dict[str, Any]:
    """The nested state dict DCP flattened: dicts by name, lists by position."""
    root: dict[str, Any] = {}
    for fqn, value in flat.items():
        node: Any = root
        for step, after in itertools.pairwise(places[fqn]):
            node = _slot(node, step, [] if isinstance(after, int) else {})
        last = places[fqn][-1]
        _slot(node, last, None)
        node[last] = value
    return root


def _slot(node: Any, key: Any, default: Any) -> Any:
    """``node[key]`` (a dict's, or a list's grown to hold it), ``default`` where unset."""
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
        if node[key] is None:
            node[key] = default
        return node[key]
    return node.setdefault(key, default)


def _checked(path: Path, entry: Entry, saved: Any, entries: list[Entry]) -> Any:
    """``saved`` in the form ``entry`` loads (an optimizer's by position); ValueError naming
    ``path``, the key and what differs unless it fits."""
    try:
        if isinstance(entry, ModelEntry):
            entry.state.check(entry.what, saved, None)
            return saved
        if isinstance(entry, OptimizerEntry):
            by_position = _by_position(entry, saved, _optimizer_names(entry.state, entries))
            entry.state.check(entry.what, by_position, None)
            return by_position
    except ValueError as e:
        raise ValueError(f"DCP checkpoint {path}: {e}") from e
    return saved


def _by_position(entry: OptimizerEntry, saved: Any, names: list[str]) -> dict[str, Any]:
    """torch's optimizer state by parameter name as the live optimizer's full state dict."""
    if not isinstance(saved, Mapping) or not {"state", "param_groups"} <= set(saved):
        raise ValueError(f"{entry.what}: the checkpoint holds no optimizer state there")
    groups = _group_names(entry.state, names)
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"{entry.what}: the checkpoint's optimizer has {len(saved_groups)} param groups, "
            f"this one {len(groups)}"
        )
    position = {name: i for i, name in enumerate(names)}
    out_groups = []
    for k, (g, mine) in enumerate(zip(saved_groups, groups, strict=True)):
        theirs = list(g["params"])
        if sorted(theirs) != sorted(mine):
            differences = listed(
                [
                    (sorted(set(mine) - set(theirs)), "that the checkpoint's group lacks"),
                    (sorted(set(theirs) - set(mine)), "that only the checkpoint's group has"),
                ],
                prefix="parameters ",
            )
            raise ValueError(f"{entry.what}: param group {k} here has {differences}")
        # A plain optimizer maps saved ids to its parameters by position within the group.
        out_groups.append({**g, "params": sorted(position[n] for n in mine)})
    unknown = sorted(set(saved["state"]) - set(position))
    if unknown:
        raise ValueError(
            f"{entry.what}: the checkpoint holds state of no parameter here: {unknown}"
        )
    return {
        "state": {position[n]: s for n, s in saved["state"].items()},
        "param_groups": out_groups,
    }


def _load_entry(state: MutableMapping[str, Any], entry: Entry, saved: Any, target: Any) -> None:
    """Load ``saved`` into ``entry``; ``target``: what a pieced entry's pieces were read into."""
    if isinstance(entry, ModelEntry) and entry.state.pieced:
        whole = {k: v for k, v in saved.items() if not isinstance(v, FlatPiece)}
        entry.state.load_pieces(target, whole)
    elif isinstance(entry, OptimizerEntry) and entry.state.pieced:
        entry.state.load_pieces(saved, target)
    elif isinstance(entry, ModelEntry | OptimizerEntry):
        entry.state.load_full(saved)
    elif isinstance(entry, StatefulEntry):
        entry.obj.load_state_dict(saved)
    elif isinstance(entry, ValueEntry):
        state[entry.key] = entry.loaded(saved)
