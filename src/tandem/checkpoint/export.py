"""Plain weights out of any tandem checkpoint, written as one safetensors file.

Where a checkpoint keeps the model (read in one process, no process group needed):

- a Trainer checkpoint (``ckpt-eEEEE-sSSSSSSSS.pt``; a run directory means its latest):
  ``state["model"]``, the plain module's ``state_dict()``, in the full kind of every engine and
  in ShardedOptimizer's sharded kind. FSDP's sharded kind has None there: each rank's flat
  shards are in ``shards/<stem>/rankNNNNN.pt`` under ``"model"``, checked against
  ``state["shards"]["sha256"][rank]``;
- a ``tandem.checkpoint.save`` file: the record of its model (or engine) value,
  ``objects[key]["state"]["model"]``, or in the sharded kind ``[key]["model"]`` of every
  rank's shard file.

FSDP shards are put back together by the layout they were cut by
(:mod:`tandem.parallel.fsdp.state`): per unit, every rank's slice in rank order is the unit's
flat buffer (padded to a multiple of the world size, :mod:`tandem.parallel.sharding`), and its
parameters lie in it one after the other, in the order and shapes the layout lists.

Keys come out as the plain module's: wrapper segments (``module.`` of DDP when every key has
it, torch FSDP's ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``, torch.compile's
``_orig_mod.``) are dropped, so the file loads with ``load_state_dict(strict=True)``.

Example::

    report = export_file("runs/lm", "lm.safetensors")
    model.load_state_dict(safetensors.torch.load_file("lm.safetensors"), strict=True)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem._optional import require
from tandem.checkpoint.dcp import is_dcp, read_dcp_weights
from tandem.checkpoint.run_dir import LATEST, CheckpointError, latest_checkpoint
from tandem.checkpoint.sealed import payload_kind, read_verified
from tandem.checkpoint.shards import read_shard
from tandem.files import write_atomic
from tandem.parallel.fsdp.reshard import replica_ranks
from tandem.parallel.fsdp.state import SHARDED_FORMAT
from tandem.parallel.sharding import flat_shard, padded_numel

_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
_MODEL_TYPES = ("model", "engine")


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_file` wrote: where, from which checkpoint, how much."""

    out: Path
    source: Path
    tensors: int
    numel: int
    nbytes: int


def export_file(source: str | Path, out: str | Path, *, key: str | None = None) -> ExportReport:
    """Write the plain weights of the checkpoint ``source`` names to ``out`` (safetensors).

    Everything is read and checked before ``out`` is written, and it is written atomically:
    on any error ``out`` is as it was.

    Args:
        source: a run directory (its latest checkpoint), its ``checkpoints`` directory or
            ``latest`` pointer, a Trainer checkpoint file, a ``tandem.checkpoint.save`` file,
            or a directory of torch's distributed checkpoint (DCP; its ``"model"`` entry, or
            ``key``'s), as torch or ``tandem.checkpoint.save(..., format="dcp")`` wrote it.
        out: the file to write (its directory is created).
        key: the model's key in a ``tandem.checkpoint.save`` file that holds several.

    Raises:
        CheckpointError: no checkpoint there, a corrupt or foreign file, a shard missing.
        ValueError: ``key`` names no model, or is needed; ``out`` is a directory or the source.
        ImportError: safetensors is missing (``pip install "tandem[export]"``).

    Example::

        report = export_file("runs/lm", "lm.safetensors")
        print(report.tensors, report.numel)
    """
    out = Path(out)
    dcp = is_dcp(source)  # before resolving: a DCP directory is no run directory
    file = Path(source) if dcp else resolve_checkpoint(Path(source))
    if out.is_dir():
        raise ValueError(f"output {out} is a directory; name the .safetensors file to write")
    if out.resolve() == file.resolve():
        raise ValueError(f"output {out} is the checkpoint itself; name another file")
    weights = strip_wrapper_prefixes(
        read_dcp_weights(file, key or "model") if dcp else plain_weights_of_file(file, key)
    )
    nbytes = write_safetensors(weights, out, {"tandem.source": str(file)})
    numel = sum(v.numel() for v in weights.values())
    return ExportReport(out=out, source=file, tensors=len(weights), numel=numel, nbytes=nbytes)


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint file ``path`` names: a directory's latest, a pointer's target, a file."""
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(
                f"no checkpoints in {path}: a run directory keeps them in checkpoints/ "
                "(ckpt-*.pt, each committed by its .sha256 file); pass a run directory or a "
                "checkpoint file"
            )
        return found
    if path.name == LATEST:
        found = latest_checkpoint(path.parent)
        assert found is not None  # the pointer exists: a name or an error came back
        return found
    return path


def plain_weights_of_file(file: Path, key: str | None = None) -> dict[str, Any]:
    """The plain module's state dict kept in the checkpoint ``file`` (see the module doc)."""
    payload = read_verified(file)
    if payload_kind(file, payload) == "trainer":
        if key is not None:
            raise ValueError(f"key={key!r}: the Trainer checkpoint {file} holds one model")
        state = payload["state"]
        if state.get("model") is not None:
            return dict(state["model"])
        if state.get("shards") is None:
            raise CheckpointError(f"checkpoint {file} holds no model state")
        return assemble_fsdp_shards([s["model"] for s in _all_shards(file, state["shards"])])
    objects = payload["objects"]
    models = [name for name, record in objects.items() if record["type"] in _MODEL_TYPES]
    if key is None:
        if len(models) != 1:
            raise ValueError(
                f"checkpoint {file} holds {len(models)} models ({models}); name the one to "
                "export (key=... / --key)"
                if models
                else f"checkpoint {file} holds no model (its values: {list(objects)})"
            )
        key = models[0]
    if key not in models:
        raise ValueError(f"checkpoint {file} holds no model under {key!r}; its models: {models}")
    saved = objects[key]["state"]["model"]
    if saved is not None:
        return dict(saved)
    shards = _all_shards(file, payload["shards"])
    return assemble_fsdp_shards([s[key]["model"] for s in shards])


def _all_shards(file: Path, shards: Any) -> list[dict[str, Any]]:
    if shards is None:
        raise CheckpointError(f"checkpoint {file} holds neither its model nor shard files")
    return [
        read_shard(file.parent, file.stem, rank, digest)
        for rank, digest in enumerate(shards["sha256"])
    ]


def assemble_fsdp_shards(shards: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's ``sharded_state_dict()``, in rank order.

    Returns the flattened parameters by every name the plain module's ``state_dict()`` has for
    them (a tied weight under each of its keys, from the shards' ``"aliases"``), and the
    buffers and frozen parameters (rank 0's: they are the same on every rank).

    Raises:
        CheckpointError: a file is not FSDP shards, the ranks' layouts differ, or a slice has
            another length than the sharding rule gives.

    Example::

        whole = assemble_fsdp_shards([torch.load(p, weights_only=True)["model"] for p in files])
    """
    if not shards:
        raise CheckpointError("no FSDP shards to assemble")
    # A hybrid run's files hold a copy of every slice per node: one copy is the whole model,
    # the files of saved rank 0's shard group (a flat run's: all of them).
    try:
        row = replica_ranks(shards[0], len(shards))
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    shards = [shards[q] for q in row]
    world_size = len(shards)
    first = shards[0]
    for rank, shard in enumerate(shards):
        if not isinstance(shard, Mapping) or shard.get("format") != SHARDED_FORMAT:
            raise CheckpointError(f"rank {rank}'s shard holds no FSDP shards ({SHARDED_FORMAT})")
        if (shard["rank"], shard["world_size"]) != (rank, world_size):
            raise CheckpointError(
                f"shard file {rank} of {world_size} holds rank {shard['rank']} of "
                f"{shard['world_size']}"
            )
        if shard["layout"] != first["layout"]:
            raise CheckpointError(f"rank {rank}'s shards were cut by another layout than rank 0's")
    weights: dict[str, torch.Tensor] = {}
    for index, unit in enumerate(first["layout"]):
        numel = sum(math.prod(shape) for _, shape in unit)
        pieces = [shard["shards"][index].reshape(-1) for shard in shards]
        for rank, piece in enumerate(pieces):
            start, stop = flat_shard(numel, world_size, rank)
            if piece.numel() != stop - start:
                raise CheckpointError(
                    f"rank {rank}'s slice of unit {index} has {piece.numel()} elements; the "
                    f"unit's {numel} over {world_size} ranks gives {stop - start}"
                )
        flat = torch.cat(pieces)
        assert flat.numel() == padded_numel(numel, world_size)  # the slices tile the padding
        offset = 0
        for fqn, shape in unit:
            size = math.prod(shape)
            weights[fqn] = flat[offset : offset + size].view(tuple(shape)).clone()
            offset += size
    # A tied weight's other keys (recorded since tandem wrote "aliases"; older shards lack
    # them, and their export lacks those keys).
    for key, fqn in first.get("aliases", {}).items():
        weights[key] = weights[fqn]
    return {**weights, **first["rest"]}


def strip_wrapper_prefixes(weights: Mapping[str, Any]) -> dict[str, Any]:
    """The keys a plain module has: wrapper segments dropped (see the module doc).

    Example::

        >>> sorted(strip_wrapper_prefixes({"module.fc._orig_mod.weight": 1, "module.b": 2}))
        ['b', 'fc.weight']
    """
    out: dict[str, Any] = {}
    for key, value in weights.items():
        plain = ".".join(p for p in key.split(".") if p not in _WRAPPER_SEGMENTS)
        out[plain] = value
    # A leading "module." is DDP's (and DataParallel's) only when every key has it.
    if out and all(k.startswith("module.") for k in out):
        out = {k.removeprefix("module."): v for k, v in out.items()}
    if len(out) != len(weights):
        raise ValueError("keys collide once wrapper prefixes are dropped: " + ", ".join(weights))
    return out


def write_safetensors(weights: Mapping[str, Any], out: Path, metadata: dict[str, str]) -> int:
    """Write ``weights`` to ``out`` atomically as safetensors; the file's size in bytes.

    Tied weights (two keys, one storage) are written as two tensors, which safetensors
    requires and ``load_state_dict`` accepts.

    Raises:
        ValueError: an entry is not a tensor (a module's extra state); nothing is written.
        ImportError: safetensors is not installed (``pip install "tandem[export]"``).
    """
    st = require("safetensors.torch", extra="export")
    others = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)]
    if others:
        raise ValueError(
            f"the model's state holds entries that are not tensors: {others} (a module's extra "
            "state?); a safetensors file holds tensors only"
        )
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in weights.items()}
    data = st.save(tensors, metadata={"format": "pt", **metadata})
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, data)
    return len(data)
