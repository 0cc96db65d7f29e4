"""ShardedOptimizer (ZeRO-1) takes exactly the steps of the plain optimizer, with sharded state.

The oracle is tandem.DDP with the plain torch optimizer, run side by side in the same ranks on
the same data (a model whose parameter count no world size here divides):

- after 5 steps with SGD (momentum, weight decay) and with AdamW, at world sizes 2 and 4, the
  parameters equal the oracle's within 1e-6 (float32) and are identical on every rank;
- optimizer state exists only for the parameters a rank owns (the owners of
  ``assign_owners``): the ranks' state bytes sum to the plain optimizer's, and differ by at most
  one parameter's state;
- ``full_state_dict`` on rank 0 equals the plain optimizer's ``state_dict()`` and loads into it;
  ``load_full_state_dict`` of the plain optimizer's state resumes to the oracle's next step;
  a shard saved by another rank is refused with ValueError;
- two param groups (their own lr), float32 and float64 parameters, 4 ranks for 3 parameters (a
  rank owning nothing still joins every broadcast): the plain optimizer's steps;
- one process without a process group: the inner optimizer covers every parameter and steps like
  the plain one, with an LR scheduler on the outer optimizer.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tandem
from tandem.parallel.sharding import assign_owners, owned_indices
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
    owners = assign_owners([p.numel() * p.element_size() for p in params], ws)
    owned = {id(params[i]) for i in owned_indices(owners, rank)}
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

    return {
        "diff": diff,
        "same_everywhere": all(torch.equal(flat, other) for other in everyone),
        "state_is_owned": {id(p) for p in zero.optimizer.state} == owned,
        "state_count": len(zero.optimizer.state),
        "owned_count": len(owned),
        "bytes": zero.inner_state_bytes,
        "plain_bytes": _state_bytes(plain.state),
        "largest_param_state": max(_state_bytes({0: s}) for s in plain.state.values()),
        "full_diff": full_diff,
        "resume_diff": resume_diff,
        "refused_other_shard": refused,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_matches_plain_optimizer_with_sharded_state(world_size):
    for name in OPTIMIZERS:
        results = run_ranks(_parity, world_size, args=(name,), timeout=60)
        for rank, r in enumerate(results):
            context = f"{name}, rank {rank} of {world_size}: {r}"
            assert r["diff"] <= 1e-6, context
            assert r["resume_diff"] <= 1e-6, context
            assert r["same_everywhere"], context
            assert r["state_is_owned"] and r["state_count"] == r["owned_count"], context
            assert r["refused_other_shard"], context
        assert results[0]["full_diff"] == 0.0, results[0]
        per_rank = [r["bytes"] for r in results]
        assert sum(per_rank) == results[0]["plain_bytes"], per_rank
        assert max(per_rank) - min(per_rank) <= results[0]["largest_param_state"], per_rank


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
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


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


def test_param_groups_mixed_dtypes_and_ranks_owning_nothing():
    for rank, diffs in enumerate(run_ranks(_groups_and_dtypes, 4, timeout=60)):
        assert max(diffs) <= 1e-7, (rank, diffs)
