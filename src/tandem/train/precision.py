"""The Trainer's numeric precision, by Lightning's names, and the GradScaler that fp16 needs.

==============  ===========================================  ===================================
name            what runs in low precision                   what stays float32
==============  ===========================================  ===================================
``32-true``     nothing                                      everything
``bf16-mixed``  forward and loss, under ``torch.autocast``   parameters, gradients, optimizer
``fp16-mixed``  the same, in float16, the loss scaled by a   the same; a step whose gradients
                ``torch.amp.GradScaler``                     overflowed is skipped and counted
``bf16-true``   everything: floating parameters, buffers     nothing
                and the batch's floating tensors
==============  ===========================================  ===================================

float16 has 5 exponent bits: small gradients underflow to zero unless the loss is scaled up
before backward. The scaler does that, unscales before the optimizer step, and skips the step
(lowering the scale) when the gradients hold inf or nan. bfloat16 has float32's exponent
range, so it needs no scaler.

Autocast's device type is the run's device (``tandem.world().device``).

With a :class:`tandem.FullyShardedDataParallel` model the mixed precisions also set the
wrapper's mixed precision, as Lightning's ``FSDPPrecision`` sets FSDP's: parameters gathered,
and gradients reduce-scattered, in the low dtype (:attr:`Precision.fsdp_policy`):

==============  ===============  ================  =====================================
name            ``param_dtype``  ``reduce_dtype``  scaler
==============  ===============  ================  =====================================
``bf16-mixed``  bfloat16         bfloat16          none
``fp16-mixed``  float16          float16           torch's ``ShardedGradScaler``
==============  ===============  ================  =====================================

The shards, which the optimizer steps, stay float32 (the master weights, and so the optimizer
state); forward and loss still run under autocast. Lightning's ``buffer_dtype`` has no
counterpart: the policy is torch FSDP2's, which has none, and buffers keep their dtype. A
wrapper built with a ``mixed_precision`` policy of its own keeps it (as Lightning lets the
strategy's ``mixed_precision`` win); ``mixed_precision=tandem.MixedPrecisionPolicy()`` (no
dtypes) asks for autocast alone. Under fp16 a plain ``GradScaler`` would see only this rank's
gradient shards, so ranks could disagree on skipping a step: the scaler made for an FSDP model
is ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``, which sums the inf/nan
flags of all ranks before deciding, and a scaler passed in must be one
(:func:`tandem.parallel.adapters.check_scaler`, the one rule).

Example::

    precision, scaler = resolve_precision("bf16-mixed", None, model, torch.device("cpu"))
    precision.convert_module(model)     # an FSDP model: gathers and reduces in bfloat16
    with precision.autocast():
        loss = loss_fn(model(x), y)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem._tree import to_device
from tandem.parallel.adapters import check_scaler, model_state
from tandem.parallel.fsdp.precision import MixedPrecisionPolicy

PRECISIONS = ("32-true", "bf16-mixed", "fp16-mixed", "bf16-true")

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


@dataclass(frozen=True)
class Precision:
    """One of :data:`PRECISIONS` on one device type: autocast, batch and module conversion.

    Example::

        precision = Precision("bf16-true", "cpu")
        precision.convert_module(model)            # floating parameters and buffers: bf16
        batch = precision.move(batch, device)      # floating tensors too

        Precision("bf16-mixed", "cpu").fsdp_policy  # param_dtype=reduce_dtype=bfloat16
    """

    name: str
    device_type: str

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype of autocast regions (mixed precisions), else None."""
        return _AUTOCAST.get(self.name)

    @property
    def fsdp_policy(self) -> MixedPrecisionPolicy | None:
        """The mixed precision an FSDP model gets (mixed precisions), else None.

        Lightning's ``FSDPPrecision.mixed_precision_config``: parameters gathered and gradients
        reduced in the autocast dtype (``param_dtype = reduce_dtype``), float32 shards.
        """
        dtype = self.autocast_dtype
        if dtype is None:
            return None
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)

    @property
    def float_dtype(self) -> torch.dtype | None:
        """The dtype every floating tensor is held in (``bf16-true``), else None."""
        return torch.bfloat16 if self.name == "bf16-true" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context forward and loss run in: ``torch.autocast`` when mixed, else nothing."""
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=dtype)

    def move(self, batch: Any, device: torch.device) -> Any:
        """``batch`` on ``device``; under ``bf16-true`` its floating tensors in bfloat16 (a
        bfloat16 module cannot multiply float32 inputs)."""
        return to_device(batch, device, self.float_dtype)

    def convert_module(self, model: nn.Module) -> None:
        """Under ``bf16-true`` cast the floating parameters and buffers to bfloat16, in place;
        under the mixed precisions give an FSDP model built without a policy
        :attr:`fsdp_policy` (a collective then: every rank calls it).

        The parameters stay the same objects (``nn.Module.to`` swaps their data), so an
        optimizer built over them before still holds them. A model already wrapped in tandem.DDP
        or FSDP must hold bfloat16 parameters already: the wrappers laid out their buffers for
        the dtype they were given. An FSDP model keeps its shards, and the optimizer over them,
        in float32 under the mixed precisions too.

        Raises:
            ValueError: a wrapped model with floating parameters of another dtype (bf16-true);
                an FSDP model the policy does not fit (mixed: parameters not float32, frozen
                parameters of another dtype), on every rank.

        Example::

            model = tandem.FullyShardedDataParallel(net, auto_wrap={Block})
            Precision("bf16-mixed", "cuda").convert_module(model)
            model.mixed_precision      # MixedPrecisionPolicy(param_dtype=bfloat16, ...)
        """
        policy = self.fsdp_policy
        wrapper = model_state(model)
        if policy is not None and wrapper.sharded and wrapper.mixed_precision is None:
            try:
                wrapper.set_mixed_precision(policy)
            except ValueError as error:
                raise ValueError(
                    f"precision={self.name!r} with a FullyShardedDataParallel model gathers its "
                    f"parameters and reduces its gradients in {policy.param_dtype} (as "
                    f"Lightning's FSDP precision does), but: {error}. To run forward and loss "
                    "under autocast alone, build the wrapper with "
                    "mixed_precision=tandem.MixedPrecisionPolicy() (no dtypes)"
                ) from error
        dtype = self.float_dtype
        if dtype is None:
            return
        if wrapper.layout_fixed:
            others = sorted(
                {str(p.dtype) for p in model.parameters() if p.is_floating_point()} - {str(dtype)}
            )
            if others:
                raise ValueError(
                    f"precision='bf16-true' with a model already wrapped in "
                    f"{type(model).__name__} whose parameters are {', '.join(others)}: convert "
                    "the module before wrapping it (module.to(torch.bfloat16)), or pass the "
                    "plain module"
                )
            return
        model.to(dtype)


def resolve_precision(
    precision: str | None,
    scaler: torch.amp.GradScaler | None,
    model: nn.Module,
    device: torch.device,
) -> tuple[Precision, torch.amp.GradScaler | None]:
    """The run's precision and GradScaler from the Trainer's ``precision`` and ``scaler``.

    The rule: ``precision=None`` is ``"32-true"``, or ``"fp16-mixed"`` when a ``scaler`` is
    given (the user's scaler is then the run's); ``"fp16-mixed"`` without one makes
    ``torch.amp.GradScaler(device.type)``, or for a FullyShardedDataParallel model torch's
    ``ShardedGradScaler(device.type, process_group=model.process_group)``, which agrees across
    ranks on skipping a step; a scaler with any other precision is an error, as a scaler has
    nothing to do outside float16. Deterministic: every rank decides alike.

    Raises:
        ValueError: an unknown name (the valid ones listed), a scaler with another precision,
            or a plain GradScaler with a FullyShardedDataParallel model
            (:func:`tandem.parallel.adapters.check_scaler`).

    Example::

        precision, scaler = resolve_precision("fp16-mixed", None, model, torch.device("cuda"))
        # an FSDP model: scaler is a ShardedGradScaler
    """
    name = precision if precision is not None else "fp16-mixed" if scaler is not None else "32-true"
    if name not in PRECISIONS:
        raise ValueError(
            f"precision={name!r} is not one of {', '.join(repr(p) for p in PRECISIONS)}"
        )
    if scaler is not None and name != "fp16-mixed":
        raise ValueError(
            f"scaler= was given with precision={name!r}: a GradScaler belongs to "
            "precision='fp16-mixed' (pass that, or leave precision unset, to train with your "
            "scaler; or drop the scaler)"
        )
    if name == "fp16-mixed" and scaler is None:
        scaler = model_state(model).grad_scaler(device.type)
    check_scaler(model, scaler)
    return Precision(name, device.type), scaler


class ScalerState:
    """The run's GradScaler and the optimizer steps it skipped, saved together.

    The checkpoint's ``scaler`` entry is the GradScaler's ``state_dict()`` plus
    ``"skipped_steps"`` (a checkpoint without that key, from an older tandem, counts from 0).

    Example::

        state = ScalerState(torch.amp.GradScaler("cuda"))
        state.scaler.scale(loss).backward()
        skipped = state.step(optimizer)
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self.skipped_steps = 0

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``scaler.step(optimizer)`` and ``scaler.update()``; whether the step was skipped.

        A skipped step is one after which the scaler lowered its scale: it does so exactly when
        it found inf or nan in the gradients and did not step (with a ``backoff_factor`` below
        1, torch's default 0.5; HF Accelerate detects skips the same way). ``get_scale()``
        synchronises with the device once a step.
        """
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        skipped = self.scaler.get_scale() < before
        self.skipped_steps += skipped
        return skipped

    def state_dict(self) -> dict[str, Any]:
        return {**self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.skipped_steps = int(state.pop("skipped_steps", 0))
        self.scaler.load_state_dict(state)

    def __repr__(self) -> str:
        return f"GradScaler(scale={self.scaler.get_scale()}, skipped_steps={self.skipped_steps})"
