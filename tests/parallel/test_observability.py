"""What torch's profiler and a user's logs see of the engines.

- A profiled DDP step shows ``tandem.ddp.forward``, one ``tandem.ddp.bucket_reduce`` and one
  ``tandem.ddp.bucket_wait`` per bucket (with the bucket named), on every rank.
- With no profiler running the ranges cost nothing: none is recorded, and the guard is the
  cheap check, not torch's ``record_function`` (tens of microseconds each).
- The bucket rebuild is logged at debug level on ``tandem.parallel.ddp.reducer``.
- A ShardedOptimizer step shows ``tandem.zero.step`` then ``tandem.zero.broadcast``.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tandem
from tandem import _profile
from tests.harness import run_ranks


def _profiled_step() -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    # Two buckets once rebuilt: the last layer and the first bias (336 bytes) pass the 300-byte
    # cap, the first weight (512 bytes) is the second.
    model = tandem.DDP(net, bucket_cap_mb=300 / 2**20)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("tandem.parallel.ddp.reducer")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    F.cross_entropy(model(x), y).backward()  # learns the order; the rebuild comes next forward
    with torch.profiler.profile() as prof:
        F.cross_entropy(model(x), y).backward()
    logger.removeHandler(handler)
    names = [e.name for e in prof.events() if e.name.startswith("tandem.")]
    return {
        "names": names,
        "buckets": len(model.reducer.buckets),
        "logs": records,
    }


@pytest.mark.distributed
def test_profiler_sees_the_ddp_phases_on_every_rank():
    for result in run_ranks(_profiled_step, 2, timeout=60):
        names, buckets = result["names"], result["buckets"]
        assert buckets >= 2, result
        assert names.count("tandem.ddp.forward") == 1, names
        assert names.count("tandem.ddp.bucket_reduce") == buckets, names
        assert names.count("tandem.ddp.bucket_wait") == buckets, names
        assert any("buckets rebuilt" in line for line in result["logs"]), result["logs"]


def test_no_range_is_opened_without_a_profiler(monkeypatch):
    opened = []
    monkeypatch.setattr(
        _profile, "record_function", lambda *a: opened.append(a) or contextlib.nullcontext()
    )
    with _profile.span("tandem.ddp.forward"):
        pass
    assert opened == []
    with torch.profiler.profile(), _profile.span("tandem.ddp.forward"):
        pass
    assert opened == [("tandem.ddp.forward", None)]


def test_profiler_sees_the_sharded_optimizer_step():
    net = nn.Linear(4, 2)
    opt = tandem.ShardedOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    net(torch.randn(3, 4)).sum().backward()
    with torch.profiler.profile() as prof:
        opt.step()
    names = [e.name for e in prof.events() if e.name.startswith("tandem.")]
    assert names == ["tandem.zero.step", "tandem.zero.broadcast"], names
