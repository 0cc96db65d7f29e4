"""tandem.DDP's guarantees beyond parity: errors on every rank, unused parameters, buckets.

- Models that differ across ranks: a ValueError naming the parameter, shapes and ranks, raised on
  every rank within seconds (the harness timeout turns a hang into a failure).
- A parameter with no gradient and no find_unused_parameters: an error naming it and the flag,
  on every rank, also when only one rank missed it (where torch's DDP hangs).
- The mean: after backward every rank's ``.grad`` equals, bitwise, the mean of the gradients each
  rank computes independently with a plain copy of the model on its own batch (all-gathered),
  and, on a network whose arithmetic is exact (integer weights and data, power-of-two batches),
  the gradient of one process on the full batch, at 2 and 4 ranks.
- find_unused_parameters: a parameter unused on every rank keeps ``.grad`` None; one unused on a
  single rank gets the mean in which that rank counts zero (bitwise, against the plain copies).
- Buckets: one until the first backward, then rebuilt once in the order gradients became
  ready (the same on every rank); launched during backward, before the last gradient exists.
- Construction broadcasts rank 0's parameters; sync_params_and_buffers re-broadcasts rank 0's
  parameters and buffers (compared with a model built with rank 0's seed); broadcast_coalesced
  delivers rank 0's tensors bitwise, every dtype and shape.
- Communication hooks: a user's hook; tandem's hook inside torch's DDP.
- One process without a process group: the same code path, identical to the plain module.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.parallel.ddp.comm_hooks import allreduce_hook
from tandem.parallel.ddp.end_of_backward import UnusedParametersError
from tandem.parallel.replicas import broadcast_coalesced
from tests import models
from tests.harness import run_ranks


def _differing_models(kind: str) -> str:
    rank = dist.get_rank()
    if kind == "shape":
        net = nn.Sequential(nn.Linear(10, 4 if rank == 0 else 5), nn.ReLU())
    else:  # one rank has an extra layer
        layers = [nn.Linear(10, 4)] + ([nn.Linear(4, 2)] if rank == 1 else [])
        net = nn.Sequential(*layers)
    with pytest.raises(ValueError) as info:
        tandem.DDP(net)
    return str(info.value)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["shape", "count"])
def test_models_that_differ_raise_on_every_rank(kind):
    messages = run_ranks(_differing_models, 2, args=(kind,), timeout=30)
    for message in messages:
        assert "differs across ranks" in message
        if kind == "shape":
            assert "'0.weight'" in message
            assert "rank 0 has '0.weight' of shape (4, 10)" in message
            assert "rank 1 has '0.weight' of shape (5, 10)" in message
        else:
            assert "'1.weight'" in message and "rank 0 has no such parameter" in message
            assert "rank 0: 2, rank 1: 4" in message


def _missing_gradient(only_rank0: bool) -> str:
    rank = dist.get_rank()
    model = tandem.DDP(models.branchy())
    use = "left" if (rank == 0 or not only_rank0) else "both"
    x, y = models.batch(0, rank, 4, (10,))
    with pytest.raises(UnusedParametersError) as info:
        F.cross_entropy(model(x, use=use), y).backward()
    return str(info.value)


@pytest.mark.distributed
@pytest.mark.parametrize("only_rank0", [False, True], ids=["all-ranks", "one-rank"])
def test_missing_gradient_without_flag_raises_on_every_rank(only_rank0):
    messages = run_ranks(_missing_gradient, 2, args=(only_rank0,), timeout=30)
    for message in messages:
        assert "find_unused_parameters=True" in message
        assert "rank 0: " in message and "right.weight" in message and "never.weight" in message
        # rank 1 used 'right' in the one-rank case, so only 'never' is listed for it
        rank1_line = next(line for line in message.splitlines() if "rank 1:" in line)
        assert ("right.weight" in rank1_line) is (not only_rank0)


def _integer_net() -> nn.Module:
    """Integer weights, ReLU: on integer data every forward and backward value is exact."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 4)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randint(-2, 3, p.shape))
    return net


FULL_BATCH = 16  # a power of two that every world size here divides: exact means


def _full_batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    if kind == "integer":
        x = torch.randint(-3, 4, (FULL_BATCH, 10), generator=g).double()
        return x, torch.randint(-3, 4, (FULL_BATCH, 4), generator=g).double()
    return torch.randn(FULL_BATCH, 10, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (FULL_BATCH,), generator=g
    )


def _loss(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # mse over batch x 4 outputs: a power-of-two count, so its 1/n is exact
    return F.mse_loss(out, y) if kind == "integer" else F.cross_entropy(out, y)


def _net(kind: str) -> nn.Module:
    return _integer_net() if kind == "integer" else models.mlp()


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t.contiguous())
    return everyone


def _ddp_and_local_grads(kind: str) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    net = _net(kind)
    plain = copy.deepcopy(net)
    model = tandem.DDP(net)
    x, y = _full_batch(kind)
    mine = slice(rank * FULL_BATCH // ws, (rank + 1) * FULL_BATCH // ws)
    # The oracle's input: this rank's own gradient, from a plain copy, no communication.
    _loss(kind, plain(x[mine]), y[mine]).backward()
    _loss(kind, model(x[mine]), y[mine]).backward()
    return {
        "ddp": [p.grad.clone() for p in model.module.parameters()],
        "local": [_gather(p.grad) for p in plain.parameters()],  # [param][rank]
    }


@pytest.mark.distributed
@pytest.mark.parametrize(("kind", "world_size"), [("integer", 2), ("integer", 4), ("mlp", 2)])
def test_grad_is_the_mean_of_the_ranks_local_gradients(kind, world_size):
    results = run_ranks(_ddp_and_local_grads, world_size, args=(kind,), timeout=60)
    # The mean as its definition. Bitwise for 2 ranks (x/2 + y/2 == (x + y)/2 whatever the
    # order of the sum) and for the exact integer network at any world size.
    mean = [torch.stack(per_rank).sum(0) / world_size for per_rank in results[0]["local"]]
    for rank, r in enumerate(results):
        for i, (got, expected) in enumerate(zip(r["ddp"], mean, strict=True)):
            assert torch.equal(got, expected), (kind, rank, i, (got - expected).abs().max())
    # The local gradients did differ across ranks: the mean is not any one rank's gradient.
    assert any(not torch.equal(g[0], g[1]) for g in results[0]["local"])
    if kind == "integer":
        # One process on the full batch, exact here, is the same gradient.
        net = _net(kind)
        x, y = _full_batch(kind)
        _loss(kind, net(x), y).backward()
        for rank, r in enumerate(results):
            for i, (got, p) in enumerate(zip(r["ddp"], net.parameters(), strict=True)):
                assert torch.equal(got, p.grad), (rank, i, (got - p.grad).abs().max())


def _unused_grads() -> dict:
    rank = dist.get_rank()
    use = "left" if rank == 0 else "both"
    plain = models.branchy()
    model = tandem.DDP(models.branchy(), find_unused_parameters=True)
    x, y = models.batch(0, rank, 4, (10,))
    F.cross_entropy(plain(x, use=use), y).backward()
    F.cross_entropy(model(x, use=use), y).backward()
    # Each rank's own gradients (zeros where it computed none), every rank's, per parameter.
    local = {
        n: _gather(torch.zeros_like(p) if p.grad is None else p.grad)
        for n, p in plain.named_parameters()
    }
    return {
        "ddp": {
            n: None if p.grad is None else p.grad.clone()
            for n, p in model.module.named_parameters()
        },
        "had_local": {n: p.grad is not None for n, p in plain.named_parameters()},
        "local": local,
    }


@pytest.mark.distributed
def test_find_unused_parameters_semantics():
    grads = run_ranks(_unused_grads, 2, timeout=30)
    assert grads[0]["had_local"]["right.weight"] is False  # rank 0 ran 'left' only
    assert grads[1]["had_local"]["right.weight"] is True
    for r in grads:
        assert r["ddp"]["never.weight"] is None and r["ddp"]["never.bias"] is None
        for name, per_rank in grads[0]["local"].items():
            if name.startswith("never."):
                continue
            # the mean over both ranks, rank 0 counting zero for 'right' (rank 1's / 2)
            expected = (per_rank[0] + per_rank[1]) / 2
            assert torch.equal(r["ddp"][name], expected), (name, r["ddp"][name], expected)
    assert torch.equal(grads[0]["ddp"]["right.weight"], grads[1]["local"]["right.weight"][1] / 2)
    assert grads[0]["ddp"]["right.weight"].abs().sum() > 0


def _rebuild() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = tandem.DDP(
        models.ShuffledOrder().double(), bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6
    )
    initial = model.reducer.layout
    launch_marks = []

    def spy(state, bucket):
        # how many gradients existed when this bucket was launched
        launch_marks.append(sum(model.reducer.marked))
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, spy)
    for step in range(3):
        launch_marks.clear()
        x, _ = models.batch(step, rank, 4, (10,))
        model(x).sum().backward()
        if step == 0:
            first_order = list(model.reducer.ready_order)
    return {
        "initial": initial,
        "first_order": first_order,
        "rebuilt": model.reducer.layout,
        "launches": list(launch_marks),  # of the last, rebuilt, iteration
        "names": model.reducer.names,
    }


@pytest.mark.distributed
def test_buckets_rebuilt_in_ready_order_and_launched_during_backward():
    results = run_ranks(_rebuild, 2)
    r = results[0]
    # torch's rule: one bucket until the ready order is known
    assert r["initial"] == [[0, 1, 2, 3, 4, 5]]
    assert [b[0] for b in r["rebuilt"]] == r["first_order"]
    assert r["rebuilt"] != r["initial"]  # c was registered last but is used first
    assert results[1]["rebuilt"] == r["rebuilt"]  # every rank agrees
    # the first bucket went out after one gradient, not after all six: overlap with backward
    assert r["launches"][0] < len(r["names"])
    assert r["launches"] == sorted(r["launches"])


def _broadcast_and_resync() -> list[float]:
    rank = dist.get_rank()
    model = tandem.DDP(models.conv_bn(seed=rank))
    after_init = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)  # drift on purpose
        model.module.bn1.running_mean.add_(rank)
    model.sync_params_and_buffers()
    state = torch.cat([t.reshape(-1) for t in model.module.state_dict().values()]).double()
    gathered = [torch.zeros_like(state) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, state)
    init_flat = torch.cat([t.reshape(-1) for t in after_init])
    reference = models.conv_bn(seed=0)  # rank 0's model; rank 0 drifted by + 0
    seed0 = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    seed0_state = torch.cat([t.reshape(-1) for t in reference.state_dict().values()]).double()
    return [
        (gathered[0] - gathered[rank]).abs().max().item(),
        (init_flat - seed0).abs().max().item(),
        (state - seed0_state).abs().max().item(),
    ]


@pytest.mark.distributed
def test_construction_broadcasts_and_sync_params_and_buffers():
    for resync_diff, init_diff, from_rank0 in run_ranks(_broadcast_and_resync, 2, timeout=30):
        assert resync_diff == 0 and init_diff == 0 and from_rank0 == 0


def _mixed_tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [
        torch.randn(3, 5, generator=g),
        torch.tensor(7 + rank, dtype=torch.int64),  # 0-dim, like num_batches_tracked
        torch.randn(4, generator=g).to(torch.float16),
        torch.rand(6, generator=g) > 0.5,
        torch.randn(2, 3, generator=g, dtype=torch.float64).t(),  # not contiguous
        torch.randint(0, 255, (5,), generator=g, dtype=torch.uint8),
    ]


def _broadcast_mixed() -> list[torch.Tensor]:
    tensors = _mixed_tensors(dist.get_rank())
    broadcast_coalesced(tensors)
    return tensors


@pytest.mark.distributed
def test_broadcast_coalesced_mixes_dtypes_exactly():
    expected = _mixed_tensors(0)  # what rank 0 held
    for rank, tensors in enumerate(run_ranks(_broadcast_mixed, 3, timeout=30)):
        for got, want in zip(tensors, expected, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape, (rank, got, want)
            assert torch.equal(got, want), (rank, got, want)


def _hooks() -> float:
    rank = dist.get_rank()
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        assert bucket.buffer().numel() == sum(g.numel() for g in bucket.gradients())
        return allreduce_hook(state, bucket)

    ours = tandem.DDP(models.mlp(), comm_hook=counting_hook)
    theirs = TorchDDP(models.mlp())
    theirs.register_comm_hook(None, allreduce_hook)  # tandem's hook in torch's DDP
    plain = TorchDDP(models.mlp())
    for model in (ours, theirs, plain):
        x, y = models.batch(0, rank, 4, (10,))
        F.cross_entropy(model(x), y).backward()
    assert calls, "the user's hook was never called"
    return max(
        max((a.grad - c.grad).abs().max().item(), (b.grad - c.grad).abs().max().item())
        for a, b, c in zip(ours.parameters(), theirs.parameters(), plain.parameters(), strict=True)
    )


@pytest.mark.distributed
def test_user_hook_and_tandem_hook_in_torch_ddp():
    assert max(run_ranks(_hooks, 2)) < 1e-12


def test_one_process_without_process_group_matches_plain_module():
    assert not dist.is_initialized()
    ddp = tandem.DDP(models.mlp(), find_unused_parameters=True)
    plain = models.mlp()
    opt_a = models.make_optimizer("adam", ddp.parameters())
    opt_b = models.make_optimizer("adam", plain.parameters())
    for step in range(3):
        x, y = models.batch(step, 0, 8, (10,))
        for model, opt in ((ddp, opt_a), (plain, opt_b)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert models.max_diff(ddp.module, plain) == 0.0


def test_drop_zero_grads_skips_parameters_that_sat_out():
    model = nn.Linear(3, 2)
    model.weight.grad = torch.zeros(2, 3)
    model.bias.grad = torch.tensor([0.0, 1.0])
    assert tandem.drop_zero_grads(model) == 1
    assert model.weight.grad is None and model.bias.grad is not None
    before = model.weight.detach().clone()
    torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1).step()
    assert torch.equal(model.weight, before)  # weight decay did not touch it
