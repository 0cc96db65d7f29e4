"""FullyShardedDataParallel's mixed precision in one process equals the same casts by hand.

The oracle is a hand-computed step on the plain model: a ``param_dtype`` copy of the float32
master weights runs forward and backward on inputs cast to ``param_dtype``; its gradients, cast
to ``reduce_dtype`` and then to float32, become the master weights' gradients, which the plain
optimizer steps. Proven, bit for bit, for 4 steps: stages 2 and 3, one unit and a unit per
Linear plus the root's own parameter, gradients reduced in float32 and in bfloat16: SGD
(momentum, weight decay) and AdamW; gradient accumulation over two backward calls (AdamW: the
float32 sums of the two micro-batches' cast gradients), and under ``no_sync()`` (SGD: summed in
the reduce dtype first, then cast). Also:

- the gathered parameters the forward sees are ``param_dtype`` views of one buffer; the shards,
  their ``.grad``, ``full_state_dict()`` and ``gathered()`` are float32, and a float32 value
  that bfloat16 cannot hold, written through ``gathered()``, reaches the shard exactly; the
  next forward sees it rounded to bfloat16;
- ``output_dtype`` casts the model's output, not the units' (the activation between two units
  stays bfloat16); ``cast_forward_inputs=False`` leaves a float32 input to meet bfloat16
  weights (torch's error, not a silent cast); integer inputs are never cast;
- the policy given as tandem's class, torch's ``MixedPrecisionPolicy`` or a dict is the same;
- bad input, each a ValueError naming the value: a non-floating dtype, an unknown field (a
  dict's, or FSDP1's ``MixedPrecision``), something that is no policy, a non-bool
  ``cast_forward_inputs``, float64 parameters, a frozen float32 parameter under a bfloat16
  ``param_dtype``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.parallel.fsdp.wrapper import MixedPrecisionPolicy
from tests.parallel.fsdp.models import FSDP, MLP, Net, seeded

BF16, FP32 = torch.bfloat16, torch.float32
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}
WRAPS = {"one": None, "linear": {nn.Linear}}


def _batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _make() -> nn.Module:
    return seeded(MLP, [6, 7, 5, 3], [True, False, True], seed=4)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


def _by_hand(master: nn.Module, micros: list, reduce: torch.dtype, no_sync: bool) -> torch.Tensor:
    """The micro-batches' backward on a bfloat16 copy of ``master``, gradients into ``master``."""
    compute = copy.deepcopy(master).to(BF16)
    kept: list[torch.Tensor | None] = [None for _ in master.parameters()]
    for i, (x, y) in enumerate(micros):
        loss = _loss(compute, x.to(BF16), y)
        loss.backward()
        last = i == len(micros) - 1
        for j, (p, c) in enumerate(zip(master.parameters(), compute.parameters(), strict=True)):
            g, c.grad = c.grad, None
            if no_sync and not last:  # kept unreduced, summed in the reduce dtype
                kept[j] = g.to(reduce) if kept[j] is None else kept[j].add_(g)
                continue
            if kept[j] is not None:
                g, kept[j] = kept[j].add_(g), None
            g = g.to(reduce).to(FP32)
            p.grad = g if p.grad is None else p.grad.add_(g)
    return loss.detach()


def _ours(model, micros: list, no_sync: bool) -> torch.Tensor:
    for i, (x, y) in enumerate(micros):
        if no_sync and i < len(micros) - 1:
            with model.no_sync():
                loss = _loss(model, x, y)
                loss.backward()
        else:
            loss = _loss(model, x, y)
            loss.backward()
    return loss.detach()


@pytest.mark.parametrize(
    ("optimizer", "accumulate"),
    [("sgd", "none"), ("adamw", "none"), ("adamw", "sync"), ("sgd", "no_sync")],
)
@pytest.mark.parametrize("reduce", [FP32, BF16], ids=["reduce32", "reduce16"])
@pytest.mark.parametrize("wrap", list(WRAPS))
@pytest.mark.parametrize("stage", [2, 3])
def test_training_equals_the_casts_by_hand(stage, wrap, reduce, optimizer, accumulate):
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce)
    model = FSDP(_make(), stage=stage, auto_wrap=WRAPS[wrap], mixed_precision=policy)
    master = _make()
    cls, kwargs = OPTIMIZERS[optimizer]
    opt, ref = cls(model.parameters(), **kwargs), cls(master.parameters(), **kwargs)
    n_micro = 1 if accumulate == "none" else 2
    for step in range(4):
        micros = [_batch(step, m) for m in range(n_micro)]
        opt.zero_grad()
        ref.zero_grad()
        ours = _ours(model, micros, no_sync=accumulate == "no_sync")
        theirs = _by_hand(master, micros, reduce, no_sync=accumulate == "no_sync")
        assert torch.equal(ours, theirs), step
        opt.step()
        ref.step()
    full = model.full_state_dict()
    assert full is not None
    for key, value in master.state_dict().items():
        assert full[key].dtype == FP32 and torch.equal(full[key], value), key


@pytest.mark.parametrize("stage", [2, 3])
def test_forward_computes_in_param_dtype_and_keeps_float32_masters(stage):
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    model = FSDP(_make(), stage=stage, auto_wrap={nn.Linear}, mixed_precision=policy)
    seen = []  # after FSDP's pre-hook: the gathered weight, the cast input

    def look(m: nn.Module, args: tuple) -> None:
        seen.append((m.weight.dtype, args[0].dtype, m.weight[0, 0].item()))

    model.module.body[0].register_forward_pre_hook(look)
    out = model(_batch(0)[0])
    assert out.dtype == BF16 and seen[0][:2] == (BF16, BF16)
    out.float().sum().backward()
    assert {u.shard.dtype for u in model.units} == {u.shard.grad.dtype for u in model.units}
    assert {u.shard.dtype for u in model.units} == {FP32}
    assert {u.full.dtype for u in model.units} == {BF16}
    with model.gathered(writeback=False) as net:
        assert net.body[0].weight.dtype == FP32
    # A float32 value bfloat16 cannot hold reaches the shard exactly through gathered().
    fine = 1.0 + 2.0**-20
    with model.gathered() as net:
        net.body[0].weight[0, 0] = fine
    full = model.full_state_dict()
    assert full is not None and full["body.0.weight"][0, 0].item() == fine
    model(_batch(0)[0])
    assert seen[-1] == (BF16, BF16, 1.0)  # the forward sees it rounded to bfloat16


def test_output_dtype_and_input_casts():
    x = _batch(0)[0]
    out32 = MixedPrecisionPolicy(param_dtype=BF16, output_dtype=FP32)
    model = FSDP(_make(), auto_wrap={nn.Linear}, mixed_precision=out32)
    between = []  # the input of the Tanh after the first unit
    model.module.body[1].register_forward_pre_hook(lambda m, a: between.append(a[0].dtype))
    assert model(x).dtype == FP32 and between == [BF16]
    uncast = MixedPrecisionPolicy(param_dtype=BF16, cast_forward_inputs=False)
    with pytest.raises(RuntimeError, match="dtype"):  # torch's own mismatch error
        FSDP(_make(), mixed_precision=uncast)(x)
    tokens = torch.tensor([1, 2, 3])
    assert MixedPrecisionPolicy(param_dtype=BF16).cast_inputs((tokens,), {}) == ((tokens,), {})


def test_policy_as_torch_class_or_dict_is_the_same():
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    fields = {"param_dtype": BF16, "reduce_dtype": FP32}
    outputs = []
    for given in (MixedPrecisionPolicy(**fields), TorchPolicy(**fields), fields):
        model = FSDP(seeded(Net), auto_wrap={nn.Linear}, mixed_precision=given)
        assert model.mixed_precision == MixedPrecisionPolicy(**fields)
        outputs.append(model(_batch(0)[0]))
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


# -- bad input ------------------------------------------------------------------------------------


def _refusal(module: nn.Module | None = None, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        FSDP(seeded(Net) if module is None else module, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.complex64, "bfloat16"])
def test_non_floating_dtype_is_named(dtype):
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        with pytest.raises(ValueError, match=f"{field}={dtype!r}"):
            MixedPrecisionPolicy(**{field: dtype})
        message = _refusal(mixed_precision={field: dtype})
        assert f"{field}={dtype!r}" in message


def test_unknown_fields_are_named():
    message = _refusal(mixed_precision={"param_dtype": BF16, "reduce_dype": FP32})
    assert "reduce_dype=torch.float32" in message and "reduce_dtype" in message
    from torch.distributed.fsdp import MixedPrecision  # FSDP1's, other fields

    message = _refusal(mixed_precision=MixedPrecision(param_dtype=BF16))
    assert "buffer_dtype=None" in message and "FSDP1" in message


@pytest.mark.parametrize("given", ["bf16", torch.bfloat16, 16])
def test_no_policy_is_refused(given):
    assert f"mixed_precision={given!r}" in _refusal(mixed_precision=given)


def test_cast_forward_inputs_must_be_bool():
    assert "cast_forward_inputs='yes'" in _refusal(mixed_precision={"cast_forward_inputs": "yes"})


def test_parameters_must_be_float32():
    message = _refusal(module=seeded(Net).double(), mixed_precision={"param_dtype": BF16})
    assert "inp.weight (torch.float64)" in message and "float32" in message


def test_frozen_parameters_under_param_dtype_are_named():
    net = seeded(Net)
    net.inp.weight.requires_grad_(False)
    message = _refusal(module=net, mixed_precision={"param_dtype": BF16})
    assert "inp.weight" in message and "frozen" in message
    # Without a param_dtype nothing is cast: frozen parameters are fine.
    FSDP(net, mixed_precision={"reduce_dtype": BF16})
