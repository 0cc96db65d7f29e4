"""Bytes handed to collectives per step, per process group: equal to the formulas, to the byte.

Real ranks on Gloo. Each count is read from the step clock (``Clock.handed``: what the per-group
sums grew by between two of its ticks), and for tandem.DDP also through the step file and the
exit summary's line. The formulas are written from the model, not from tandem's internals:

- tandem.DDP, 2 ranks, a model with BatchNorm (so with buffers), buckets small enough to be
  several: every step, every rank hands one all-reduce of every gradient, ``4 x parameters``
  bytes (float32), however the buckets cut them. The control collectives tandem adds, each
  counted on its source only (a broadcast is handed by its source): rank 0 broadcasts the
  buffers at every forward (their bytes: two float32 vectors and an int64 counter), and once,
  at the second forward, the bucket order it learnt (one int64 per parameter tensor). The
  end-of-backward check rides in the last bucket on the CPU: no bytes of its own.
- FullyShardedDataParallel, stage 3, 2 ranks, a unit per Linear (the root holds no parameter),
  one unit's size odd so that padding counts: each unit's flat parameters are padded to an even
  length ``P``. A forward all-gathers each unit (handing its shard, ``P / 2`` elements), the
  backward all-gathers it again, and reduce-scatters its gradient (handing all ``P``): the
  issue's "3 x parameters" are the three collectives per unit, each of which moves about
  ``P / 2`` elements across the link on 2 ranks; handed they are ``P/2 + P/2 + P``. Except:
  from the second step on, the last unit of the forward is kept for its backward, which comes
  first (``fsdp/hooks.py``), so it is not gathered again.
- A collective on a ``dist.new_group`` is counted under that group's name, not the world's; a
  rank outside the group counts nothing; a second group of the same ranks has a name of its own;
  a broadcast counts on its source only, with ``src`` or ``group_src``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem
from tandem import doctor
from tandem.doctor import records, step_clock, stragglers
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

STEPS = 5
F32, I64 = 4, 8  # bytes per element


def train(model: nn.Module, opt: torch.optim.Optimizer) -> step_clock.Clock:
    """STEPS steps (and the forward that ends the last one at its tick); the step clock."""
    torch.manual_seed(dist.get_rank())
    for _ in range(STEPS + 1):  # a step ends at the next one's tick
        x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    clock = step_clock.counting()
    assert clock is not None
    return clock


def _ddp_steps(report_dir: str) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 3)
    )
    params = list(net.parameters())
    buffers = list(net.buffers())
    model = tandem.DDP(net, bucket_cap_mb=1e-4)  # ~100 bytes: a few buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = train(model, opt)
    step_clock.write(report_dir)
    return {
        "handed": list(clock.handed),
        "param_elements": sum(p.numel() for p in params),
        "param_tensors": len(params),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in buffers),
        "buckets": len({r.context for r in records.recent() if r.context is not None
                        and r.context.startswith("DDP bucket ") and r.context.endswith(" step 3")}),
    }  # fmt: skip


def test_ddp_hands_every_gradient_once_per_step_and_the_summary_says_so(tmp_path):
    ranks = run_ranks(_ddp_steps, 2, args=(str(tmp_path),), init="gloo", timeout=120)
    first = ranks[0]
    assert first["buckets"] >= 2, first  # several buckets: the sum does not depend on the cut
    # Linear 5->4, BatchNorm 4, Linear 4->3, Linear 3->3: 24 + 8 + 15 + 12 in 8 tensors.
    assert (first["param_elements"], first["param_tensors"]) == (59, 8)
    grads = F32 * first["param_elements"]  # one all-reduce of every float32 gradient
    # Two float32 vectors of 4 (running mean, running var) and an int64 counter.
    assert first["buffer_bytes"] == 2 * 4 * F32 + I64
    rebuild = I64 * first["param_tensors"]  # the learnt bucket order, once, at the 2nd forward
    expected = {
        0: [grads + first["buffer_bytes"] + (rebuild if step == 1 else 0) for step in range(STEPS)],
        1: [grads] * STEPS,  # receives the broadcasts: hands only its gradients
    }
    for rank, result in enumerate(ranks):
        assert [step.get("world", 0) for step in result["handed"]] == expected[rank], rank
        assert all(set(step) == {"world"} for step in result["handed"]), result["handed"]
    (read0, read1) = stragglers.read(tmp_path)
    assert read0.median_handed("world") == grads + first["buffer_bytes"]
    assert read1.median_handed("world") == grads
    summary = stragglers.summary(tmp_path)
    assert summary is not None
    assert "bytes handed to collectives per step, per group (median step of each rank):" in summary
    big, small = grads + first["buffer_bytes"], grads
    assert f"  world: {big} B on rank 0; {small} B on rank 1" in summary, summary


class Units(nn.Module):
    """Three Linears, one FSDP unit each; the root has no parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        # 24, 15 (odd: padded to 16) and 12 parameters.
        self.a, self.b, self.c = nn.Linear(5, 4), nn.Linear(4, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


def _fsdp_steps() -> dict:
    torch.manual_seed(0)
    net = Units()
    sizes = [sum(p.numel() for p in m.parameters()) for m in (net.a, net.b, net.c)]
    model = tandem.FullyShardedDataParallel(net, auto_wrap={nn.Linear})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = train(model, opt)
    return {"handed": list(clock.handed), "sizes": sizes}


def test_fsdp_full_shard_hands_gather_gather_reduce_scatter_per_unit():
    ranks = run_ranks(_fsdp_steps, 2, init="gloo", timeout=120)
    sizes = ranks[0]["sizes"]
    assert sizes == [24, 15, 12]
    world = 2
    padded = [-(-n // world) * world for n in sizes]  # [24, 16, 12]
    shard = [p // world for p in padded]
    forward_gathers = F32 * sum(shard)
    reduce_scatters = F32 * sum(padded)  # each rank hands its whole (padded) flat gradient
    first_step = forward_gathers + F32 * sum(shard) + reduce_scatters  # gathered again, all
    later = forward_gathers + F32 * sum(shard[:-1]) + reduce_scatters  # the last one kept
    assert (first_step, later) == (416, 392)  # the formula's numbers, for the reader
    for result in ranks:
        assert result["handed"] == [{"world": first_step}] + [{"world": later}] * (STEPS - 1)


def _subgroups() -> dict:
    doctor.start()
    rank = dist.get_rank()
    pair = dist.new_group([0, 2])
    again = dist.new_group([0, 2], group_desc="shard")  # the same ranks: a name of its own
    clock = step_clock.clock("test steps", priority=0)
    clock.tick()
    if rank in (0, 2):
        dist.all_reduce(torch.ones(10), group=pair)  # 40 bytes under "ranks 0,2"
        dist.broadcast(torch.ones(3, dtype=torch.float64), src=2, group=pair)  # 24, rank 2 only
        dist.broadcast(torch.ones(5, dtype=torch.int8), group_src=0, group=again)  # 5, rank 0
    else:
        dist.all_reduce(torch.ones(10), group=pair)  # not a member: torch issues nothing
    shard = torch.ones(2, dtype=torch.float64)
    out = torch.empty(2 * dist.get_world_size(), dtype=torch.float64)
    dist.all_gather_into_tensor(out, shard)  # 16 bytes: this rank's shard
    dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * dist.get_world_size()))  # 24
    clock.tick()
    return {
        "handed": list(clock.handed),
        "names": [records.group_name(g) for g in (None, dist.group.WORLD, pair, again)],
        "nbytes": [(r.op, r.group, r.nbytes) for r in records.recent()[-5:]],
    }


def test_a_subgroups_collectives_count_under_its_own_name():
    zero, one, two = run_ranks(_subgroups, 3, init="gloo", timeout=120)
    world = 16 + 3 * 2 * F32  # the shard gathered; the whole input of the reduce-scatter
    assert zero["handed"] == [{"world": world, "ranks 0,2": 40, "ranks 0,2 (shard, 2nd)": 5}]
    assert one["handed"] == [{"world": world}]
    assert two["handed"] == [{"world": world, "ranks 0,2": 40 + 24}]
    assert zero["names"] == ["world", "world", "ranks 0,2", "ranks 0,2 (shard, 2nd)"]
    assert two["names"] == zero["names"]
    assert two["nbytes"][-3:] == [
        ("broadcast", "ranks 0,2 (shard, 2nd)", 0),
        ("all_gather_single", "world", 16),
        ("reduce_scatter_single", "world", 24),
    ]
