"""The Trainer's per-batch step: a batch in, a loss and metrics out, then the optimizer step.

One micro-batch, as its steps (:class:`BatchStep`, used for training and evaluation alike)::

    move        every tensor of the batch to the device, whatever its structure (one pytree
                walker, tandem._tree.to_device); under bf16-true floating tensors in bfloat16
    forward     the step function under the precision's autocast: the user's
                ``training_step(model, batch)`` / ``eval_step(model, batch)``, or the default
                ``loss_fn(model(inputs), targets)`` for an ``(inputs, targets)`` batch
    unpack      the returned loss tensor, or dict holding "loss" (other entries are metrics,
                "count" the batch's weight, "tokens" the tokens it trained on, for the step
                log's tokens/s): checked, so a wrong return is named at once
    count       how many samples the batch weighs in averages and samples/s (see count_samples)

Then, per optimizer step (:class:`Update`)::

    backward    (loss x weight) scaled by the GradScaler under fp16, plain otherwise
    unscale     under fp16 and clipping: the gradients back to their true size, so the clip
                threshold means the same as without scaling
    clip        engine.clip_grad_norm_: the norm over all ranks and shards (kept as last_grad_norm)
    step        the scaler's step (skipped on inf/nan, counted) or the optimizer's; zero_grad

Example::

    step = BatchStep(None, F.cross_entropy, precision, device, role="training_step")
    update = Update(engine, scaler_state, clip_grad_norm=1.0)
    out = step(engine.model, batch)
    update.backward(out, weight=1.0)
    update.step()
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Literal

import torch
from torch import nn

from tandem._tree import tensors
from tandem.parallel.engine import Engine
from tandem.train.precision import Precision, ScalerState

StepFn = Callable[[nn.Module, Any], Any]
Role = Literal["training_step", "eval_step"]


@dataclass
class StepOutput:
    """What one batch's step gave: its loss, how many samples it weighs, its extra metrics.

    ``scores`` is the default step's ``(outputs, targets)``, from which evaluation counts the
    accuracy exactly (a user's step returns an accuracy as a metric instead). ``tokens`` is the
    ``"tokens"`` a step returned (the step log's tokens/s), else None.
    """

    loss: torch.Tensor
    count: int
    metrics: dict[str, float | torch.Tensor] = field(default_factory=dict)
    scores: tuple[Any, Any] | None = None
    tokens: int | None = None


def count_samples(batch: Any) -> int:
    """How many samples ``batch`` holds: the leading dimension of its first tensor.

    The first tensor in walk order (tuples and lists in order, dicts by insertion, dataclass
    fields in order); a 0-d tensor counts 1. A step whose batch has no tensor, or whose loss
    is a mean over something else (tokens), returns ``"count"`` instead.

    Raises:
        ValueError: the batch holds no tensor.

    Example::

        >>> count_samples({"ids": torch.zeros(8, 128), "label": torch.zeros(8)})
        8
    """
    found = tensors(batch)
    if not found:
        raise ValueError(
            f"cannot count the samples of a batch of type {type(batch).__name__} with no "
            "tensor in it: return {'loss': loss, 'count': number_of_samples} from the step"
        )
    first = found[0]
    return int(first.shape[0]) if first.dim() else 1


def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch the default step can take: a tuple or list of two.

    Raises:
        ValueError: any other batch, naming its type and the way out (``training_step``).
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, (tuple, list)):
        what = f"a {type(batch).__name__} of {len(batch)} items"
    elif isinstance(batch, dict):
        what = f"a {type(batch).__name__} with keys {list(batch)}"
    else:
        what = f"a {type(batch).__name__}"
    raise ValueError(
        f"the default step takes (inputs, targets) batches and computes "
        f"loss_fn(model(inputs), targets); this batch is {what}. Pass "
        "training_step=lambda model, batch: ... (and eval_step) returning the loss, or a dict "
        "with 'loss'"
    )


def unpack(returned: Any, batch: Any, role: Role) -> StepOutput:
    """Check a step function's return value and take it apart (see the module doc).

    Raises:
        ValueError: neither a scalar tensor nor a dict with a scalar tensor ``"loss"``; a
            metric that is not one number; a ``"count"`` or ``"tokens"`` that is not a
            whole number >= 0.
    """
    if isinstance(returned, torch.Tensor):
        loss, extra = returned, {}
    elif isinstance(returned, dict) and "loss" in returned:
        loss, extra = returned["loss"], dict(returned)
        del extra["loss"]
    else:
        shown = repr(returned)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        keys = f" (keys {list(returned)})" if isinstance(returned, dict) else ""
        raise ValueError(
            f"{role} returned a {type(returned).__name__}{keys}: {shown}; it must return the "
            "loss, a scalar tensor, or a dict holding it under 'loss' (other entries are "
            "metrics)"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
        raise ValueError(f"{role}'s loss must be a one-element tensor, got {what}")
    count = extra.pop("count", None)
    n = count_samples(batch) if count is None else _whole(count, "count", role)
    tokens = extra.pop("tokens", None)
    if tokens is not None:
        tokens = _whole(tokens, "tokens", role)
    for name, value in extra.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            continue
        if isinstance(value, Real) and not isinstance(value, bool):
            continue
        what = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        raise ValueError(
            f"{role} returned metric {name!r} = {what}: a metric is one number, the batch's "
            "mean (it is averaged over batches weighted by their counts)"
        )
    return StepOutput(loss, n, extra, tokens=tokens)


def _whole(value: Any, name: str, role: Role) -> int:
    """A step's ``"count"`` or ``"tokens"``: a whole number >= 0 (a one-element tensor too)."""
    raw = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    number = isinstance(raw, Real) and not isinstance(raw, bool)
    if not number or not math.isfinite(float(raw)) or float(raw) % 1 or float(raw) < 0:
        raise ValueError(f"{role} returned {name}={value!r}: it must be a whole number >= 0")
    return int(float(raw))


class BatchStep:
    """One batch through a step function: moved, run under the precision, checked, counted.

    Args:
        fn: the user's ``step(model, batch) -> loss | dict``; None for the default step.
        loss_fn: the default step's ``loss_fn(outputs, targets)``.
        precision: autocast and batch conversion.
        device: where batches go.
        role: ``"training_step"`` or ``"eval_step"``, for messages.

    Example::

        step = BatchStep(None, F.cross_entropy, Precision("32-true", "cpu"),
                         torch.device("cpu"), role="eval_step")
        out = step(model, (x, y))          # StepOutput(loss, count=len(x), ...)
    """

    def __init__(
        self,
        fn: StepFn | None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        precision: Precision,
        device: torch.device,
        *,
        role: Role,
    ) -> None:
        assert fn is not None or loss_fn is not None, "the Trainer checks one is given"
        self.fn = fn
        self.loss_fn = loss_fn
        self.precision = precision
        self.device = device
        self.role: Role = role

    def __call__(self, model: nn.Module, batch: Any) -> StepOutput:
        batch = self.precision.move(batch, self.device)
        with self.precision.autocast():
            if self.fn is not None:
                return unpack(self.fn(model, batch), batch, self.role)
            inputs, targets = split_batch(batch)
            outputs = model(inputs)
            out = unpack(self.loss_fn(outputs, targets), batch, self.role)  # type: ignore[misc]
        out.scores = (outputs, targets)
        return out


def make_steps(
    training_step: StepFn | None,
    eval_step: StepFn | None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    precision: Precision,
    device: torch.device,
) -> tuple[BatchStep, BatchStep]:
    """The run's training and evaluation steps. Evaluation takes ``eval_step``, else the
    default step when there is a ``loss_fn``, else ``training_step``.

    Example::

        train, evaluate = make_steps(None, None, F.cross_entropy, precision, device)
    """
    if eval_step is None and loss_fn is None:
        eval_step = training_step  # the default step needs loss_fn
    return (
        BatchStep(training_step, loss_fn, precision, device, role="training_step"),
        BatchStep(eval_step, loss_fn, precision, device, role="eval_step"),
    )


def check_clip(value: Any) -> float | None:
    """``clip_grad_norm`` checked: None, or a finite number > 0.

    Raises:
        ValueError: anything else, with the value.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(
            f"clip_grad_norm must be a finite number > 0 (the largest global gradient norm) or "
            f"None, got {value!r}"
        )
    if value <= 0:
        raise ValueError(
            f"clip_grad_norm must be > 0, got {value!r}: pass None to train without clipping"
        )
    return float(value)


class Update:
    """Backward and the optimizer step of one engine, with its scaler and clipping.

    Args:
        engine: the model's engine (its optimizer steps; its ``clip_grad_norm_`` is global).
        scaler: the fp16 run's scaler and skip count, or None.
        clip_grad_norm: the largest global gradient norm, or None.

    Example::

        update = Update(engine, None, clip_grad_norm=1.0)
        update.backward(step(engine.model, batch), weight=1.0)
        update.step()
        print(update.last_grad_norm)
    """

    def __init__(
        self, engine: Engine, scaler: ScalerState | None, clip_grad_norm: float | None
    ) -> None:
        self.engine = engine
        self.scaler = scaler
        self.clip_grad_norm = clip_grad_norm
        #: The global gradient norm before the last step's clipping (None without clipping):
        #: inf or nan when an fp16 step overflowed.
        self.last_grad_norm: float | None = None
        self.last_skipped = False
        #: This rank's last step: "loss" and the step's metrics, count-weighted means.
        self.last_metrics: dict[str, float] = {}
        self._sums: dict[str, float] = {}  # the step so far: value x count, by name
        self._count = 0

    def backward(self, out: StepOutput, weight: float) -> float:
        """Backward of ``out.loss * weight`` (scaled under fp16); the loss as a float."""
        loss = out.loss * weight
        (self.scaler.scaler.scale(loss) if self.scaler is not None else loss).backward()
        value = out.loss.item()
        for name, v in (("loss", value), *out.metrics.items()):
            self._sums[name] = self._sums.get(name, 0.0) + float(v) * out.count
        self._count += out.count
        return value

    def step(self) -> None:
        """Unscale, clip, step, zero the gradients (see the module doc)."""
        n = self._count
        self.last_metrics = {k: v / n if n else math.nan for k, v in self._sums.items()}
        self._sums, self._count = {}, 0
        optimizer = self.engine.optimizer
        if self.clip_grad_norm is not None:
            if self.scaler is not None:
                # The scaler remembers this optimizer is unscaled: its step will not do it again.
                self.scaler.scaler.unscale_(optimizer)
            norm = self.engine.clip_grad_norm_(self.clip_grad_norm)
            self.last_grad_norm = float(norm)
        if self.scaler is not None:
            self.last_skipped = self.scaler.step(optimizer)
        else:
            optimizer.step()
        optimizer.zero_grad()
