"""Checks that a saved state fits a live model or optimizer; each reads, none changes anything.

``tandem.checkpoint.load`` runs them on every rank before loading anything, so that a file of
another model (other keys, other shapes, other units of FSDP, other parameter groups) is an
error naming the key and what differs, and never a model loaded half-way: torch's
``load_state_dict`` copies the parameters that fit before it complains about those that do not.

Example::

    check_model("state['model']", model, saved["model"], None)        # ValueError if not
    check_optimizer("state['opt']", opt, None, saved["optimizer"], None)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tandem.parallel.fsdp.state import SHARDED_FORMAT
from tandem.parallel.fsdp.wrapper import FullyShardedDataParallel as FSDP
from tandem.parallel.zero import ShardedOptimizer


def check_model(what: str, target: nn.Module, saved: Any, sharded: Any) -> None:
    """The saved model state (full, or this rank's FSDP shards) fits ``target``."""
    if sharded is not None:
        if not isinstance(target, FSDP):
            raise ValueError(
                f"{what}: the checkpoint holds the shards of a tandem.FullyShardedDataParallel "
                f"model (kind='sharded'), and this is a {type(target).__name__}: load it into "
                "an FSDP model of the same module (at any world size), or save with "
                "kind='full', which loads into any model"
            )
        _check_shards(what, target, sharded)
        return
    if not isinstance(saved, Mapping):
        raise ValueError(
            f"{what}: the checkpoint holds {type(saved).__name__} where a model's state dict "
            "belongs (a sharded model's state saved without its shard files?)"
        )
    _check_keys_and_shapes(what, "model", expected_shapes(target), saved)


def expected_shapes(target: nn.Module) -> dict[str, tuple[int, ...] | None]:
    """The plain module's ``state_dict()`` keys and tensor shapes (None: not a tensor)."""
    if not isinstance(target, FSDP):
        return {k: _shape(v) for k, v in target.state_dict().items()}
    layout = target.layout
    by_fqn = {e.fqn: tuple(e.shape) for unit in layout.units for e in unit.entries}
    rest = layout.module.state_dict()  # buffers and frozen parameters, whole on every rank
    return {
        key: by_fqn[layout.key_fqn[key]] if key in layout.key_fqn else _shape(rest.get(key))
        for key in layout.state_keys
    }


def _check_shards(what: str, target: FSDP, shard: Any) -> None:
    layout = target.layout
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
            f"{_units(cut)}; this model's: {_units(layout.signature())}): wrap the same model "
            "the same way, or save with kind='full'"
        )
    rest = {k: _shape(v) for k, v in layout.module.state_dict().items()}
    _check_keys_and_shapes(what, "model (buffers, frozen parameters)", rest, shard["rest"])


def _units(signature: list[list[tuple[str, tuple[int, ...]]]]) -> str:
    return "; ".join(", ".join(f for f, _ in unit) or "(empty)" for unit in signature)


def _check_keys_and_shapes(
    what: str, label: str, expected: Mapping[str, tuple[int, ...] | None], saved: Mapping
) -> None:
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


def check_optimizer(
    what: str, opt: torch.optim.Optimizer, owner: FSDP | None, saved: Any, sharded: Any
) -> None:
    """The saved optimizer state (full, or this rank's shard) fits ``opt``."""
    if sharded is not None:
        if isinstance(opt, ShardedOptimizer):
            got = (sharded.get("rank"), sharded.get("world_size"), sharded.get("owners"))
            mine = (opt.rank, opt.world_size, list(opt.owners))
            if got != mine:
                raise ValueError(
                    f"{what}: the optimizer shard of rank {got[0]} of {got[1]} (owners "
                    f"{got[2]}) cannot load into rank {mine[0]} of {mine[1]} (owners {mine[2]})"
                )
            return
        if owner is None:
            raise ValueError(
                f"{what}: the checkpoint holds one rank's shard of a sharded optimizer's state "
                f"(kind='sharded'), and this {type(opt).__name__} is not sharded: save with "
                "kind='full', which loads into any optimizer over the same parameters"
            )
        _check_groups(what, [len(g["params"]) for g in opt.param_groups], sharded)
        return
    want = [len(g["params"]) for g in opt.param_groups]
    if owner is not None:
        # The full state names the plain module's parameters: a shard stands for its unit's.
        per_shard = {id(u.shard): len(u.entries) for u in owner.units}
        want = [sum(per_shard.get(id(p), 1) for p in g["params"]) for g in opt.param_groups]
    _check_groups(what, want, saved)


def _check_groups(what: str, want: list[int], saved: Any) -> None:
    if not isinstance(saved, Mapping) or not {"state", "param_groups"} <= set(saved):
        raise ValueError(f"{what}: the checkpoint holds no optimizer state dict there")
    got = [len(g["params"]) for g in saved["param_groups"]]
    if got != want:
        raise ValueError(
            f"{what}: the checkpoint's optimizer has param groups of {got} parameters, this "
            f"one {want}: build it over the same parameters, in the same groups"
        )


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def listed(groups: list[tuple[list[str], str]], prefix: str = "") -> str:
    """``"keys ['a'] that the checkpoint lacks and keys ['b'] that ..."``: the non-empty groups
    of names, each with what it says, for a message.

    Example::

        >>> listed([(["a"], "that the state lacks"), ([], "that the checkpoint lacks")])
        "['a'] that the state lacks"
    """
    return " and ".join(f"{prefix}{names} {where}" for names, where in groups if names)
