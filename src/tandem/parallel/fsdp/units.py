"""FSDP's units: which submodules become units, which parameters each holds, and the check that
every rank cut the model alike.

The layout decides the collectives: each unit broadcasts, all-gathers and reduce-scatters its
own flat buffer, in unit order. Ranks with different layouts (another ``auto_wrap`` on one
rank) would issue collectives of different sizes and hang, so :func:`agree_on_units` compares
the layouts once, before the first of them, and raises on every rank instead.

Example::

    units = plan_units(model, auto_wrap={nn.Linear})   # [(name, module, params), ...]
    agree_on_units(units, group)                       # ValueError on every rank if they differ
    units, policy = plan_agreed(model, {nn.Linear}, None, group, "tandem.FSDP")   # both at once
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem._dist import agree
from tandem.parallel.fsdp.precision import MixedPrecisionPolicy, check_parameters, resolve_policy

AutoWrap = Callable[[nn.Module], bool] | Iterable[type[nn.Module]]

# One trainable parameter: its name, every (module, attribute) it is registered as, itself.
Located = tuple[str, list[tuple[nn.Module, str]], nn.Parameter]

# The units in construction order: (module name, module, its trainable parameters).
Planned = list[tuple[str, nn.Module, list[Located]]]

# One unit, as compared across ranks: its module's name and its parameters' (name, numel).
Layout = list[tuple[str, list[tuple[str, int]]]]


def predicate(auto_wrap: AutoWrap | None) -> Callable[[nn.Module], bool]:
    """``auto_wrap`` (module classes, a predicate or None) as a predicate ``module -> bool``."""
    if auto_wrap is None:
        return lambda m: False
    if callable(auto_wrap) and not isinstance(auto_wrap, type):
        return auto_wrap
    classes = (auto_wrap,) if isinstance(auto_wrap, type) else tuple(auto_wrap)
    for c in classes:
        if not (isinstance(c, type) and issubclass(c, nn.Module)):
            raise ValueError(
                f"auto_wrap={auto_wrap!r}: give nn.Module classes or a predicate module -> bool"
            )
    return lambda m: isinstance(m, classes)


def plan_units(
    root: nn.Module, auto_wrap: AutoWrap | None
) -> list[tuple[str, nn.Module, list[Located]]]:
    """The units in construction order: each picked submodule, then the root for the rest.

    Each is ``(module name, module, its trainable parameters)``; modules left without trainable
    parameters are no unit. The root's name is ``""``.
    """
    picks = predicate(auto_wrap)
    named = [(name, m) for name, m in root.named_modules() if m is not root and picks(m)]
    owner = assign(root, [m for _, m in named])
    return [(name, m, owner[id(m)]) for name, m in [*named, ("", root)] if owner.get(id(m), [])]


def assign(root: nn.Module, unit_modules: list[nn.Module]) -> dict[int, list[Located]]:
    """Each trainable parameter's unit: the innermost unit module holding it.

    A parameter registered under two units (tied embeddings) goes to the root, whose parameters
    stay gathered for the whole forward and backward. Within a unit, parameters keep their
    registration order; a tied parameter is named by its first registration.
    """
    units = {id(m) for m in unit_modules}
    holders: dict[int, set[int]] = {}
    found: dict[int, Located] = {}

    def walk(module: nn.Module, prefix: str, unit: int) -> None:
        unit = id(module) if id(module) in units else unit
        for name, p in module._parameters.items():
            if p is None or not p.requires_grad:
                continue
            holders.setdefault(id(p), set()).add(unit)
            found.setdefault(id(p), (prefix + name, [], p))[1].append((module, name))
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.", unit)

    walk(root, "", id(root))
    owner: dict[int, list[Located]] = {}
    for pid, located in found.items():
        where = holders[pid]
        owner.setdefault(next(iter(where)) if len(where) == 1 else id(root), []).append(located)
    return owner


def layout(units: list[tuple[str, nn.Module, list[Located]]] | None) -> Layout | None:
    """What the ranks compare: every unit's name with its parameters' names and sizes."""
    if units is None:
        return None
    return [(name, [(fqn, p.numel()) for fqn, _, p in params]) for name, _, params in units]


def agree_on_units(
    units: list[tuple[str, nn.Module, list[Located]]] | None,
    group: dist.ProcessGroup | None,
    wrapper: str = "tandem.FullyShardedDataParallel",
    precision: str = "",
    sharding: str = "",
) -> None:
    """Return if every rank planned the same units with the same ``precision`` (the mixed
    precision policy, described) and ``sharding`` (the stage and mesh, described); else
    ValueError on every rank.

    ``units`` is None on a rank whose ``auto_wrap`` was refused: it joins the comparison anyway
    (and raises its own error afterwards), so its peers raise too instead of waiting for it.
    The policy sets the dtypes of every collective, so it is compared in the same round.
    """
    agree(
        (layout(units), precision, sharding),
        f"{wrapper}: the unit layout",
        group,
        explain=_first_difference,
        fix="Pass the same auto_wrap and mixed_precision on every rank (they decide the "
        "collectives)",
    )


def _first_difference(everyone: list[tuple[Layout | None, str, str]]) -> str:
    for what, at, also in (
        ("mixed precision", 1, ""),
        ("sharding", 2, " (stage, reshard_after_forward and the groups must agree as well)"),
    ):
        values = [e[at] for e in everyone]
        if any(v != values[0] for v in values):
            shown = "; ".join(f"rank {r}: {v or 'none'}" for r, v in enumerate(values))
            return f"the {what} differs: {shown}{also}"
    return first_unit_difference([e[0] for e in everyone])


def plan_agreed(
    module: nn.Module,
    auto_wrap: AutoWrap | None,
    mixed_precision: Any,
    group: dist.ProcessGroup | None,
    wrapper: str,
    sharding: str = "",
) -> tuple[Planned, MixedPrecisionPolicy | None]:
    """The units (:func:`plan_units`) and the mixed precision policy, the same on every rank
    and fitting the model, with the same ``sharding`` (described); else ValueError on every
    rank (a rank whose input is refused still joins the comparison, then raises its own
    error)."""
    refused: ValueError | None = None
    planned, policy = None, None
    try:
        planned = plan_units(module, auto_wrap)
    except ValueError as error:
        refused = error  # its layout is compared as None: the peers name the refusal
    try:
        policy = resolve_policy(mixed_precision)
        precision = repr(policy) if policy is not None else ""
    except ValueError as error:
        refused, precision = refused or error, f"refused ({error})"
    # Each unit broadcasts its own flat buffer, and the policy sets the dtype of every
    # collective: the same model cut into other units, or gathered in another dtype, on one
    # rank would hang the others there, so the ranks compare both first.
    try:
        agree_on_units(planned, group, wrapper, precision, sharding)
    except ValueError:
        if refused is None:
            raise
    if refused is not None:  # its own error on the rank that refused its input
        raise refused
    assert planned is not None  # a rank without a plan raised above
    if policy is not None:  # the same model on every rank (verified): the same error on each
        trainable = [(fqn, p) for _, _, params in planned for fqn, _, p in params]
        check_fits(policy, module, trainable)
    return planned, policy


def check_fits(
    policy: MixedPrecisionPolicy, module: nn.Module, trainable: Sequence[tuple[str, torch.Tensor]]
) -> None:
    """:func:`check_parameters` of ``module``: ``trainable`` are the ``(name, tensor)`` the
    units flatten, the frozen ones found in ``module`` (its remaining parameters)."""
    frozen = [
        name
        for name, p in module.named_parameters()
        if not p.requires_grad and p.is_floating_point() and p.dtype != policy.param_dtype
    ]
    check_parameters(policy, trainable, frozen)


def agree_on_policy(
    value: Any, group: dist.ProcessGroup | None, wrapper: str
) -> MixedPrecisionPolicy | None:
    """``value`` as a policy (:func:`resolve_policy`), the same on every rank; else ValueError
    on every rank (a rank whose value is refused joins the comparison, then raises its own)."""
    refused: ValueError | None = None
    policy = None
    try:
        policy = resolve_policy(value)
        described = repr(policy) if policy is not None else ""
    except ValueError as error:
        refused, described = error, f"refused ({error})"
    try:
        agree(
            described,
            f"{wrapper}: the mixed precision",
            group,
            explain=lambda all_: "; ".join(f"rank {r}: {p or 'none'}" for r, p in enumerate(all_)),
            fix="Pass the same mixed_precision on every rank (it decides the collectives' dtypes)",
        )
    except ValueError:
        if refused is None:
            raise
    if refused is not None:
        raise refused
    return policy


def first_unit_difference(layouts: list[Any]) -> str:
    """Describe the first unit in which some rank's layout differs from rank 0's."""
    refused = [r for r, lay in enumerate(layouts) if lay is None]
    if refused:
        return f"rank(s) {refused} refused their auto_wrap (see their own error)"
    for j in range(max(len(lay) for lay in layouts)):
        entries = [lay[j] if j < len(lay) else None for lay in layouts]
        if all(e == entries[0] for e in entries):
            continue
        described = [f"rank 0 has {_describe(entries[0])}"]
        described += [
            f"rank {r} has {_describe(e)}" for r, e in enumerate(entries) if r and e != entries[0]
        ]
        counts = ", ".join(f"rank {r}: {len(lay)}" for r, lay in enumerate(layouts))
        return f"unit #{j} differs: " + ", ".join(described) + f" (unit counts: {counts})"
    return "no difference found"  # agree calls this only when the layouts differ


def _describe(unit: tuple[str, list[tuple[str, int]]] | None) -> str:
    if unit is None:
        return "no such unit"
    name, params = unit
    shown = ", ".join(f"{fqn}: {numel}" for fqn, numel in params[:4])
    more = f", and {len(params) - 4} more" if len(params) > 4 else ""
    return f"{f'{name!r}' if name else 'the root'} ({shown}{more})"
