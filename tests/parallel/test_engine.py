"""The engine contract (tandem.parallel.engine), engine by engine, against plain torch.

- ``make_engine`` wraps a plain module in tandem.DDP only when there is more than one rank, and
  takes an FSDP or DataParallel model as it is; the wrong checkpoint kind, a scaler with FSDP
  and DataParallel in a job of several processes are refused.
- ``clip_grad_norm_`` returns the norm of the whole averaged gradient and clips it exactly as
  ``torch.nn.utils.clip_grad_norm_`` does on that gradient held in one process (bitwise for the
  replicated engines; for FSDP the ranks' partial sums are added, so to rounding).
- ``no_sync`` keeps gradients local (they differ across ranks) until a synced backward.
- ``state_dict("full")`` loads into a fresh engine and gives back the same parameters and
  optimizer state; ``plain_weights`` gives rank 0 the plain module's keys and values.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem
from tandem.parallel.engine import ReplicatedEngine, make_engine
from tests.harness import run_ranks


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 6, generator=g) * 5, torch.randint(0, 3, (8,), generator=g)


def _mean_gradients(world: int) -> list[torch.Tensor]:
    """The averaged gradient, computed without any engine: every rank's, summed, divided."""
    grads = []
    for rank in range(world):
        net = _net()
        x, y = _batch(rank)
        F.cross_entropy(net(x), y).backward()
        grads.append([p.grad for p in net.parameters()])
    # Gloo sums two ranks' values as a + b; the engine divides each by the world size first.
    return [sum(g[i] / world for g in grads) for i in range(len(grads[0]))]  # type: ignore[misc]


def _wrap(kind: str, net: nn.Module):
    if kind == "fsdp3":
        model = tandem.FullyShardedDataParallel(net, stage=3, auto_wrap={nn.Linear})
        return make_engine(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return make_engine(net, torch.optim.SGD(net.parameters(), lr=0.1))


def _clip(kind: str) -> dict:
    world = dist.get_world_size()
    engine = _wrap(kind, _net())
    x, y = _batch(dist.get_rank())
    F.cross_entropy(engine.model(x), y).backward()
    before = [p.grad.clone() for p in engine.model.parameters() if p.grad is not None]
    norm = engine.clip_grad_norm_(0.5)
    after = [p.grad for p in engine.model.parameters() if p.grad is not None]

    reference = _net()
    for p, g in zip(reference.parameters(), _mean_gradients(world), strict=True):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    result = {
        "engine": type(engine).__name__,
        "wrapped": type(engine.model).__name__,
        "norm": (norm.item(), expected.item()),
        "weights": _same_weights(engine.plain_weights(), reference.state_dict()),
    }
    if kind == "ddp":
        # The whole gradient is here: it must be torch's clipped gradient, bit for bit.
        pairs = zip(after, [p.grad for p in reference.parameters()], strict=True)
    else:
        # Shards only: each must be its unclipped self times torch's coefficient.
        coefficient = min(1.0, 0.5 / (norm.item() + 1e-6))
        pairs = zip(after, [g * coefficient for g in before], strict=True)
    result["grad_diff"] = max((a - b).abs().max().item() for a, b in pairs)
    return result


def _same_weights(got: dict | None, plain: dict) -> bool:
    """Rank 0 holds the plain module's keys and values (no wrapper prefix); the others None."""
    if dist.get_rank() != 0:
        return got is None
    return list(got) == list(plain) and all(torch.equal(got[k], plain[k]) for k in plain)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["ddp", "fsdp3"])
def test_clip_grad_norm_is_the_global_norm(kind):
    """Also: the engine make_engine picks, and plain_weights (rank 0's, no prefix)."""
    for result in run_ranks(_clip, 2, args=(kind,), timeout=60):
        norm, expected = result["norm"]
        assert result["weights"], result
        if kind == "ddp":
            assert result["engine"] == "ReplicatedEngine", result
            assert result["wrapped"] == "DistributedDataParallel", result
            assert norm == expected and result["grad_diff"] == 0.0, result
        else:
            assert result["engine"] == "ShardedEngine", result
            assert abs(norm - expected) <= 1e-6 * expected, result
            assert result["grad_diff"] <= 1e-6, result


def _no_sync() -> dict:
    net = _net()
    engine = make_engine(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _batch(dist.get_rank())
    with engine.no_sync():
        F.cross_entropy(engine.model(x), y).backward()
    local = [p.grad.clone() for p in engine.module.parameters()]
    engine.optimizer.zero_grad()
    F.cross_entropy(engine.model(x), y).backward()
    synced = [p.grad.clone() for p in engine.module.parameters()]
    return {"local": local, "synced": synced}


@pytest.mark.distributed
def test_no_sync_keeps_gradients_local_until_a_synced_backward():
    first, second = run_ranks(_no_sync, 2, timeout=60)
    assert not torch.equal(first["local"][0], second["local"][0])
    mean = _mean_gradients(2)
    for a, b, m in zip(first["synced"], second["synced"], mean, strict=True):
        assert torch.equal(a, b) and torch.equal(a, m)


def _round_trip(optimizer: str) -> dict:
    net = _net()
    opt_class = torch.optim.AdamW
    if optimizer == "sharded":
        opt = tandem.ShardedOptimizer(net.parameters(), opt_class, lr=0.01)
    else:
        opt = opt_class(net.parameters(), lr=0.01)
    engine = make_engine(net, opt, checkpoint_format="full")
    for step in range(3):
        x, y = _batch(dist.get_rank() + 10 * step)
        F.cross_entropy(engine.model(x), y).backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    # Rank 0's, on every rank, as a checkpoint file read by rank 0 and sent on (the full kind is
    # meaningful on rank 0 only); copied, so no tensor is shared with the trained engine.
    box = [copy.deepcopy(engine.state_dict("full"))]
    dist.broadcast_object_list(box, src=0)
    state = box[0]
    # A fresh engine of the same kind, loaded: the next step is the same on both.
    fresh_net = _net()  # other weights: the loaded state must replace them
    with torch.no_grad():
        for p in fresh_net.parameters():
            p.add_(1.0)
    if optimizer == "sharded":
        fresh_opt = tandem.ShardedOptimizer(fresh_net.parameters(), opt_class, lr=0.01)
    else:
        fresh_opt = opt_class(fresh_net.parameters(), lr=0.01)
    fresh = make_engine(fresh_net, fresh_opt)
    fresh.load_state_dict(state)
    x, y = _batch(dist.get_rank() + 99)
    for e in (engine, fresh):
        F.cross_entropy(e.model(x), y).backward()
        e.optimizer.step()
    return {
        "same": all(
            torch.equal(a, b)
            for a, b in zip(engine.module.parameters(), fresh.module.parameters(), strict=True)
        ),
        "kinds": type(engine).__name__,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("optimizer", ["plain", "sharded"])
def test_full_state_round_trip_continues_identically(optimizer):
    for result in run_ranks(_round_trip, 2, args=(optimizer,), timeout=60):
        assert result["same"], result


def test_one_process_stays_plain_and_bad_set_ups_are_refused():
    net = _net()
    engine = make_engine(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(engine, ReplicatedEngine) and engine.model is net
    with pytest.raises(ValueError, match=r"needs a tandem\.FullyShardedDataParallel"):
        make_engine(net, torch.optim.SGD(net.parameters(), lr=0.1), checkpoint_format="sharded")
    with pytest.raises(ValueError, match="must be 'full' or 'sharded', not 'zip'"):
        make_engine(net, torch.optim.SGD(net.parameters(), lr=0.1), checkpoint_format="zip")
    dp = tandem.DataParallel(_net())
    engine = make_engine(dp, torch.optim.SGD(dp.parameters(), lr=0.1))
    assert engine.model is dp and engine.module is dp.module
    assert list(engine.plain_weights()) == list(_net().state_dict())  # no "module." prefix
    fsdp = tandem.FullyShardedDataParallel(_net(), stage=3)
    with pytest.raises(ValueError, match="GradScaler sees only"):
        make_engine(fsdp, torch.optim.SGD(fsdp.parameters(), lr=0.1), scaler=object())


def _data_parallel_in_a_job() -> str:
    with pytest.raises(ValueError) as info:
        make_engine(tandem.DataParallel(_net()), torch.optim.SGD(_net().parameters(), lr=0.1))
    return str(info.value)


@pytest.mark.distributed
def test_data_parallel_in_a_multi_process_job_is_refused():
    for message in run_ranks(_data_parallel_in_a_job, 2, timeout=60):
        assert "DataParallel model in a job of 2 processes" in message, message
