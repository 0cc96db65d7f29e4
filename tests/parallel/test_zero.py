"""ShardedOptimizer (ZeRO-1) takes exactly the steps of the plain optimizer, with sharded state.

Oracles, none of them the code's own owner formula:

- Adam, end to end: ShardedOptimizer(Adam) under tandem.DDP on 2 and 4 ranks ends, after 6
  steps, with parameters bitwise equal to a plain ``torch.optim.Adam`` run in this (one) process
  on the full batch, and to torch's own ``ZeroRedundancyOptimizer(Adam)`` on the same ranks.
  The model and data make the gradients exact (integer data, power-of-two batches, a loss
  linear in the outputs), so any difference comes from the optimizer, not from rounding.
- Ownership, from what the ranks hold: the parameters with optimizer state partition all
  parameters (each in exactly one rank's state, none missing), a rank's inner optimizer holds
  exactly the parameters it has state for, and each owned parameter's state is as large as the
  plain optimizer's for it (nothing extra, nothing for parameters owned elsewhere); the owner
  lists agree on every rank and across rebuilds; the bytes owned per rank differ by at most the
  largest parameter (the documented bound) and the heaviest rank is within the largest-first
  greedy's 4/3 guarantee of the brute-force optimum; owners are unchanged when every parameter
  is float64 instead of float32 (bytes doubled: the documented rule only compares sizes).
- Side by side with tandem.DDP and the plain torch optimizer in the same ranks (a model whose
  parameter count no world size here divides): after 5 steps with SGD (momentum, weight decay)
  and with AdamW, at world sizes 2 and 4, the parameters equal the oracle's bitwise (the same
  gradients meet the same per-parameter arithmetic) and are identical on every rank; the
  ranks' state bytes sum to the plain optimizer's, and differ by at most one parameter's state;
- ``full_state_dict`` on rank 0 equals the plain optimizer's ``state_dict()`` and loads into it;
  ``load_full_state_dict`` of the plain optimizer's state resumes to the oracle's next step;
  a shard saved by another rank is refused with ValueError;
- two param groups (their own lr), float32 and float64 parameters, 4 ranks for 3 parameters (a
  rank owning nothing still joins every broadcast): the plain optimizer's steps, bitwise;
- one process without a process group: the inner optimizer covers every parameter and steps like
  the plain one bitwise, with an LR scheduler on the outer optimizer.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import tandem
from tandem.parallel.zero import ShardedOptimizer
from tests.harness import run_ranks

STEPS = 5
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 35 + 5 + 25 + 5 + 15 + 3 = 88 elements in 6 parameters: neither divides by 4 evenly.
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, ws: int) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * ws, 7, generator=g), torch.randn(4 * ws, 3, generator=g)
        mine = slice(4 * rank, 4 * rank + 4)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()


def _state_bytes(state: dict) -> int:
    return sum(
        t.numel() * t.element_size()
        for s in state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    diffs = [0.0]
    for i in a:
        assert a[i].keys() == b[i].keys()
        for k in a[i]:
            diffs.append((torch.as_tensor(a[i][k]) - torch.as_tensor(b[i][k])).abs().max().item())
    return max(diffs)


def _parity(name: str) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    cls, kwargs = OPTIMIZERS[name]
    plain_model, zero_model = tandem.DDP(_model()), tandem.DDP(_model())
    plain = cls(plain_model.parameters(), **kwargs)
    zero = ShardedOptimizer(zero_model.parameters(), cls, **kwargs)
    _train(plain_model, plain, range(STEPS), rank, ws)
    _train(zero_model, zero, range(STEPS), rank, ws)

    params = list(zero_model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    everyone = [torch.empty_like(flat) for _ in range(ws)]
    dist.all_gather(everyone, flat)
    diff = max(
        (p - q).abs().max().item() for p, q in zip(params, plain_model.parameters(), strict=True)
    )

    full = zero.full_state_dict(to=0)
    full_diff = None
    if rank == 0:
        reference = plain.state_dict()
        assert full["param_groups"] == reference["param_groups"]
        full_diff = _max_diff(full["state"], reference["state"])
        cls(_model().parameters(), **kwargs).load_state_dict(full)

    # Resume from the plain optimizer's state into a fresh ShardedOptimizer: same next step.
    resumed = ShardedOptimizer(zero_model.parameters(), cls, **kwargs)
    # A deep copy: torch's load_state_dict keeps the very tensors it is given, which the plain
    # optimizer's next step would otherwise update for both.
    resumed.load_full_state_dict(copy.deepcopy(plain.state_dict()))
    with torch.no_grad():
        for p, q in zip(zero_model.parameters(), plain_model.parameters(), strict=True):
            p.copy_(q)
    _train(plain_model, plain, range(STEPS, STEPS + 1), rank, ws)
    _train(zero_model, resumed, range(STEPS, STEPS + 1), rank, ws)
    resume_diff = max(
        (p - q).abs().max().item()
        for p, q in zip(zero_model.parameters(), plain_model.parameters(), strict=True)
    )

    shard = zero.state_dict()
    try:
        zero.load_state_dict({**shard, "rank": (rank + 1) % ws})
        refused = False
    except ValueError:
        refused = True
    zero.load_state_dict(shard)

    # Ownership as the ranks hold it: which parameters have state here, and how much.
    index = {id(p): i for i, p in enumerate(params)}
    double = ShardedOptimizer(_model().double().parameters(), cls, **kwargs)
    return {
        "diff": diff,
        "same_everywhere": all(torch.equal(flat, other) for other in everyone),
        "owners": list(zero.owners),
        "rebuilt_owners": list(resumed.owners),
        "float64_owners": list(double.owners),
        "state_bytes": {
            index[id(p)]: _state_bytes({0: s}) for p, s in zero.optimizer.state.items()
        },
        "inner_params": sorted(
            index[id(p)] for g in zero.optimizer.param_groups for p in g["params"]
        ),
        "plain_state_bytes": [_state_bytes({0: plain.state[p]}) for p in plain_model.parameters()],
        "param_bytes": [p.numel() * p.element_size() for p in params],
        "bytes": zero.inner_state_bytes,
        "plain_bytes": _state_bytes(plain.state),
        "largest_param_state": max(_state_bytes({0: s}) for s in plain.state.values()),
        "full_diff": full_diff,
        "resume_diff": resume_diff,
        "refused_other_shard": refused,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_matches_plain_optimizer_with_sharded_state(world_size):
    for name in OPTIMIZERS:
        results = run_ranks(_parity, world_size, args=(name,), timeout=60)
        for rank, r in enumerate(results):
            context = f"{name}, rank {rank} of {world_size}: {r}"
            assert r["diff"] == 0.0, context
            assert r["resume_diff"] == 0.0, context
            assert r["same_everywhere"], context
            assert r["refused_other_shard"], context
        assert results[0]["full_diff"] == 0.0, results[0]
        _check_ownership(results, name)
        per_rank = [r["bytes"] for r in results]
        assert sum(per_rank) == results[0]["plain_bytes"], per_rank
        assert max(per_rank) - min(per_rank) <= results[0]["largest_param_state"], per_rank


def _check_ownership(results: list[dict], name: str) -> None:
    """Ownership from what the ranks hold, against independent properties (module docstring)."""
    ws = len(results)
    owners = results[0]["owners"]
    sizes = results[0]["param_bytes"]
    n = len(sizes)
    held = [sorted(r["state_bytes"]) for r in results]
    context = f"{name}, world size {ws}: owners {owners}, state held {held}"
    # Every parameter's state lives on exactly one rank.
    assert sorted(i for h in held for i in h) == list(range(n)), context
    for rank, r in enumerate(results):
        # The same owners everywhere, and again when the optimizer is rebuilt.
        assert r["owners"] == owners and r["rebuilt_owners"] == owners, context
        # Bytes doubled (float64) change no owner.
        assert r["float64_owners"] == owners, context
        # A rank holds state for, and steps, exactly the parameters the owners name for it.
        assert held[rank] == [i for i in range(n) if owners[i] == rank], context
        assert r["inner_params"] == held[rank], context
        # Each owned parameter's state is the plain optimizer's size for it, nothing more.
        for i, nbytes in r["state_bytes"].items():
            assert nbytes == r["plain_state_bytes"][i] > 0, (context, i)
    loads = [sum(sizes[i] for i in h) for h in held]
    assert max(loads) - min(loads) <= max(sizes), (context, loads)
    best = min(
        max(sum(sizes[i] for i in range(n) if a[i] == r) for r in range(ws))
        for a in itertools.product(range(ws), repeat=n)
    )
    assert best >= max(max(sizes), -(-sum(sizes) // ws))  # independent lower bound
    assert 3 * ws * max(loads) <= (4 * ws - 1) * best, (context, loads, best)


ADAM = {"lr": 0.01, "betas": (0.8, 0.99), "weight_decay": 0.01}
ADAM_STEPS = 6
FULL_BATCH = 16  # divides by every world size here, a power of two: exact means


class _Heads(nn.Module):
    """Linear heads of several sizes (8 parameters); with a loss linear in the outputs the gradient
    is ``targets^T inputs / batch``, independent of the parameters and exact in float32 for
    small integer data, so the one-process and the sharded runs see bitwise the same gradients
    at every step and any difference in the parameters is the optimizer's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.heads = nn.ModuleList(nn.Linear(6, k) for k in (5, 3, 1, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(h(x) for h in self.heads)


def _heads_loss(outputs: tuple[torch.Tensor, ...], targets: list[torch.Tensor]) -> torch.Tensor:
    total = sum((out * t).sum() for out, t in zip(outputs, targets, strict=True))
    return total / targets[0].shape[0]


def _heads_batch(step: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(-3, 4, (FULL_BATCH, 6), generator=g).float()
    targets = [torch.randint(-3, 4, (FULL_BATCH, k), generator=g).float() for k in (5, 3, 1, 4)]
    return x, targets


def _adam_on_ranks() -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    ours, theirs = tandem.DDP(_Heads()), tandem.DDP(_Heads())
    zero = ShardedOptimizer(ours.parameters(), torch.optim.Adam, **ADAM)
    torch_zero = ZeroRedundancyOptimizer(theirs.parameters(), torch.optim.Adam, **ADAM)
    mine = slice(rank * FULL_BATCH // ws, (rank + 1) * FULL_BATCH // ws)
    for step in range(ADAM_STEPS):
        x, targets = _heads_batch(step)
        for model, opt in ((ours, zero), (theirs, torch_zero)):
            opt.zero_grad()
            _heads_loss(model(x[mine]), [t[mine] for t in targets]).backward()
            opt.step()
    params = list(ours.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    return {
        "ours": [p.detach().clone() for p in params],
        "torch_zero": [p.detach().clone() for p in theirs.parameters()],
        "owners": list(zero.owners),
        # the state tensors this rank holds, by parameter index
        "state": {
            index[id(p)]: sorted(k for k, v in s.items() if isinstance(v, torch.Tensor))
            for p, s in zero.optimizer.state.items()
        },
        "bytes": zero.inner_state_bytes,
    }


def _adam_one_process() -> tuple[list[torch.Tensor], list[int]]:
    model = _Heads()
    opt = torch.optim.Adam(model.parameters(), **ADAM)
    for step in range(ADAM_STEPS):
        x, targets = _heads_batch(step)
        opt.zero_grad()
        _heads_loss(model(x), targets).backward()
        opt.step()
    per_param = [_state_bytes({0: opt.state[p]}) for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()], per_param


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_adam_bitwise_equals_one_process_on_the_full_batch_and_torch_zero(world_size):
    assert not dist.is_initialized()
    expected, state_bytes = _adam_one_process()
    results = run_ranks(_adam_on_ranks, world_size, timeout=60)
    held = [sorted(r["state"]) for r in results]
    assert sorted(i for h in held for i in h) == list(range(len(expected))), held
    for rank, r in enumerate(results):
        for i, (ours, theirs, plain) in enumerate(
            zip(r["ours"], r["torch_zero"], expected, strict=True)
        ):
            assert torch.equal(ours, plain), (rank, i, (ours - plain).abs().max().item())
            assert torch.equal(theirs, plain), (rank, i, "torch's ZeroRedundancyOptimizer")
        # State (both moments and the step) for the owned parameters only, their full size.
        assert held[rank] == [i for i, o in enumerate(r["owners"]) if o == rank], (rank, held)
        assert all(k == ["exp_avg", "exp_avg_sq", "step"] for k in r["state"].values()), r
        assert r["bytes"] == sum(state_bytes[i] for i in held[rank]) < sum(state_bytes), rank


def _single_process_run(sharded: bool) -> list[torch.Tensor]:
    model = _model()
    cls, kwargs = OPTIMIZERS["adamw"]
    opt = (
        ShardedOptimizer(model.parameters(), cls, **kwargs)
        if sharded
        else cls(model.parameters(), **kwargs)
    )
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(STEPS):
        _train(model, opt, range(step, step + 1), rank=0, ws=1)
        scheduler.step()
    if sharded:
        assert len(opt.optimizer.state) == len(list(model.parameters()))
        assert opt.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    return [p.detach().clone() for p in model.parameters()]


def test_one_process_without_a_group_is_the_plain_optimizer():
    assert not dist.is_initialized()
    for a, b in zip(_single_process_run(True), _single_process_run(False), strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def _groups_and_dtypes() -> list[list[float]]:
    """Two param groups, float32 and float64, fewer parameters than ranks; same grads everywhere."""

    def params() -> list[torch.Tensor]:
        torch.manual_seed(1)
        return [
            torch.randn(10, requires_grad=True),
            torch.randn(3, dtype=torch.float64, requires_grad=True),
            torch.randn(1, requires_grad=True),
        ]

    ours, theirs = params(), params()

    def groups(ps: list[torch.Tensor]) -> list[dict]:
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.5}]

    zero = ShardedOptimizer(groups(ours), torch.optim.SGD, lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(groups(theirs), lr=0.1, momentum=0.9)
    for step in range(3):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.full_like(p, float(step + 1))
            q.grad = p.grad.clone()
        zero.step()
        plain.step()
    assert zero.param_groups[1]["lr"] == 0.5 and len(zero.param_groups[0]["params"]) == 2
    return [(p - q).abs().max().item() for p, q in zip(ours, theirs, strict=True)]


@pytest.mark.distributed
def test_param_groups_mixed_dtypes_and_ranks_owning_nothing():
    for rank, diffs in enumerate(run_ranks(_groups_and_dtypes, 4, timeout=60)):
        assert max(diffs) == 0.0, (rank, diffs)
