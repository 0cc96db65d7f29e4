"""FullyShardedDataParallel in one process without a process group: exactly the plain module.

The oracle is the plain module with the plain optimizer, trained side by side on the same data.

- training: stages 2 and 3, one unit and a unit per Linear plus the root's own parameter, SGD
  (momentum, weight decay) and AdamW: every loss and every parameter equals the plain module's,
  bit for bit, for 5 steps; over random layer widths, biases, stages and wrappings too;
- layout, over random parameter shapes (0-d included): the shard is the parameters flattened in
  registration order; gathered, each module attribute is a view of the unit's buffer holding the
  original value; ``full_values`` and ``shard_of`` invert each other; stage 3 frees the buffer
  again, stage 2 keeps it;
- ``full_state_dict`` equals the plain ``state_dict()`` (keys, order, bits) and
  ``load_full_state_dict`` of another model's plain state makes the wrapper that model;
  ``full_optim_state_dict`` equals the plain optimizer's ``state_dict()``;
- ``gathered(writeback=True)``: edits reach the shards and the next forward, in both stages;
  ``gathered(writeback=False)``: edits are discarded, in both stages;
- fused torch optimizers (``fused=True``) train like the plain module, in both stages;
- a unit holding only 0-d parameters (a root ``logit_scale`` beside wrapped Linears) saves and
  reloads its optimizer state through the full optimizer state dict;
- two backward calls through one retained graph accumulate both gradients;
- known limitation, strict xfail: a shard changed in place through ``.data`` is not seen by
  stage 2's next forward.
- arguments: a stage other than 2 or 3 raises ValueError pointing to ShardedOptimizer; an
  ``auto_wrap`` that is neither module classes nor a predicate raises ValueError; one unit with
  two dtypes raises ValueError naming the parameters and their dtypes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tandem
from tests.parallel.fsdp.models import MLP, Net, seeded

FSDP = tandem.FullyShardedDataParallel
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


class Scaled(nn.Module):
    """Wrapped Linears and a 0-d root parameter (CLIP's logit_scale): a unit of one scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 5)
        self.out = nn.Linear(5, 3)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x))) * self.logit_scale


class Bag(nn.Module):
    """Parameters of the given shapes, p0, p1, ..., and nothing else."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        for i, shape in enumerate(shapes):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape)))


def _batch(step: int, din: int = 6, dout: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, din, generator=g), torch.randn(4, dout, generator=g)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, **shape) -> torch.Tensor:
    x, y = _batch(step, **shape)
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _assert_same_state(ours: dict, theirs: dict, ordered: bool = True) -> None:
    assert list(ours) == list(theirs) if ordered else ours.keys() == theirs.keys()
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), k


def _assert_same_forward(model: nn.Module, plain: nn.Module, step: int = 0) -> None:
    """Both give the same bits on ``step``'s inputs (under no_grad)."""
    x = _batch(step)[0]
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))


def _assert_same_model(model: FSDP, plain: nn.Module) -> None:
    """The wrapper's full state dict is the plain one, and its forward gives the same bits."""
    _assert_same_state(model.full_state_dict(), plain.state_dict())
    _assert_same_forward(model, plain)


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not dist.is_initialized()


# -- training -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("auto_wrap", [None, {nn.Linear}], ids=["one-unit", "linear"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_trains_like_the_plain_module_bitwise(stage, auto_wrap, name):
    cls, kwargs = OPTIMIZERS[name]
    model, plain = FSDP(seeded(Net), stage=stage, auto_wrap=auto_wrap), seeded(Net)
    opt, ref = cls(model.parameters(), **kwargs), cls(plain.parameters(), **kwargs)
    for step in range(5):
        assert torch.equal(_step(model, opt, step), _step(plain, ref, step)), step
    _assert_same_state(model.full_state_dict(), plain.state_dict())
    full_optim = model.full_optim_state_dict(opt)
    reference = ref.state_dict()
    assert full_optim["param_groups"] == reference["param_groups"]
    assert full_optim["state"].keys() == reference["state"].keys()
    for i, s in reference["state"].items():
        _assert_same_state(full_optim["state"][i], s, ordered=False)
    _assert_same_forward(model, plain, step=99)


widths_st = st.lists(st.integers(1, 6), min_size=2, max_size=4)


@settings(max_examples=25, deadline=None)
@given(
    widths=widths_st,
    biases=st.lists(st.booleans(), min_size=3, max_size=3),
    stage=st.sampled_from([2, 3]),
    wrap=st.booleans(),
    name=st.sampled_from(list(OPTIMIZERS)),
)
def test_random_widths_train_like_the_plain_module(widths, biases, stage, wrap, name):
    cls, kwargs = OPTIMIZERS[name]
    make = lambda: seeded(MLP, widths, biases)  # noqa: E731
    model = FSDP(make(), stage=stage, auto_wrap={nn.Linear} if wrap else None)
    plain = make()
    opt, ref = cls(model.parameters(), **kwargs), cls(plain.parameters(), **kwargs)
    shape = {"din": widths[0], "dout": widths[-1]}
    for step in range(2):
        assert torch.equal(_step(model, opt, step, **shape), _step(plain, ref, step, **shape))
    _assert_same_state(model.full_state_dict(), plain.state_dict())


# -- layout ---------------------------------------------------------------------------------------

shapes_st = st.lists(st.lists(st.integers(1, 4), max_size=3).map(tuple), min_size=1, max_size=6)


@settings(max_examples=50, deadline=None)
@given(shapes=shapes_st, stage=st.sampled_from([2, 3]))
def test_layout_round_trips(shapes, stage):
    bag = seeded(Bag, shapes)
    originals = {n: p.detach().clone() for n, p in bag.named_parameters()}
    model = FSDP(bag, stage=stage)
    (unit,) = model.units
    flat = torch.cat([v.reshape(-1) for v in originals.values()])
    assert torch.equal(unit.shard.detach(), flat)
    assert [id(p) for p in model.parameters()] == [id(unit.shard)]
    assert list(bag.named_parameters()) == []
    assert unit.is_gathered == (stage == 2)
    with model.gathered(writeback=False) as net:
        base = unit.full.untyped_storage().data_ptr()
        for name, value in originals.items():
            attribute = getattr(net, name)
            assert attribute.shape == value.shape and torch.equal(attribute, value), name
            assert attribute.untyped_storage().data_ptr() == base, name
        values = unit.full_values()
        assert list(values) == list(originals)
        for name, value in originals.items():
            assert torch.equal(values[name], value), name
        assert torch.equal(unit.shard_of(values), unit.shard.detach())
    assert unit.is_gathered == (stage == 2)
    _assert_same_state(model.full_state_dict(), originals)


# -- state ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_load_full_state_dict_makes_the_wrapper_that_model(stage):
    model = FSDP(seeded(Net), stage=stage, auto_wrap={nn.Linear})
    other = seeded(Net, seed=1)
    other.shift.fill_(5.0)
    model.load_full_state_dict(other.state_dict())
    _assert_same_model(model, other)


@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_writeback_reaches_the_shards(stage):
    model, plain = FSDP(seeded(Net), stage=stage, auto_wrap={nn.Linear}), seeded(Net)
    with model.gathered(writeback=True) as net:
        net.inp.weight.mul_(2.0)
        net.offset.fill_(1.0)
    with torch.no_grad():
        plain.inp.weight.mul_(2.0)
        plain.offset.fill_(1.0)
    _assert_same_model(model, plain)


@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_without_writeback_discards_edits(stage):
    model, plain = FSDP(seeded(Net), stage=stage, auto_wrap={nn.Linear}), seeded(Net)
    with model.gathered(writeback=False) as net:
        net.inp.weight.zero_()
    # Neither the shards, nor the full state dict, nor the next forward see the edit.
    assert torch.equal(model.units[0].shard.detach()[:30], plain.inp.weight.reshape(-1))
    _assert_same_model(model, plain)


@pytest.mark.parametrize("stage", [2, 3])
def test_fused_optimizer_trains_like_the_plain_module(stage):
    model, plain = FSDP(seeded(Net), stage=stage), seeded(Net)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    ref = torch.optim.AdamW(plain.parameters(), lr=0.01, fused=True)
    for step in range(3):
        assert torch.equal(_step(model, opt, step), _step(plain, ref, step)), step
    _assert_same_state(model.full_state_dict(), plain.state_dict())


@pytest.mark.xfail(
    strict=True,
    reason="stage 2 (and stage 3's root after a forward without backward) tells a changed shard "
    "by its autograd version counter, which in-place writes through .data do not bump",
)
def test_shard_changed_through_data_is_seen_by_the_next_forward():
    model, plain = FSDP(seeded(Net), stage=2), seeded(Net)
    for p in model.parameters():
        p.data.mul_(0.5)
    for p in plain.parameters():
        p.data.mul_(0.5)
    _assert_same_forward(model, plain)


@pytest.mark.parametrize("stage", [2, 3])
def test_backward_twice_through_a_retained_graph(stage):
    model, plain = FSDP(seeded(Net), stage=stage, auto_wrap={nn.Linear}), seeded(Net)
    x, y = _batch(0)
    for m in (model, plain):
        loss = F.mse_loss(m(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for unit in model.units:
        flat = torch.cat([grads[e.fqn].reshape(-1) for e in unit.entries])
        assert torch.equal(unit.shard.grad, flat), [e.fqn for e in unit.entries]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_scalar_only_unit_reloads_its_optimizer_state(name):
    cls, kwargs = OPTIMIZERS[name]
    model, plain = FSDP(seeded(Scaled), auto_wrap={nn.Linear}), seeded(Scaled)
    opt, ref = cls(model.parameters(), **kwargs), cls(plain.parameters(), **kwargs)
    for step in range(2):
        _step(model, opt, step)
        _step(plain, ref, step)
    full_optim = model.full_optim_state_dict(opt)
    reference = ref.state_dict()
    for i, s in reference["state"].items():
        _assert_same_state(full_optim["state"][i], s, ordered=False)
    resumed = FSDP(seeded(Scaled), auto_wrap={nn.Linear})
    resumed.load_full_state_dict(model.full_state_dict())
    resumed_opt = cls(resumed.parameters(), **kwargs)
    resumed.load_full_optim_state_dict(resumed_opt, copy.deepcopy(full_optim))
    for step in range(2, 4):
        assert torch.equal(_step(resumed, resumed_opt, step), _step(plain, ref, step)), step
    _assert_same_state(resumed.full_state_dict(), plain.state_dict())


# -- arguments ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 4, "3"])
def test_other_stages_point_to_sharded_optimizer(stage):
    with pytest.raises(ValueError, match="ShardedOptimizer") as info:
        FSDP(seeded(Net), stage=stage)
    assert f"stage={stage!r}" in str(info.value)


@pytest.mark.parametrize("auto_wrap", [{int}, [nn.Linear, "Linear"], "Linear"])
def test_auto_wrap_must_be_module_classes_or_a_predicate(auto_wrap):
    with pytest.raises(ValueError, match="auto_wrap"):
        FSDP(seeded(Net), auto_wrap=auto_wrap)


def test_one_unit_of_two_dtypes_names_the_parameters():
    net = seeded(Net)
    net.block.double()
    with pytest.raises(ValueError, match="dtypes") as info:
        FSDP(net)
    message = str(info.value)
    assert "block.0.weight (torch.float64)" in message
    assert "inp.weight (torch.float32)" in message
    # wrapped apart, each dtype is a unit of its own
    model = FSDP(net, auto_wrap={nn.Linear})
    dtypes = sorted(str(u.shard.dtype) for u in model.units)  # inp, block.0, the root's offset
    assert dtypes == ["torch.float32", "torch.float32", "torch.float64"]
