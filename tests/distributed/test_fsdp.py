"""FullyShardedDataParallel (ZeRO 2 and 3) takes tandem.DDP's steps, holding 1/N of the memory.

The oracle is tandem.DDP with the plain torch optimizer, run side by side in the same ranks on the
same per-rank data, or a plain model in one process where a gradient itself is checked. The main
model has units the world sizes here do not divide (auto_wrap={nn.Linear}: a Linear of 35
elements, a nested Linear of 15, the root's own parameter of 3; auto_wrap=None: 53 in one unit),
and a buffer between its parameters in state_dict order. Proven, float32, tolerance 1e-6:

- parity: stages 2 and 3, SGD (momentum, weight decay) and AdamW, world sizes 2 and 4, several
  units and one unit: after 5 steps every parameter equals DDP's (read through
  ``full_state_dict`` on rank 0 and through ``gathered()`` on every rank), the same bits on every
  rank, and every step's loss equals DDP's; at world size 3, random layer widths (with and
  without biases, a root parameter) give the same;
- memory: each unit's shard holds ceil(numel / N) elements, the ranks' shards laid end to end are
  the unit's parameters in registration order then zeros; the wrapper's ``parameters()`` are the
  shards and the module keeps none of the flattened ones; stage 3 has, while a unit runs its
  forward, only that unit and the root gathered, and between steps no unit gathered and the
  module's parameter attributes without storage; stage 2 keeps every unit gathered; the
  optimizer's element-wise state per rank is exactly the padded shards' size per state tensor
  (1/N of the plain optimizer's, plus padding);
- gradient accumulation: two backward calls leave in each shard's ``.grad`` this rank's slice of
  the mean over ranks of the micro-batch gradients' sum (a plain model in this process computing
  every rank's micro-batches is the oracle), and train like DDP with ``no_sync``; an evaluation
  under ``torch.no_grad()`` after each step returns DDP's outputs and changes nothing; one
  between a forward and its backward changes nothing; a forward with grad and no backward before
  a step changes nothing;
- a frozen parameter stays unchanged, registered and rank 0's value on every rank (rank 1 starts
  from other values); tied weights (embedding and head, the head's bias a unit of its own) go to
  the root unit, stay one tensor and train like DDP; a Linear called twice per forward and
  wrapped as its own unit (a predicate) trains like DDP; float32 and float64 units side by side;
- ``clip_grad_norm_`` (2-norm and inf-norm, clipping active) returns DDP's
  ``torch.nn.utils.clip_grad_norm_`` total norm and leads to its parameters;
- state: ``full_state_dict`` on rank ``to`` (None elsewhere) equals DDP's ``state_dict()``
  (keys, order, values) and loads strictly into the plain module; ``full_optim_state_dict``
  equals the plain optimizer's ``state_dict()`` and loads into ``torch.optim.AdamW`` over the
  plain module; a full model and optimizer state saved at world size 2 resumes at world size 4
  exactly as DDP resumed from the same state does; a full state loaded back at the same world
  size and a sharded state saved one file per rank and loaded into a fresh wrapper (other
  initial values and buffers) continue bit for bit like the uninterrupted run; a sharded state
  of another rank, of another world size or of another wrapping is refused with a ValueError
  that points to the full state dict; a full state with a missing, an unexpected or a
  wrongly-shaped key is refused naming it;
- bad input: a model that differs across ranks raises a ValueError naming the parameter on
  every rank (no hang); one unit with two dtypes raises naming the parameters, on every rank.
"""

from __future__ import annotations

import copy
import functools
import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem
from tests.fsdp_models import MLP, Net, seeded
from tests.harness import run_ranks

FSDP = tandem.FullyShardedDataParallel
STEPS = 5
TOL = 1e-6
PER_RANK = 4
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}
# Element-wise state tensors the optimizer keeps per parameter (SGD: momentum; AdamW: moments).
STATE_TENSORS = {"sgd": 1, "adamw": 2}
WRAPS = {"linear": {nn.Linear}, "none": None}
# The units' sizes, by the model's arithmetic: inp 6*5+5, block.0 5*3, offset 3.
UNIT_NUMELS = {"linear": [35, 15, 3], "none": [53]}


def _ceil(n: int, ws: int) -> int:
    return -(-n // ws)


# -- models and data ------------------------------------------------------------------------------


class Tied(nn.Module):
    """Embedding and head share one weight; the head's bias and ``mid`` are units under Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


class Reuse(nn.Module):
    """``shared`` runs twice in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 5)
        self.shared = nn.Linear(5, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.out(h)


class TwoDtypes(nn.Module):
    """A float32 Linear feeding a float64 one: two units of different dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 5)
        self.block = nn.Linear(5, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.tanh(self.inp(x)).double()).float()


def _net(seed: int = 0) -> nn.Module:
    return seeded(Net, seed=seed)


def _batch(step: int, rank: int, ws: int, micro: int = 0, din: int = 6, dout: int = 3):
    """This rank's slice of the global batch of ``step`` (every rank can compute every slice)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(PER_RANK * ws, din, generator=g)
    y = torch.randn(PER_RANK * ws, dout, generator=g)
    mine = slice(PER_RANK * rank, PER_RANK * (rank + 1))
    return x[mine], y[mine]


def _tokens(step: int, rank: int, ws: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 11, (PER_RANK * ws, 5), generator=g)
    y = torch.randint(0, 11, (PER_RANK * ws, 5), generator=g)
    mine = slice(PER_RANK * rank, PER_RANK * (rank + 1))
    return x[mine], y[mine]


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def _cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, 11), y.reshape(-1))


def _step(model, opt, step: int, data=_batch, loss=_mse) -> float:
    rank, ws = dist.get_rank(), dist.get_world_size()
    x, y = data(step, rank, ws)
    opt.zero_grad()
    value = loss(model, x, y)
    value.backward()
    opt.step()
    return value.item()


def _side_by_side(make, optimizer: str, stage: int, auto_wrap):
    """FSDP over ``make()`` and the oracle, tandem.DDP over another ``make()``, each with its own
    optimizer named ``optimizer``: (model, opt, oracle, ref)."""
    model = FSDP(make(), stage=stage, auto_wrap=auto_wrap)
    oracle = tandem.DDP(make())
    cls, kwargs = OPTIMIZERS[optimizer]
    return model, cls(model.parameters(), **kwargs), oracle, cls(oracle.parameters(), **kwargs)


def _train(model, opt, oracle, ref, steps: int, **step) -> list[tuple[float, float]]:
    """Steps 0 to ``steps - 1`` of both, side by side; the losses, (ours, DDP's) per step."""
    return [(_step(model, opt, s, **step), _step(oracle, ref, s, **step)) for s in range(steps)]


# -- reading results ------------------------------------------------------------------------------


def _lookup(module: nn.Module, key: str) -> torch.Tensor:
    return functools.reduce(getattr, key.split("."), module)


def _gathered(model: FSDP, keys) -> dict[str, torch.Tensor]:
    """Every rank: the whole tensors named ``keys``, read through ``gathered()``."""
    with model.gathered(writeback=False) as net:
        return {k: _lookup(net, k).detach().clone() for k in keys}


def _diff(a: dict, b: dict) -> float:
    assert list(a) == list(b), (list(a), list(b))
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a), default=0.0)


def _same_everywhere(tensors) -> bool:
    flat = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(flat, other) for other in everyone)


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def _compare(model: FSDP, expected: dict[str, torch.Tensor]) -> dict:
    """The gathered tensors named like ``expected``: how far from it, and the same on every rank."""
    values = _gathered(model, expected)
    return {"diff": _diff(values, expected), "same_everywhere": _same_everywhere(values.values())}


def _optim_match(full: dict, reference: dict) -> dict:
    """How a full optimizer state dict compares with the plain optimizer's ``state_dict()``."""
    keys = {i: sorted(s) for i, s in full["state"].items()}
    return {
        "groups": full["param_groups"] == reference["param_groups"],
        "keys": keys == {i: sorted(s) for i, s in reference["state"].items()},
        "diff": max(
            (
                (torch.as_tensor(full["state"][i][k]).double() - torch.as_tensor(v).double())
                .abs()
                .max()
                .item()
                for i, s in reference["state"].items()
                for k, v in s.items()
                if k in full["state"].get(i, {})
            ),
            default=0.0,
        ),
    }


def _optim_ok(match: dict) -> bool:
    return match["groups"] and match["keys"] and match["diff"] <= TOL


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the element-wise state tensors (not AdamW's 0-d step counters)."""
    return sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )


def _layout(model: FSDP, plain: dict[str, torch.Tensor]) -> dict:
    """Where the memory is, and whether the ranks' shards laid end to end are the parameters."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    order = list(plain)
    slice_diff = 0.0
    for unit in model.units:
        mine = {e.fqn for e in unit.entries}
        # registration order of the oracle's module, padded with zeros
        flat = torch.cat([plain[n].reshape(-1) for n in order if n in mine])
        size = _ceil(flat.numel(), ws)
        flat = F.pad(flat, (0, size * ws - flat.numel()))
        everyone = [torch.empty_like(unit.shard) for _ in range(ws)]
        dist.all_gather(everyone, unit.shard.detach().contiguous())
        slice_diff = max(slice_diff, (torch.cat(everyone) - flat).abs().max().item())
        slice_diff = max(
            slice_diff, (unit.shard - flat[rank * size : (rank + 1) * size]).abs().max().item()
        )
    views = [
        getattr(module, name).untyped_storage().nbytes()
        for unit in model.units
        for e in unit.entries
        for module, name in e.locations
    ]
    return {
        "unit_numels": sorted(u.numel for u in model.units),
        "shard_numels": sorted(u.shard.numel() for u in model.units),
        "slice_diff": slice_diff,
        "params_are_shards": [id(p) for p in model.parameters()]
        == [id(u.shard) for u in model.units],
        "module_params": [n for n, _ in model.module.named_parameters()],
        "gathered": [u.is_gathered for u in model.units],
        "view_bytes": views,
    }


# -- 1, 2: parity with DDP, sharded memory --------------------------------------------------------


def _parity() -> list[dict]:
    rank = dist.get_rank()
    results = []
    for stage in (2, 3):
        for wrap, auto_wrap in WRAPS.items():
            for name in OPTIMIZERS:
                model, opt, oracle, ref = _side_by_side(_net, name, stage, auto_wrap)
                # units gathered while each Linear runs (hooks run after the wrapper's gather)
                during: list[int] = []
                for linear in (model.module.inp, model.module.block[0]):
                    linear.register_forward_pre_hook(
                        lambda *_, d=during, m=model: d.append(sum(u.is_gathered for u in m.units))
                    )
                losses = _train(model, opt, oracle, ref, STEPS)
                expected = oracle.module.state_dict()
                plain_params = dict(oracle.module.named_parameters())
                layout = _layout(model, {k: v.detach() for k, v in plain_params.items()})
                compared = _compare(model, expected)
                full = model.full_state_dict()
                results.append(
                    {
                        "config": (stage, wrap, name),
                        "loss_diff": max(abs(a - b) for a, b in losses),
                        **compared,
                        "full_keys_match": None if full is None else list(full) == list(expected),
                        "full_diff": None if full is None else _diff(full, expected),
                        "state_bytes": _state_bytes(opt),
                        "plain_state_bytes": _state_bytes(ref),
                        "gathered_during_forward": sorted(set(during)),
                        **layout,
                        "rank": rank,
                    }
                )
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_with_ddp_and_sharded_memory(world_size):
    results = run_ranks(_parity, world_size, timeout=90)
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            stage, wrap, name = r["config"]
            context = f"rank {rank} of {world_size}: {r}"
            assert r["loss_diff"] <= TOL, context
            assert r["diff"] <= TOL, context
            assert r["same_everywhere"], context
            if rank == 0:
                assert r["full_keys_match"] and r["full_diff"] <= TOL, context
            else:
                assert r["full_keys_match"] is None and r["full_diff"] is None, context
            # memory
            numels = UNIT_NUMELS[wrap]
            assert r["unit_numels"] == sorted(numels), context
            assert r["shard_numels"] == sorted(_ceil(n, world_size) for n in numels), context
            assert r["slice_diff"] <= TOL, context
            assert r["params_are_shards"] and r["module_params"] == [], context
            if stage == 3:
                # during forward: the running unit, the root (kept for backward) and, from the
                # second forward on, the next unit (prefetched), no other
                assert max(r["gathered_during_forward"]) <= min(3, len(numels)), context
                assert not any(r["gathered"]), context
                assert set(r["view_bytes"]) == {0}, context
            else:
                assert r["gathered_during_forward"] == [len(numels)], context
                assert all(r["gathered"]) and all(b > 0 for b in r["view_bytes"]), context
            per_element = 4 * STATE_TENSORS[name]  # float32 bytes times state tensors
            plain_bytes, shard_bytes = r["plain_state_bytes"], r["state_bytes"]
            assert plain_bytes == per_element * sum(numels), context
            assert shard_bytes == per_element * sum(_ceil(n, world_size) for n in numels), context
            # 1/N of the plain optimizer's, up to the padding (less than N elements per unit)
            padding = per_element * world_size * len(numels)
            assert shard_bytes * world_size < plain_bytes + padding, context


def _random_widths(configs: list[dict]) -> list[float]:
    diffs = []
    for c in configs:
        make = functools.partial(seeded, MLP, c["widths"], c["biases"], seed=c["seed"])
        auto_wrap = {nn.Linear} if c["wrap"] else None
        model, opt, oracle, ref = _side_by_side(make, c["optimizer"], c["stage"], auto_wrap)
        data = functools.partial(_batch, din=c["widths"][0], dout=c["widths"][-1])
        _train(model, opt, oracle, ref, 3, data=data)
        result = _compare(model, _params(oracle.module))
        assert result["same_everywhere"], c
        diffs.append(result["diff"])
    return diffs


def test_parity_random_widths_three_ranks():
    rng = random.Random(20261121)
    configs = []
    for i in range(6):
        depth = rng.randint(1, 3)
        configs.append(
            {
                "widths": [rng.randint(1, 7) for _ in range(depth + 1)],
                "biases": [rng.random() < 0.5 for _ in range(depth)],
                "stage": (2, 3)[i % 2],
                "wrap": i % 3 != 0,
                "optimizer": ("sgd", "adamw")[(i // 2) % 2],
                "seed": i,
            }
        )
    for rank, diffs in enumerate(run_ranks(_random_widths, 3, args=(configs,), timeout=90)):
        for c, d in zip(configs, diffs, strict=True):
            assert d <= TOL, (rank, c, d)


# -- 3 to 6: accumulation, evaluation, frozen, tied, reuse, dtypes, clipping ---------------------


def _accumulated_grad(stage: int) -> float:
    """shard.grad after two backward calls vs this rank's slice of the plain gradient sum."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = FSDP(_net(), stage=stage, auto_wrap={nn.Linear})
    for m in (0, 1):
        _mse(model, *_batch(0, rank, ws, micro=m)).backward()
    plain = _net()
    for r in range(ws):
        for m in (0, 1):
            _mse(plain, *_batch(0, r, ws, micro=m)).backward()
    grads = {n: p.grad / ws for n, p in plain.named_parameters()}
    diff = 0.0
    for unit in model.units:
        mine = {e.fqn for e in unit.entries}
        flat = torch.cat([g.reshape(-1) for n, g in grads.items() if n in mine])
        size = _ceil(flat.numel(), ws)
        flat = F.pad(flat, (0, size * ws - flat.numel()))
        diff = max(
            diff, (unit.shard.grad - flat[rank * size : (rank + 1) * size]).abs().max().item()
        )
    return diff


def _variant(stage: int, variant: str) -> dict:
    """Three AdamW steps with an accumulation or an evaluation pattern, vs plain DDP steps."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model, opt, oracle, ref = _side_by_side(_net, "adamw", stage, {nn.Linear})
    eval_diffs, gathered_after = [], []
    for step in range(3):
        x, y = _batch(step, rank, ws)
        x_eval = _batch(100 + step, rank, ws)[0]
        if variant == "dangling":
            model(x_eval)  # grad mode, no backward
        opt.zero_grad()
        ref.zero_grad()
        if variant == "accumulate":
            for m in (0, 1):
                _mse(model, *_batch(step, rank, ws, micro=m)).backward()
            with oracle.no_sync():
                _mse(oracle, *_batch(step, rank, ws, micro=0)).backward()
            _mse(oracle, *_batch(step, rank, ws, micro=1)).backward()
        elif variant == "interleaved":
            loss = _mse(model, x, y)
            with torch.no_grad():
                eval_diffs.append((model(x_eval) - oracle.module(x_eval)).abs().max().item())
            loss.backward()
            _mse(oracle, x, y).backward()
        else:
            _mse(model, x, y).backward()
            _mse(oracle, x, y).backward()
        opt.step()
        ref.step()
        if variant == "eval":
            with torch.no_grad():
                eval_diffs.append((model(x_eval) - oracle.module(x_eval)).abs().max().item())
        gathered_after.append([u.is_gathered for u in model.units])
    return {
        **_compare(model, _params(oracle.module)),
        "eval_diff": max(eval_diffs, default=0.0),
        "gathered_after": gathered_after,
    }


def _frozen(stage: int, wrap: str) -> dict:
    """inp.weight frozen; rank 1 starts from other values (rank 0's must win)."""
    rank = dist.get_rank()

    def make() -> nn.Module:
        net = _net()
        net.inp.weight.requires_grad_(False)
        if rank == 1:
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(1.0)
        return net

    initial = _net().inp.weight.detach().clone()  # rank 0's value
    model, opt, oracle, ref = _side_by_side(make, "adamw", stage, WRAPS[wrap])
    _train(model, opt, oracle, ref, 3)
    expected = oracle.module.state_dict()
    compared = _compare(model, expected)
    frozen = model.module.inp.weight
    full = model.full_state_dict()
    full_optim = model.full_optim_state_dict(opt)
    return {
        "optim": None if full_optim is None else _optim_match(full_optim, ref.state_dict()),
        **compared,
        "frozen_unchanged": torch.equal(frozen, initial),
        "frozen_is_parameter": isinstance(frozen, nn.Parameter) and not frozen.requires_grad,
        "module_params": [n for n, _ in model.module.named_parameters()],
        "frozen_everywhere": _same_everywhere([frozen]),
        "full_diff": None if full is None else _diff(full, expected),
    }


def _tied(stage: int) -> dict:
    make = functools.partial(seeded, Tied)
    model, opt, oracle, ref = _side_by_side(make, "adamw", stage, {nn.Linear})
    _train(model, opt, oracle, ref, 3, data=_tokens, loss=_cross_entropy)
    expected = oracle.module.state_dict()
    compared = _compare(model, expected)
    with model.gathered(writeback=False) as net:
        one_tensor = net.head.weight is net.embed.weight
    root = next(u for u in model.units if "embed.weight" in [e.fqn for e in u.entries])
    full = model.full_state_dict()
    full_optim = model.full_optim_state_dict(opt)
    return {
        "optim": None if full_optim is None else _optim_match(full_optim, ref.state_dict()),
        **compared,
        "one_tensor": one_tensor,
        "unit_fqns": [[e.fqn for e in u.entries] for u in model.units],
        "root_locations": [name for e in root.entries for _, name in e.locations],
        "full_diff": None if full is None else _diff(full, expected),
    }


def _reuse(stage: int) -> dict:
    make = functools.partial(seeded, Reuse)
    predicate = lambda m: isinstance(m, nn.Linear)  # noqa: E731
    model, opt, oracle, ref = _side_by_side(make, "sgd", stage, predicate)
    _train(model, opt, oracle, ref, 3)
    return {**_compare(model, _params(oracle.module)), "units": len(model.units)}


def _two_dtypes(stage: int) -> dict:
    make = functools.partial(seeded, TwoDtypes)
    model, opt, oracle, ref = _side_by_side(make, "adamw", stage, {nn.Linear})
    _train(model, opt, oracle, ref, 3)
    expected = _params(oracle.module)
    return {
        "diff": _diff(_gathered(model, expected), expected),
        "dtypes": sorted(str(u.shard.dtype) for u in model.units),
    }


def _clip(stage: int, norm_type: float) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    model, opt, oracle, ref = _side_by_side(_net, "sgd", stage, {nn.Linear})
    norms = []
    for s in range(3):
        x, y = _batch(s, rank, ws)
        opt.zero_grad()
        ref.zero_grad()
        _mse(model, x, y).backward()
        _mse(oracle, x, y).backward()
        ours = model.clip_grad_norm_(0.05, norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 0.05, norm_type)
        norms.append((ours.item(), theirs.item()))
        opt.step()
        ref.step()
    return {"norms": norms, **_compare(model, _params(oracle.module))}


def _behaviours() -> dict:
    out: dict = {}
    for stage in (2, 3):
        out[("accumulated_grad", stage)] = _accumulated_grad(stage)
        for variant in ("accumulate", "eval", "interleaved", "dangling"):
            out[(variant, stage)] = _variant(stage, variant)
        for wrap in WRAPS:
            out[("frozen", stage, wrap)] = _frozen(stage, wrap)
        out[("tied", stage)] = _tied(stage)
        out[("reuse", stage)] = _reuse(stage)
        out[("two_dtypes", stage)] = _two_dtypes(stage)
        for norm_type in (2.0, float("inf")):
            out[("clip", stage, norm_type)] = _clip(stage, norm_type)
    return out


@pytest.fixture(scope="module")
def behaviours() -> list[dict]:
    return run_ranks(_behaviours, 2, timeout=90)


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_accumulation_sums_micro_batches(behaviours, stage):
    for rank, r in enumerate(behaviours):
        assert r[("accumulated_grad", stage)] <= TOL, (rank, r[("accumulated_grad", stage)])
        result = r[("accumulate", stage)]
        assert result["diff"] <= TOL and result["same_everywhere"], (rank, result)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("variant", ["eval", "interleaved", "dangling"])
def test_forwards_without_backward_change_nothing(behaviours, stage, variant):
    for rank, r in enumerate(behaviours):
        result = r[(variant, stage)]
        assert result["diff"] <= TOL and result["same_everywhere"], (rank, result)
        assert result["eval_diff"] <= TOL, (rank, result)
        for gathered in result["gathered_after"]:
            assert all(gathered) if stage == 2 else not any(gathered), (rank, result)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("wrap", list(WRAPS))
def test_frozen_parameter_stays_replicated_and_unchanged(behaviours, stage, wrap):
    for rank, r in enumerate(behaviours):
        result = r[("frozen", stage, wrap)]
        assert result["diff"] <= TOL and result["same_everywhere"], (rank, result)
        assert result["frozen_unchanged"] and result["frozen_is_parameter"], (rank, result)
        assert result["frozen_everywhere"], (rank, result)
        assert result["module_params"] == ["inp.weight"], (rank, result)
        if rank == 0:
            assert result["full_diff"] <= TOL and _optim_ok(result["optim"]), result


@pytest.mark.parametrize("stage", [2, 3])
def test_tied_weights_go_to_the_root_and_train_like_ddp(behaviours, stage):
    for rank, r in enumerate(behaviours):
        result = r[("tied", stage)]
        assert result["diff"] <= TOL and result["same_everywhere"], (rank, result)
        assert result["one_tensor"], (rank, result)
        assert sorted(result["unit_fqns"]) == [
            ["embed.weight"],
            ["head.bias"],
            ["mid.weight", "mid.bias"],
        ], result
        assert sorted(result["root_locations"]) == ["weight", "weight"], result
        if rank == 0:
            assert result["full_diff"] <= TOL and _optim_ok(result["optim"]), result


@pytest.mark.parametrize("stage", [2, 3])
def test_module_called_twice_per_forward(behaviours, stage):
    for rank, r in enumerate(behaviours):
        result = r[("reuse", stage)]
        assert result["units"] == 3, result
        assert result["diff"] <= TOL and result["same_everywhere"], (rank, result)


@pytest.mark.parametrize("stage", [2, 3])
def test_units_of_different_dtypes(behaviours, stage):
    for rank, r in enumerate(behaviours):
        result = r[("two_dtypes", stage)]
        assert result["dtypes"] == ["torch.float32", "torch.float64"], result
        assert result["diff"] <= TOL, (rank, result)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_equals_torch_on_ddp(behaviours, stage, norm_type):
    for rank, r in enumerate(behaviours):
        result = r[("clip", stage, norm_type)]
        for ours, theirs in result["norms"]:
            assert abs(ours - theirs) <= TOL * max(1.0, theirs), (rank, result)
            assert theirs > 0.05, result  # clipping was active
        assert result["diff"] <= TOL and result["same_everywhere"], (rank, result)
    # the total norm is global: the same on every rank
    assert (
        behaviours[0][("clip", stage, norm_type)]["norms"]
        == behaviours[1][("clip", stage, norm_type)]["norms"]
    )


# -- 7: state -------------------------------------------------------------------------------------


def _adamw(params) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS["adamw"]
    return cls(params, **kwargs)


def _refused(fn, *args) -> str | None:
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    return None


def _save_and_reload(tmp: str) -> dict:
    """World size 2: full and sharded states, their round trips and refusals."""
    rank = dist.get_rank()
    out: dict = {}
    for stage in (2, 3):
        model, opt, oracle, ref = _side_by_side(_net, "adamw", stage, {nn.Linear})
        _train(model, opt, oracle, ref, 3)
        full = model.full_state_dict()
        full_at_1 = model.full_state_dict(to=1)
        full_optim = model.full_optim_state_dict(opt)
        r: dict = {
            "none_elsewhere": (full is None) == (rank != 0) and (full_at_1 is None) == (rank != 1)
        }
        if rank == 0:
            expected = oracle.module.state_dict()
            r["keys"] = list(full) == list(expected)
            r["diff"] = _diff(full, expected)
            plain = _net(seed=5)
            plain.load_state_dict(full, strict=True)
            r["plain_diff"] = _diff(plain.state_dict(), expected)
            reference = ref.state_dict()
            r["optim"] = _optim_match(full_optim, reference)
            plain_opt = _adamw(plain.parameters())
            plain_opt.load_state_dict(copy.deepcopy(full_optim))
            r["plain_optim_loaded"] = len(plain_opt.state) == len(reference["state"])
            torch.save({"model": full, "optim": full_optim}, os.path.join(tmp, f"full{stage}.pt"))
        else:
            r["optim_none"] = full_optim is None
        # full state, back at the same world size: every rank needs it
        objects = [full, full_optim]
        dist.broadcast_object_list(objects, src=0)
        again = FSDP(_net(seed=3), stage=stage, auto_wrap={nn.Linear})
        again_opt = _adamw(again.parameters())
        again.load_full_state_dict(objects[0])
        again.load_full_optim_state_dict(again_opt, copy.deepcopy(objects[1]))
        # sharded state, one file per rank
        shard_dir = os.path.join(tmp, f"sharded{stage}")
        os.makedirs(shard_dir, exist_ok=True)
        torch.save(
            {"model": model.sharded_state_dict(), "optim": opt.state_dict()},
            os.path.join(shard_dir, f"rank{rank}.pt"),
        )
        dist.barrier()
        saved = torch.load(os.path.join(shard_dir, f"rank{rank}.pt"), weights_only=True)
        fresh_net = _net(seed=4)
        fresh_net.shift.fill_(7.0)
        fresh = FSDP(fresh_net, stage=stage, auto_wrap={nn.Linear})
        fresh.load_sharded_state_dict(saved["model"])
        fresh_opt = _adamw(fresh.parameters())
        fresh_opt.load_state_dict(copy.deepcopy(saved["optim"]))
        for s in range(3, 6):
            for m, o in ((model, opt), (again, again_opt), (fresh, fresh_opt)):
                _step(m, o, s)
        keys = list(oracle.module.state_dict())
        ours = _gathered(model, keys)
        r["full_resume_bitwise"] = all(
            torch.equal(ours[k], v) for k, v in _gathered(again, keys).items()
        ) and all(
            torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
        )
        r["sharded_resume_bitwise"] = all(
            torch.equal(ours[k], v) for k, v in _gathered(fresh, keys).items()
        ) and all(
            torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
        )
        # refusals
        other = torch.load(os.path.join(shard_dir, f"rank{1 - rank}.pt"), weights_only=True)
        r["other_rank"] = _refused(fresh.load_sharded_state_dict, other["model"])
        rewrapped = FSDP(_net(), stage=stage, auto_wrap=None)
        r["other_wrap"] = _refused(rewrapped.load_sharded_state_dict, saved["model"])
        r["plain_as_sharded"] = _refused(fresh.load_sharded_state_dict, _net().state_dict())
        plain_state = _net().state_dict()
        missing = {k: v for k, v in plain_state.items() if k != "inp.bias"}
        r["missing"] = _refused(fresh.load_full_state_dict, missing)
        r["unexpected"] = _refused(
            fresh.load_full_state_dict, {**plain_state, "extra.weight": torch.ones(1)}
        )
        r["shape"] = _refused(
            fresh.load_full_state_dict, {**plain_state, "inp.bias": torch.ones(4)}
        )
        # the refusals left the model as it was
        r["unchanged_by_refusals"] = all(
            torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
        )
        out[stage] = r
    return out


def _resume_at_four(tmp: str) -> dict:
    """World size 4: the state saved at world size 2 resumes like DDP resumed from it."""
    rank = dist.get_rank()
    out: dict = {}
    for stage in (2, 3):
        saved = torch.load(os.path.join(tmp, f"full{stage}.pt"), weights_only=True)
        model = FSDP(_net(seed=2), stage=stage, auto_wrap={nn.Linear})
        opt = _adamw(model.parameters())
        model.load_full_state_dict(copy.deepcopy(saved["model"]))
        model.load_full_optim_state_dict(opt, copy.deepcopy(saved["optim"]))
        oracle = tandem.DDP(_net(seed=2))
        oracle.module.load_state_dict(copy.deepcopy(saved["model"]))
        ref = _adamw(oracle.parameters())
        ref.load_state_dict(copy.deepcopy(saved["optim"]))
        roundtrip = model.full_state_dict()
        for s in range(3, 6):
            _step(model, opt, s)
            _step(oracle, ref, s)
        expected = oracle.module.state_dict()
        old = torch.load(
            os.path.join(tmp, f"sharded{stage}", f"rank{rank % 2}.pt"), weights_only=True
        )
        out[stage] = {
            "roundtrip_bitwise": None
            if roundtrip is None
            else list(roundtrip) == list(saved["model"])
            and all(torch.equal(roundtrip[k], v) for k, v in saved["model"].items()),
            **_compare(model, expected),
            "other_world_size": _refused(model.load_sharded_state_dict, old["model"]),
        }
    return out


def test_state_dicts(tmp_path):
    tmp = str(tmp_path)
    saved = run_ranks(_save_and_reload, 2, args=(tmp,), timeout=90)
    for rank, per_stage in enumerate(saved):
        for stage, r in per_stage.items():
            context = f"rank {rank}, stage {stage}: {r}"
            assert r["none_elsewhere"], context
            if rank == 0:
                assert r["keys"] and r["diff"] <= TOL and r["plain_diff"] <= TOL, context
                assert _optim_ok(r["optim"]), context
                assert r["plain_optim_loaded"], context
            else:
                assert r["optim_none"], context
            assert r["full_resume_bitwise"] and r["sharded_resume_bitwise"], context
            for refusal in ("other_rank", "other_wrap"):
                assert r[refusal] is not None and "full state dict" in r[refusal], context
            assert r["plain_as_sharded"] is not None, context
            assert "load_full_state_dict" in r["plain_as_sharded"], context
            assert r["missing"] is not None and "inp.bias" in r["missing"], context
            assert r["unexpected"] is not None and "extra.weight" in r["unexpected"], context
            assert r["shape"] is not None and "inp.bias" in r["shape"], context
            assert r["unchanged_by_refusals"], context

    resumed = run_ranks(_resume_at_four, 4, args=(tmp,), timeout=90)
    for rank, per_stage in enumerate(resumed):
        for stage, r in per_stage.items():
            context = f"rank {rank} of 4, stage {stage}: {r}"
            assert r["roundtrip_bitwise"] is (True if rank == 0 else None), context
            assert r["diff"] <= TOL and r["same_everywhere"], context
            message = r["other_world_size"]
            assert message is not None and "full state dict" in message, context
            assert "of 2" in message and "of 4" in message, context


# -- 8: bad input ---------------------------------------------------------------------------------


def _bad_inputs() -> dict:
    rank = dist.get_rank()
    out = {}
    shape = nn.Sequential(nn.Linear(4, 3 if rank == 0 else 2))
    out["shape"] = _refused(FSDP, shape)
    count = nn.Sequential(nn.Linear(4, 3), *([nn.Linear(3, 2)] if rank == 1 else []))
    out["count"] = _refused(FSDP, count)
    mixed = seeded(TwoDtypes)
    out["mixed"] = _refused(functools.partial(FSDP, auto_wrap=None), mixed)
    # and the ranks still work together afterwards
    model = FSDP(_net(), auto_wrap={nn.Linear})
    _step(model, _adamw(model.parameters()), 0)
    out["after"] = _same_everywhere(_gathered(model, ["inp.weight"]).values())
    return out


def test_bad_input_raises_on_every_rank():
    results = run_ranks(_bad_inputs, 2, timeout=30)
    for rank, r in enumerate(results):
        assert r["shape"] is not None and "'0.weight'" in r["shape"], (rank, r)
        assert "differs across ranks" in r["shape"], (rank, r)
        assert r["count"] is not None and "'1.weight'" in r["count"], (rank, r)
        mixed = r["mixed"]
        assert mixed is not None and "dtype" in mixed, (rank, r)
        assert "inp.weight" in mixed and "block.weight" in mixed and "torch.float64" in mixed, r
        assert r["after"], (rank, r)
