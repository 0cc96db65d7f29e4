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
``optimizer.param_groups.0.lr``). The engines map onto it through their full-state paths
(:mod:`tandem.parallel.adapters`): tandem.DDP and plain modules give their module's state;
tandem.FullyShardedDataParallel, tandem.ShardedOptimizer and an optimizer over FSDP shards
**gather the full tensors to rank 0, which writes them all** (this first version writes no
DTensor shards: the memory of rank 0 bounds the model, as ``kind="full"`` does). Loading, each
rank reads the whole tensors of the keys it loads through DCP's planner (no process needs to
have written them: any world size) and loads them through the same full-state paths, each
keeping its own slices. Objects with per-rank state (:class:`tandem.checkpoint.RNG`) and
engines have no place in this layout and are refused; save them with tandem's own format.

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

import io
import itertools
import warnings
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tandem import _dist
from tandem.checkpoint.entries import (
    Entry,
    ModelEntry,
    OptimizerEntry,
    StatefulEntry,
    ValueEntry,
)
from tandem.checkpoint.phases import agree, classify_state, settle
from tandem.checkpoint.run_dir import CheckpointError
from tandem.parallel.adapters import OptimizerState, listed, unwrap

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

# torch.distributed.checkpoint is imported where it is used: 0.7 s that every process importing
# tandem.checkpoint would otherwise pay, saving DCP or not.

__all__ = ["is_dcp", "load_dcp", "read_dcp_weights", "save_dcp"]

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


def save_dcp(state: Mapping[str, Any], path: str | Path) -> Path:
    """Save ``state`` to the DCP directory ``path`` in torch's layout (a collective).

    Args:
        state: what :func:`tandem.checkpoint.save` takes: key -> model (plain, tandem.DDP,
            torch's DDP, tandem.FullyShardedDataParallel), optimizer (plain,
            tandem.ShardedOptimizer, one over an FSDP model's shards), object with
            ``state_dict()`` (a scheduler), or plain value. Sharded ones are gathered to
            rank 0, which writes every tensor (see the module doc). The same keys on every
            rank.
        path: the directory; created. DCP writes ``.metadata`` last, on rank 0.

    Returns:
        ``path``, on every rank.

    Raises:
        ValueError: a value with no place in DCP's layout (an engine, per-rank state), an
            optimizer whose parameters belong to no model of ``state``, or ranks that
            disagree on the keys; raised on every rank, before anything is written.
        OSError: DCP could not write (on every rank).

    Example::

        save_dcp({"model": model, "optimizer": opt, "step": 100}, "ckpt/dcp-100")
    """
    path = Path(path)
    entries = _agreed_entries(state, path, "save")
    local: Exception | None = None
    names: dict[str, list[str]] = {}
    try:
        names = {e.key: _optimizer_names(e.state, entries) for e in _optimizers(entries)}
    except ValueError as error:
        local = ValueError(f"cannot save DCP checkpoint {path}: {error}")
    settle(local)
    # Every full state is rank 0's (a gather where sharded); the other ranks write nothing.
    mine = _dist.group_rank() == 0
    out: dict[str, Any] = {}
    for e in entries:
        value = _saved_value(e, names.get(e.key, []))
        if mine:
            out[e.key] = value
    try:
        import torch.distributed.checkpoint as torch_dcp

        torch_dcp.save(out, checkpoint_id=path)
    except torch_dcp.api.CheckpointException as e:  # raised on every rank by DCP
        raise OSError(f"could not save DCP checkpoint {path}: {e}") from e
    return path


def _saved_value(entry: Entry, names: list[str]) -> Any:
    """What ``entry`` is in DCP's layout (a collective for sharded objects; None off rank 0)."""
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


# -- loading ------------------------------------------------------------------------------------


def _safe_load_planner() -> Any:
    """DCP's planner over a flat dict of its keys, unpickling values with ``weights_only``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return SafeLoadPlanner(flatten_state_dict=False)


def load_dcp(state: MutableMapping[str, Any], path: str | Path) -> None:
    """Load the DCP checkpoint at ``path`` into the values of ``state``, in place (a collective).

    Each key of ``state`` is read from the checkpoint's entry of that name, in torch's layout
    (see the module doc): models through their full-state load (FSDP keeps each rank's slices),
    optimizers by parameter name, stateful objects through ``load_state_dict``, plain values
    put back into ``state``. Keys the checkpoint holds and ``state`` lacks (a data loader's
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
    entries = _agreed_entries(state, path, "load")
    local: Exception | None = None
    try:
        metadata = _metadata(path)
        _check_keys(path, metadata, [e.key for e in entries])
    except (ValueError, CheckpointError) as error:
        local = error
    settle(local)
    saved = _read(path, metadata, [e.key for e in entries], no_dist=False)
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
            _load_entry(state, entry, loaded[entry.key])
    except Exception as error:  # an object's own refusal: raised on every rank
        local = error
    settle(local)


def _metadata(path: Path) -> Metadata:
    if not is_dcp(path):
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


def _placeholders(path: Path, metadata: Metadata, keys: list[str]) -> dict[str, Any]:
    """A flat dict of the DCP keys under ``keys``, with an empty tensor for each tensor."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    _check_keys(path, metadata, keys)
    places = _places(metadata)
    flat: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if places.get(fqn, (None,))[0] not in keys:
            continue
        if isinstance(item, TensorStorageMetadata):
            flat[fqn] = torch.empty(item.size, dtype=item.properties.dtype)
        elif isinstance(item, BytesStorageMetadata):
            flat[fqn] = None
        else:
            raise ValueError(f"DCP checkpoint {path}: {fqn} is a {type(item).__name__}")
    return flat


def _places(metadata: Metadata) -> dict[str, Path_]:
    return {k: tuple(p) for k, p in (metadata.planner_data or {}).items()}


def _read(path: Path, metadata: Metadata, keys: list[str], *, no_dist: bool) -> dict[str, Any]:
    """The entries ``keys`` of the checkpoint, nested as saved, whole tensors (a collective
    unless ``no_dist``)."""
    wanted = _placeholders(path, metadata, keys)
    import torch.distributed.checkpoint as torch_dcp

    planner = _safe_load_planner()
    try:
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
    with warnings.catch_warnings():  # DCP's note that it reads in one process: that is the aim
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
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


def _load_entry(state: MutableMapping[str, Any], entry: Entry, saved: Any) -> None:
    if isinstance(entry, ModelEntry | OptimizerEntry):
        entry.state.load_full(saved)
    elif isinstance(entry, StatefulEntry):
        entry.obj.load_state_dict(saved)
    elif isinstance(entry, ValueEntry):
        state[entry.key] = entry.loaded(saved)
