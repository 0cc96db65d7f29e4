"""FSDP's mixed precision: the policy, its checks, and the casts at unit boundaries.

The policy has the fields of torch FSDP2's ``MixedPrecisionPolicy`` with its meaning, applied
as if every unit and the root were ``fully_shard``-ed with it (``output_dtype`` on the root's
only: see below):

- ``param_dtype``: the dtype of the gathered (unsharded) parameters, hence of forward and
  backward and of the parameter all-gather: each rank casts its float32 shard before sending,
  so the all-gather moves half the bytes in bfloat16. The shards, which the optimizer steps,
  stay float32 (master weights). None: the parameters' own dtype.
- ``reduce_dtype``: the dtype gradients are reduce-scattered in; the reduced slice is cast to
  the shard's dtype and lands in (or is added to) the float32 ``.grad``. None: ``param_dtype``
  (the dtype the gradients come in), as in torch.
- ``output_dtype``: floating outputs of the wrapper (the model's) are cast to it. Not those of
  the inner units: the code around them (a residual add, a head outside any unit) would then
  compute in it, or meet ``param_dtype`` weights with it (torch raises, for the same policy on
  every ``fully_shard``); the policy is one for the model, and what it is for is the loss.
- ``cast_forward_inputs``: floating inputs of the wrapper and of every unit are cast to
  ``param_dtype`` (so a unit never sees a float32 activation against bfloat16 weights).

Example::

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = tandem.FullyShardedDataParallel(net, mixed_precision=policy)
    # torch's own class is accepted as well:
    # mixed_precision=torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem._tree import map_tensors

# Dtypes a unit can compute and communicate in (Gloo and NCCL reduce all four).
FLOATING = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """What FSDP gathers, computes, reduces and returns in; torch FSDP2's fields and defaults.

    Args:
        param_dtype: gathered parameters, forward and backward (None: the parameters' dtype).
        reduce_dtype: gradient reduce-scatter (None: ``param_dtype``, as torch does).
        output_dtype: floating outputs of the model (None: left as computed).
        cast_forward_inputs: cast floating inputs of the model and of every unit to
            ``param_dtype``.

    Example::

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = tandem.FullyShardedDataParallel(net, auto_wrap={Block}, mixed_precision=policy)
        opt = torch.optim.AdamW(model.parameters())   # float32 shards: the master weights
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and value not in FLOATING:
                raise ValueError(
                    f"mixed_precision {name}={value!r}: give a floating dtype "
                    f"({', '.join(map(str, FLOATING))}) or None"
                )
        if not isinstance(self.cast_forward_inputs, bool):
            raise ValueError(
                f"mixed_precision cast_forward_inputs={self.cast_forward_inputs!r}: give True "
                "or False"
            )

    @property
    def gradient_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in (None: the dtype they come in)."""
        return self.reduce_dtype or self.param_dtype

    def cast_inputs(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """``args`` and ``kwargs`` with floating tensors in ``param_dtype`` (if the policy says)."""
        dtype = self.param_dtype
        if dtype is None or not self.cast_forward_inputs:
            return args, kwargs
        return map_tensors(lambda t: _cast(t, dtype), (args, kwargs))

    def cast_output(self, out: Any) -> Any:
        """``out`` with floating tensors in ``output_dtype`` (unchanged when it is None)."""
        dtype = self.output_dtype
        return out if dtype is None else map_tensors(lambda t: _cast(t, dtype), out)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Integer inputs (token ids) and tensors already in the dtype pass untouched (torch's rule).
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


def resolve_policy(value: Any) -> MixedPrecisionPolicy | None:
    """``mixed_precision=`` as tandem's policy: tandem's, torch's ``MixedPrecisionPolicy``, any
    dataclass or mapping with its fields, or None; a ValueError names an unknown field or value.

    Example::

        resolve_policy({"param_dtype": torch.bfloat16})   # MixedPrecisionPolicy(bfloat16, ...)
    """
    if value is None or isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, Mapping):
        fields = dict(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        # torch's MixedPrecisionPolicy is a dataclass with our fields; FSDP1's MixedPrecision
        # is one too, with others (buffer_dtype, ...), which the check below names.
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    else:
        raise ValueError(
            f"mixed_precision={value!r}: give a tandem.MixedPrecisionPolicy, torch's "
            "torch.distributed.fsdp.MixedPrecisionPolicy, a dict of their fields, or None"
        )
    known = {f.name for f in dataclasses.fields(MixedPrecisionPolicy)}
    unknown = sorted(k for k in fields if k not in known)
    if unknown:
        shown = ", ".join(f"{k}={fields[k]!r}" for k in unknown)
        raise ValueError(
            f"mixed_precision has unknown field(s) {shown}: the fields are "
            f"{', '.join(sorted(known))} (torch FSDP2's MixedPrecisionPolicy; FSDP1's "
            "MixedPrecision is not accepted)"
        )
    return MixedPrecisionPolicy(**fields)


def check_parameters(
    policy: MixedPrecisionPolicy,
    trainable: Sequence[tuple[str, torch.Tensor]],
    frozen: Sequence[str],
) -> None:
    """Raise unless the model fits ``policy``: float32 trainable parameters (the master weights
    it casts from), and no frozen floating parameter in a dtype other than ``param_dtype``
    (frozen parameters are not sharded, so nothing would cast them).

    ``trainable`` is ``(name, parameter)`` of every parameter the units flatten, ``frozen`` the
    names of the frozen floating parameters whose dtype is not ``param_dtype``.
    """
    other = [f"{name} ({p.dtype})" for name, p in trainable if p.dtype != torch.float32]
    if other:
        shown = ", ".join(other[:4]) + (f" and {len(other) - 4} more" if len(other) > 4 else "")
        raise ValueError(
            f"mixed_precision={policy!r} needs float32 parameters (the master weights the "
            f"optimizer steps; the policy casts from them), but the model has {shown}. Keep "
            "the model in float32 (module.float()) and let param_dtype set the compute dtype"
        )
    if frozen and policy.param_dtype is not None:
        shown = ", ".join(frozen[:4]) + (f" and {len(frozen) - 4} more" if len(frozen) > 4 else "")
        raise ValueError(
            f"mixed_precision with param_dtype={policy.param_dtype}: the frozen parameters "
            f"{shown} are not sharded, so nothing casts them, and they would meet "
            f"{policy.param_dtype} activations in their own dtype. Unfreeze them, or give them "
            f"that dtype yourself (they are then saved in it)"
        )
