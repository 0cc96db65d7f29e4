"""tandem.DDP's guarantees beyond parity: errors on every rank, unused parameters, buckets.

- Models that differ across ranks: a ValueError naming the parameter, shapes and ranks, raised on
  every rank within seconds (the harness timeout turns a hang into a failure).
- A parameter with no gradient and no find_unused_parameters: an error naming it and the flag,
  on every rank, also when only one rank missed it (where torch's DDP hangs).
- find_unused_parameters: a parameter unused on every rank keeps ``.grad`` None; one unused on a
  single rank gets the mean of the others'.
- Buckets: one until the first backward, then rebuilt once in the order gradients became
  ready (the same on every rank); launched during backward, before the last gradient exists.
- Construction broadcasts rank 0's parameters; sync_params_and_buffers re-broadcasts.
- Communication hooks: a user's hook; tandem's hook inside torch's DDP.
- One process without a process group: the same code path, identical to the plain module.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.parallel.agreement import UnusedParametersError
from tandem.parallel.comm_hooks import allreduce_hook
from tandem.parallel.replicas import broadcast_coalesced
from tests.distributed import models
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


@pytest.mark.parametrize("only_rank0", [False, True], ids=["all-ranks", "one-rank"])
def test_missing_gradient_without_flag_raises_on_every_rank(only_rank0):
    messages = run_ranks(_missing_gradient, 2, args=(only_rank0,), timeout=30)
    for message in messages:
        assert "find_unused_parameters=True" in message
        assert "rank 0: " in message and "right.weight" in message and "never.weight" in message
        # rank 1 used 'right' in the one-rank case, so only 'never' is listed for it
        rank1_line = next(line for line in message.splitlines() if "rank 1:" in line)
        assert ("right.weight" in rank1_line) is (not only_rank0)


def _unused_grads() -> dict:
    rank = dist.get_rank()
    model = tandem.DDP(models.branchy(), find_unused_parameters=True)
    x, y = models.batch(0, rank, 4, (10,))
    F.cross_entropy(model(x, use="left" if rank == 0 else "both"), y).backward()
    return {
        n: None if p.grad is None else p.grad.clone() for n, p in model.module.named_parameters()
    }


def test_find_unused_parameters_semantics():
    grads = run_ranks(_unused_grads, 2)
    for g in grads:
        assert g["never.weight"] is None and g["never.bias"] is None
    # 'right' ran on rank 1 only; rank 0 still holds the mean (rank 1's gradient / 2)
    assert grads[0]["right.weight"] is not None
    assert torch.equal(grads[0]["right.weight"], grads[1]["right.weight"])
    assert grads[0]["right.weight"].abs().sum() > 0
    assert torch.equal(grads[0]["trunk.weight"], grads[1]["trunk.weight"])


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
    seed0 = torch.cat([p.detach().reshape(-1) for p in models.conv_bn(seed=0).parameters()])
    return [
        (gathered[0] - gathered[rank]).abs().max().item(),
        (init_flat - seed0).abs().max().item(),
    ]


def test_construction_broadcasts_and_sync_params_and_buffers():
    for resync_diff, init_diff in run_ranks(_broadcast_and_resync, 2):
        assert resync_diff == 0 and init_diff == 0


def _broadcast_mixed() -> list[list]:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    tensors = [
        torch.randn(3, 5, generator=g),
        torch.tensor(7 + rank, dtype=torch.int64),  # 0-dim, like num_batches_tracked
        torch.randn(4, generator=g).to(torch.float16),
        torch.rand(6, generator=g) > 0.5,
        torch.randn(2, 3, generator=g, dtype=torch.float64).t(),  # not contiguous
        torch.randint(0, 255, (5,), generator=g, dtype=torch.uint8),
    ]
    broadcast_coalesced(tensors)
    return [t.tolist() for t in tensors]


def test_broadcast_coalesced_mixes_dtypes_exactly():
    results = run_ranks(_broadcast_mixed, 3)
    assert results[0] == results[1] == results[2]
    assert results[0][1] == 7  # rank 0's counter


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
