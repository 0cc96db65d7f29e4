"""The Trainer's arguments checked, and its optimizer and scheduler built from factories.

Every check here is deterministic (the same arguments give the same verdict on every rank), so
a bad argument is the same ValueError on every rank, before the first step, never a hang.

An optimizer may be given built (``AdamW(model.parameters())``) or as a factory over the
parameters (``lambda params: AdamW(params, lr=3e-4)``), and a scheduler built or as a factory
over the optimizer (``lambda opt: OneCycleLR(opt, ...)``): the Trainer calls the factories
once the model is on its device and in its precision, over the parameters the optimizer must
hold. Those are the given model's ``parameters()``: for a
:class:`tandem.FullyShardedDataParallel` model its flat shards, otherwise the module's own
(tandem.DDP wraps without replacing them). Told apart by what they are: an object with
``step`` and ``param_groups`` is an optimizer, one with ``step`` a scheduler; another callable
is a factory.

Example::

    optimizer = build_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-3), model)
    scheduler = build_scheduler(lambda o: torch.optim.lr_scheduler.StepLR(o, 10), optimizer)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

OptimizerArg = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerArg = Any  # a scheduler (anything with step()), a factory of one, or None


def check_counts(**values: tuple[Any, int]) -> None:
    """Each ``name=(value, least)``: ``value`` must be an int (not a bool) ``>= least``.

    Example::

        check_counts(batch_size=(32, 1), num_workers=(0, 0))
    """
    for name, (value, least) in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def check_choices(**values: tuple[Any, tuple[Any, ...]]) -> None:
    """Each ``name=(value, choices)``: ``value`` must be one of ``choices``."""
    for name, (value, choices) in values.items():
        if value not in choices:
            listed = " or ".join(repr(c) for c in choices)
            raise ValueError(f"{name} must be {listed}, not {value!r}")


def check_callables(
    optimizer: Any, scheduler: Any, loss_fn: Any, training_step: Any, eval_step: Any
) -> None:
    """The optimizer and scheduler are objects or factories, the step functions callables, and
    the training step has a way to find the loss."""
    check_optimizer_arg(optimizer)
    check_scheduler_arg(scheduler)
    for name, fn in (("loss_fn", loss_fn), ("training_step", training_step),
                     ("eval_step", eval_step)):  # fmt: skip
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be callable, got {type(fn).__name__}: {fn!r}")
    if loss_fn is None and training_step is None:
        raise ValueError(
            "neither loss_fn nor training_step was given: pass loss_fn=F.cross_entropy (or "
            "another) for (inputs, targets) batches, or training_step=lambda model, batch: ... "
            "returning the loss"
        )


def _is_optimizer(obj: Any) -> bool:
    return not isinstance(obj, type) and hasattr(obj, "step") and hasattr(obj, "param_groups")


def _is_scheduler(obj: Any) -> bool:
    return not isinstance(obj, type) and hasattr(obj, "step")


def check_optimizer_arg(optimizer: Any) -> None:
    """An optimizer or a callable (a factory); ValueError otherwise."""
    if not _is_optimizer(optimizer) and not callable(optimizer):
        raise ValueError(
            f"optimizer must be an optimizer or a factory params -> optimizer, got "
            f"{type(optimizer).__name__}: {optimizer!r}"
        )


def check_scheduler_arg(scheduler: Any) -> None:
    """None, a scheduler, or a callable (a factory); ValueError otherwise."""
    if scheduler is not None and not _is_scheduler(scheduler) and not callable(scheduler):
        raise ValueError(
            f"scheduler must be an LR scheduler, a factory optimizer -> scheduler, or None; "
            f"got {type(scheduler).__name__}: {scheduler!r}"
        )


def build_optimizer(optimizer: OptimizerArg, model: nn.Module) -> torch.optim.Optimizer:
    """``optimizer`` itself, or the factory's optimizer over ``model.parameters()``.

    A factory's optimizer must hold only ``model``'s parameters (a subset is fine: frozen ones
    may be left out). An optimizer given built is taken as it is.

    Raises:
        ValueError: the factory returned no optimizer, or one holding other parameters (the
            message counts them).
    """
    if _is_optimizer(optimizer):
        return optimizer  # type: ignore[return-value]
    params = list(model.parameters())
    built = optimizer(params)  # type: ignore[operator]
    if not _is_optimizer(built):
        raise ValueError(
            f"the optimizer factory returned {type(built).__name__} ({built!r}), not an "
            "optimizer: it must return e.g. torch.optim.AdamW(params, ...) over the params it "
            "is given"
        )
    held = [p for group in built.param_groups for p in _params(group["params"])]
    mine = {id(p) for p in params}
    foreign = sum(id(p) not in mine for p in held)
    if foreign:
        raise ValueError(
            f"the optimizer factory built an optimizer over {foreign} parameter(s) that are "
            f"not the model's (it holds {len(held)}; the model, as the Trainer runs it, has "
            f"{len(params)}): build it over the params the factory is given, e.g. "
            "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), not over another "
            "module's parameters (with FullyShardedDataParallel the unwrapped module's are "
            "gone: the wrapper's are its shards)"
        )
    return built


def build_scheduler(scheduler: SchedulerArg, optimizer: torch.optim.Optimizer) -> Any:
    """``scheduler`` itself (or None), or the factory's scheduler over ``optimizer``.

    Raises:
        ValueError: the factory returned something without a ``step()``.
    """
    if scheduler is None or _is_scheduler(scheduler):
        return scheduler
    built = scheduler(optimizer)
    if not _is_scheduler(built):
        raise ValueError(
            f"the scheduler factory returned {type(built).__name__} ({built!r}), not a "
            "scheduler: it must return e.g. torch.optim.lr_scheduler.LambdaLR(opt, ...) over "
            "the optimizer it is given"
        )
    return built


def _params(params: Any) -> Iterable[torch.Tensor]:
    return [params] if isinstance(params, torch.Tensor) else params
