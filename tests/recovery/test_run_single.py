"""tandem.recovery.Run in one process: the loop a user writes, and the set-ups it refuses.

Proves: without ``--recover in-memory`` (here: one process, no group) ``Run`` is a plain loop
that equals a hand-written one over the same sampler order bitwise (epochs, a last partial
batch, the optimizer stepped once per batch); and a set-up it cannot recover is refused with a
message that names it and says what to do, before anything trains: an already wrapped module,
a sharded model, a sharded optimizer (a lost rank would take its shard of the state along).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tandem
from tandem.data import DistributedSampler
from tandem.recovery import Run


def setup() -> tuple[nn.Module, torch.optim.Optimizer, TensorDataset]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(23, 5, generator=g)
    data = TensorDataset(x, (x.sum(1) > 0).long())
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), data


def test_run_equals_a_hand_written_loop():
    net, opt, data = setup()
    run = Run(net, opt, data, batch_size=4, epochs=2, seed=5)
    losses = []
    while not run.finished:
        losses.append(run.step(lambda m, b: F.cross_entropy(m(b[0]), b[1]).backward()))
    assert run.step_count == 2 * 6  # 23 samples: five batches of 4 and one of 3, twice

    ref, ref_opt, _ = setup()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=5)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for i in range(0, len(order), 4):
            x, y = (torch.stack(t) for t in zip(*(data[j] for j in order[i : i + 4]), strict=True))
            ref_opt.zero_grad(set_to_none=True)
            F.cross_entropy(ref(x), y).backward()
            ref_opt.step()
    for (name, a), b in zip(net.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(RuntimeError, match="trained its 2 epoch"):
        run.step(lambda m, b: None)


def test_a_wrapped_module_is_refused():
    net, opt, data = setup()
    with pytest.raises(ValueError, match=r"takes the plain module.*this one is a DataParallel"):
        Run(nn.DataParallel(net), opt, data, batch_size=4)


def test_a_sharded_model_is_refused():
    net, _, data = setup()
    fsdp = tandem.FullyShardedDataParallel(net)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"FullyShardedDataParallel.*--recover restart"):
        Run(fsdp, opt, data, batch_size=4)


def test_a_sharded_optimizer_is_refused():
    net, _, data = setup()
    opt = tandem.ShardedOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="ShardedOptimizer: its state is sharded"):
        Run(net, opt, data, batch_size=4)
