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
- observability: under torch's profiler, two steps record one closed ``tandem.fsdp.forward``
  range per unit forward and one ``tandem.fsdp.reduce_scatter`` per unit backward, one
  ``finish_backward`` per backward, the all-gathers, and at stage 3 the prefetches; the
  ``tandem.fsdp`` logger at debug level tells the prefetches, the frees after forward and the
  reshards after backward (stage 2: only prefetches), each naming its rank and unit; and
  training under both is still DDP's;
- bad input: a model that differs across ranks raises a ValueError naming the parameter on
  every rank (no hang); one unit with two dtypes raises naming the parameters, on every rank.
"""

from __future__ import annotations

import functools
import logging
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.harness import run_ranks
from tests.parallel.fsdp.models import (
    FSDP,
    MLP,
    OPTIMIZERS,
    PER_RANK,
    TOL,
    adamw,
    batch,
    compare,
    diff,
    gathered_tensors,
    make_net,
    mse,
    optim_match,
    optim_ok,
    params,
    refused,
    same_everywhere,
    seeded,
    side_by_side,
    train,
    train_step,
)

pytestmark = pytest.mark.distributed

STEPS = 5
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


def _tokens(step: int, rank: int, ws: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 11, (PER_RANK * ws, 5), generator=g)
    y = torch.randint(0, 11, (PER_RANK * ws, 5), generator=g)
    mine = slice(PER_RANK * rank, PER_RANK * (rank + 1))
    return x[mine], y[mine]


def _cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, 11), y.reshape(-1))


# -- reading results ------------------------------------------------------------------------------


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
                model, opt, oracle, ref = side_by_side(make_net, name, stage, auto_wrap)
                # units gathered while each Linear runs (hooks run after the wrapper's gather)
                during: list[int] = []
                for linear in (model.module.inp, model.module.block[0]):
                    linear.register_forward_pre_hook(
                        lambda *_, d=during, m=model: d.append(sum(u.is_gathered for u in m.units))
                    )
                losses = train(model, opt, oracle, ref, STEPS)
                expected = oracle.module.state_dict()
                plain_params = dict(oracle.module.named_parameters())
                layout = _layout(model, {k: v.detach() for k, v in plain_params.items()})
                compared = compare(model, expected)
                full = model.full_state_dict()
                results.append(
                    {
                        "config": (stage, wrap, name),
                        "loss_diff": max(abs(a - b) for a, b in losses),
                        **compared,
                        "full_keys_match": None if full is None else list(full) == list(expected),
                        "full_diff": None if full is None else diff(full, expected),
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
        model, opt, oracle, ref = side_by_side(make, c["optimizer"], c["stage"], auto_wrap)
        data = functools.partial(batch, din=c["widths"][0], dout=c["widths"][-1])
        train(model, opt, oracle, ref, 3, data=data)
        result = compare(model, params(oracle.module))
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
    model = FSDP(make_net(), stage=stage, auto_wrap={nn.Linear})
    for m in (0, 1):
        mse(model, *batch(0, rank, ws, micro=m)).backward()
    plain = make_net()
    for r in range(ws):
        for m in (0, 1):
            mse(plain, *batch(0, r, ws, micro=m)).backward()
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
    model, opt, oracle, ref = side_by_side(make_net, "adamw", stage, {nn.Linear})
    eval_diffs, gathered_after = [], []
    for step in range(3):
        x, y = batch(step, rank, ws)
        x_eval = batch(100 + step, rank, ws)[0]
        if variant == "dangling":
            model(x_eval)  # grad mode, no backward
        opt.zero_grad()
        ref.zero_grad()
        if variant == "accumulate":
            for m in (0, 1):
                mse(model, *batch(step, rank, ws, micro=m)).backward()
            with oracle.no_sync():
                mse(oracle, *batch(step, rank, ws, micro=0)).backward()
            mse(oracle, *batch(step, rank, ws, micro=1)).backward()
        elif variant == "interleaved":
            loss = mse(model, x, y)
            with torch.no_grad():
                eval_diffs.append((model(x_eval) - oracle.module(x_eval)).abs().max().item())
            loss.backward()
            mse(oracle, x, y).backward()
        else:
            mse(model, x, y).backward()
            mse(oracle, x, y).backward()
        opt.step()
        ref.step()
        if variant == "eval":
            with torch.no_grad():
                eval_diffs.append((model(x_eval) - oracle.module(x_eval)).abs().max().item())
        gathered_after.append([u.is_gathered for u in model.units])
    return {
        **compare(model, params(oracle.module)),
        "eval_diff": max(eval_diffs, default=0.0),
        "gathered_after": gathered_after,
    }


def _frozen(stage: int, wrap: str) -> dict:
    """inp.weight frozen; rank 1 starts from other values (rank 0's must win)."""
    rank = dist.get_rank()

    def make() -> nn.Module:
        net = make_net()
        net.inp.weight.requires_grad_(False)
        if rank == 1:
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(1.0)
        return net

    initial = make_net().inp.weight.detach().clone()  # rank 0's value
    model, opt, oracle, ref = side_by_side(make, "adamw", stage, WRAPS[wrap])
    train(model, opt, oracle, ref, 3)
    expected = oracle.module.state_dict()
    compared = compare(model, expected)
    frozen = model.module.inp.weight
    full = model.full_state_dict()
    full_optim = model.full_optim_state_dict(opt)
    return {
        "optim": None if full_optim is None else optim_match(full_optim, ref.state_dict()),
        **compared,
        "frozen_unchanged": torch.equal(frozen, initial),
        "frozen_is_parameter": isinstance(frozen, nn.Parameter) and not frozen.requires_grad,
        "module_params": [n for n, _ in model.module.named_parameters()],
        "frozen_everywhere": same_everywhere([frozen]),
        "full_diff": None if full is None else diff(full, expected),
    }


def _tied(stage: int) -> dict:
    make = functools.partial(seeded, Tied)
    model, opt, oracle, ref = side_by_side(make, "adamw", stage, {nn.Linear})
    train(model, opt, oracle, ref, 3, data=_tokens, loss=_cross_entropy)
    expected = oracle.module.state_dict()
    compared = compare(model, expected)
    with model.gathered(writeback=False) as net:
        one_tensor = net.head.weight is net.embed.weight
    root = next(u for u in model.units if "embed.weight" in [e.fqn for e in u.entries])
    full = model.full_state_dict()
    full_optim = model.full_optim_state_dict(opt)
    return {
        "optim": None if full_optim is None else optim_match(full_optim, ref.state_dict()),
        **compared,
        "one_tensor": one_tensor,
        "unit_fqns": [[e.fqn for e in u.entries] for u in model.units],
        "root_locations": [name for e in root.entries for _, name in e.locations],
        "full_diff": None if full is None else diff(full, expected),
    }


def _reuse(stage: int) -> dict:
    make = functools.partial(seeded, Reuse)
    predicate = lambda m: isinstance(m, nn.Linear)  # noqa: E731
    model, opt, oracle, ref = side_by_side(make, "sgd", stage, predicate)
    train(model, opt, oracle, ref, 3)
    return {**compare(model, params(oracle.module)), "units": len(model.units)}


def _two_dtypes(stage: int) -> dict:
    make = functools.partial(seeded, TwoDtypes)
    model, opt, oracle, ref = side_by_side(make, "adamw", stage, {nn.Linear})
    train(model, opt, oracle, ref, 3)
    expected = params(oracle.module)
    return {
        "diff": diff(gathered_tensors(model, expected), expected),
        "dtypes": sorted(str(u.shard.dtype) for u in model.units),
    }


def _clip(stage: int, norm_type: float) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    model, opt, oracle, ref = side_by_side(make_net, "sgd", stage, {nn.Linear})
    norms = []
    for s in range(3):
        x, y = batch(s, rank, ws)
        opt.zero_grad()
        ref.zero_grad()
        mse(model, x, y).backward()
        mse(oracle, x, y).backward()
        ours = model.clip_grad_norm_(0.05, norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 0.05, norm_type)
        norms.append((ours.item(), theirs.item()))
        opt.step()
        ref.step()
    return {"norms": norms, **compare(model, params(oracle.module))}


def _observed(stage: int) -> dict:
    """Two steps under torch's profiler, with the tandem.fsdp logger at debug level."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("tandem.fsdp")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        model, opt, oracle, ref = side_by_side(make_net, "adamw", stage, {nn.Linear})
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            train(model, opt, oracle, ref, 2)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("tandem.fsdp."):
            counts[event.name] = counts.get(event.name, 0) + 1
    return {
        "ranges": counts,
        "messages": [r.getMessage() for r in records],
        **compare(model, params(oracle.module)),
    }


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
        out[("observed", stage)] = _observed(stage)
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
            assert result["full_diff"] <= TOL and optim_ok(result["optim"]), result


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
            assert result["full_diff"] <= TOL and optim_ok(result["optim"]), result


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


@pytest.mark.parametrize("stage", [2, 3])
def test_phases_are_profiled_and_decisions_logged(behaviours, stage):
    units, steps = 3, 2  # inp, block.0 and the root; two training steps
    for rank, r in enumerate(behaviours):
        result = r[("observed", stage)]
        ranges, messages = result["ranges"], result["messages"]
        context = (rank, ranges, messages)
        assert result["diff"] <= TOL, (rank, result)  # observing changed nothing
        # one forward range per unit and step, each closed (the profiler keeps closed ones)
        assert ranges.get("tandem.fsdp.forward") == units * steps, context
        assert ranges.get("tandem.fsdp.reduce_scatter") == units * steps, context
        assert ranges.get("tandem.fsdp.finish_backward") == steps, context
        assert ranges.get("tandem.fsdp.reduce_scatter_wait", 0) >= 1, context
        assert ranges.get("tandem.fsdp.all_gather", 0) >= units * steps, context
        if stage == 3:
            # from the second forward on, the next unit is prefetched
            assert ranges.get("tandem.fsdp.all_gather_start", 0) >= 1, context
            assert any("prefetched for the forward" in m for m in messages), context
            assert any("resharded after its backward" in m for m in messages), context
            assert any("freed (after its forward)" in m for m in messages), context
            assert all(m.startswith(f"rank {rank}, unit #") for m in messages), context
        else:  # stage 2 frees nothing; a stepped unit is still gathered ahead of its use
            assert messages and all("prefetched for the forward" in m for m in messages), context


# -- 7: bad input ---------------------------------------------------------------------------------


def _bad_inputs() -> dict:
    rank = dist.get_rank()
    out = {}
    shape = nn.Sequential(nn.Linear(4, 3 if rank == 0 else 2))
    out["shape"] = refused(FSDP, shape)
    count = nn.Sequential(nn.Linear(4, 3), *([nn.Linear(3, 2)] if rank == 1 else []))
    out["count"] = refused(FSDP, count)
    mixed = seeded(TwoDtypes)
    out["mixed"] = refused(functools.partial(FSDP, auto_wrap=None), mixed)
    # and the ranks still work together afterwards
    model = FSDP(make_net(), auto_wrap={nn.Linear})
    train_step(model, adamw(model.parameters()), 0)
    out["after"] = same_everywhere(gathered_tensors(model, ["inp.weight"]).values())
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
