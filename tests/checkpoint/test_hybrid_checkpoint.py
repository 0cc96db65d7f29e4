"""tandem.checkpoint with a hybrid-sharded FSDP model: full and sharded, at any layout.

A hybrid run (``FullyShardedDataParallel(hybrid=True)``, 4 real ranks on Gloo laid out as 2
nodes of 2 by ``tests.parallel.fsdp.models.as_nodes``; units of 25 and 18 elements, which 2
does not divide; AdamW) trains 2 steps and saves ``kind="sharded"`` and ``kind="full"``. The
oracle is what it held then: its model's and optimizer's full state dicts (gathered on rank 0).
Proven:

- **Written**: every rank writes its file (4), and the two replicas' files hold the same
  slices and optimizer state bit for bit (what lets a reader at another layout take one copy).
- **Same layout**: the sharded checkpoint loads into a fresh hybrid model bit for bit, and the
  two go on training to the same bits.
- **Another layout**, each load gathered whole and compared with the oracle bit for bit:
  the hybrid files read on 1 node of 2 (``hybrid=True``, flat there), by flat FSDP at 2 and 3
  ranks, on 3 nodes of 1 (hybrid, a whole slice per rank) and by one process; a flat run's
  sharded checkpoint (flat FSDP at 4, from the full one) read on 3 nodes of 1 (flat to hybrid);
  at 4 ranks, as many files as processes on the other layout: the flat run's read by the
  hybrid model and the hybrid run's by flat FSDP (each rank cuts its part anew). At 2 ranks,
  training on from the resharded sharded checkpoint equals training on from the full
  checkpoint bit for bit.
- **Full state**: the full checkpoint of the hybrid run loads into tandem.DDP over 2 ranks and
  into a plain model in one process, equal to the oracle.
- **Errors**, on every rank: the sharded checkpoint loaded by tandem.DDP says it holds an
  FSDP model's shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem
from tandem import checkpoint
from tests import models
from tests.harness import run_ranks
from tests.parallel.fsdp.models import as_nodes

pytestmark = pytest.mark.distributed

GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4 ranks


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _fsdp(**sharding: Any) -> tuple[tandem.FullyShardedDataParallel, torch.optim.Optimizer]:
    model = tandem.FullyShardedDataParallel(_net(), auto_wrap={nn.Linear}, **sharding)
    return model, torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, first: int, count: int) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL_BATCH // world
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
        opt.zero_grad()
        F.mse_loss(
            model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]
        ).backward()
        opt.step()


def _whole(model: tandem.FullyShardedDataParallel, opt: torch.optim.Optimizer) -> dict | None:
    """Model and optimizer gathered whole on rank 0, copied (a collective); None elsewhere."""
    weights, optim = model.full_state_dict(), model.full_optim_state_dict(opt)
    return None if weights is None else models.copied({"model": weights, "optimizer": optim})


def _loaded(path: Path, **sharding: Any) -> tuple[Any, Any, dict | None]:
    model, opt = _fsdp(**sharding)
    checkpoint.load({"model": model, "optimizer": opt}, path)
    return model, opt, _whole(model, opt)


def _error(fn: Any) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _saved_at_2x2(tmp: str) -> dict:
    as_nodes(2)
    out: dict = {}
    model, opt = _fsdp(hybrid=True)
    assert model.mesh.hybrid
    _steps(model, opt, 0, 2)
    state = {"model": model, "optimizer": opt}
    checkpoint.save(state, f"{tmp}/hybrid.pt", kind="sharded")
    checkpoint.save(state, f"{tmp}/full.pt", kind="full")
    out["oracle"] = _whole(model, opt)
    mine = models.copied([model.sharded_state_dict()["shards"], opt.state_dict()["state"]])
    everyone: list = [None] * 4
    dist.all_gather_object(everyone, mine)
    out["replicas equal"] = [_same(everyone[r], everyone[r + 2]) for r in range(2)]
    # The same layout: bit for bit, and on in step with the run that saved.
    again, again_opt, loaded = _loaded(Path(f"{tmp}/hybrid.pt"), hybrid=True)
    out["same layout"] = loaded
    _steps(model, opt, 2, 2)
    _steps(again, again_opt, 2, 2)
    out["same layout, trained on"] = (_whole(again, again_opt), _whole(model, opt))
    # A flat run's sharded checkpoint at 4 ranks, written from the full one.
    flat, flat_opt = _fsdp()
    checkpoint.load({"model": flat, "optimizer": flat_opt}, f"{tmp}/full.pt")
    checkpoint.save({"model": flat, "optimizer": flat_opt}, f"{tmp}/flat4.pt", kind="sharded")
    # As many files as processes, cut on the other layout: each rank cuts its part anew.
    out["flat4 by hybrid"] = _loaded(Path(f"{tmp}/flat4.pt"), hybrid=True)[2]
    out["hybrid by flat4"] = _loaded(Path(f"{tmp}/hybrid.pt"))[2]
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _loaded_at_2(tmp: str) -> dict:
    as_nodes(2)  # one node of 2: hybrid=True is flat sharding
    out: dict = {}
    hybrid_file, full_file = Path(f"{tmp}/hybrid.pt"), Path(f"{tmp}/full.pt")
    model, _opt, out["1x2"] = _loaded(hybrid_file, hybrid=True)
    assert not model.mesh.hybrid and model.world_size == 2
    flat, flat_opt, out["flat 2"] = _loaded(hybrid_file)
    full, full_opt, _ = _loaded(full_file)
    _steps(flat, flat_opt, 2, 2)
    _steps(full, full_opt, 2, 2)
    out["trained on: sharded, full"] = (_whole(flat, flat_opt), _whole(full, full_opt))
    net = tandem.DDP(_net())
    ddp_opt = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.1)
    checkpoint.load({"model": net, "optimizer": ddp_opt}, full_file)
    out["ddp"] = models.copied(
        {"model": net.module.state_dict(), "optimizer": ddp_opt.state_dict()}
    )
    state = {"model": net, "optimizer": ddp_opt}
    out["sharded by ddp"] = _error(lambda: checkpoint.load(state, hybrid_file))
    return out


def _loaded_at_3(tmp: str) -> dict:
    as_nodes(1)  # 3 nodes of 1: hybrid, every rank a whole replica
    out: dict = {}
    model, _, out["3x1"] = _loaded(Path(f"{tmp}/hybrid.pt"), hybrid=True)
    assert model.mesh.hybrid and model.world_size == 1
    _, _, out["flat 3"] = _loaded(Path(f"{tmp}/hybrid.pt"))
    _, _, out["flat4 by 3x1"] = _loaded(Path(f"{tmp}/flat4.pt"), hybrid=True)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = str(tmp_path_factory.mktemp("hybrid-ckpt"))
    out = {"tmp": Path(tmp), 4: run_ranks(_saved_at_2x2, 4, args=(tmp,), timeout=120)}
    out[2] = run_ranks(_loaded_at_2, 2, args=(tmp,), timeout=120)
    out[3] = run_ranks(_loaded_at_3, 3, args=(tmp,), timeout=120)
    return out


def _assert_same(got: Any, want: Any, what: str) -> None:
    assert got is not None and want is not None, what
    assert _same(got, want), what


def test_every_rank_writes_and_the_replicas_hold_the_same_bits(runs):
    shards = sorted(p.name for p in (runs["tmp"] / "shards" / "hybrid").iterdir())
    assert shards == [f"rank{r:05d}.pt" for r in range(4)]
    for rank, r in enumerate(runs[4]):
        assert r["replicas equal"] == [True, True], rank


def test_the_same_layout_loads_bitwise_and_trains_on_in_step(runs):
    first = runs[4][0]
    _assert_same(first["same layout"], first["oracle"], "loaded")
    _assert_same(*first["same layout, trained on"], "trained on")


@pytest.mark.parametrize(
    "world, layout", [(2, "1x2"), (2, "flat 2"), (3, "3x1"), (3, "flat 3"), (3, "flat4 by 3x1")]
)
def test_another_layout_loads_the_same_state_bitwise(runs, world, layout):
    _assert_same(runs[world][0][layout], runs[4][0]["oracle"], layout)


def test_resharded_trains_on_as_the_full_checkpoint(runs):
    _assert_same(*runs[2][0]["trained on: sharded, full"], "sharded vs full")


def test_one_process_loads_the_hybrid_files(runs):
    model, _opt, whole = _loaded(runs["tmp"] / "hybrid.pt")
    assert model.world_size == 1
    _assert_same(whole, runs[4][0]["oracle"], "one process")
    plain = _net()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.02, weight_decay=0.1)
    checkpoint.load({"model": plain, "optimizer": plain_opt}, runs["tmp"] / "full.pt")
    want = runs[4][0]["oracle"]
    _assert_same(models.copied(plain.state_dict()), want["model"], "plain model")
    _assert_same(runs[2][0]["ddp"]["model"], want["model"], "ddp model")
    assert _same(plain_opt.state_dict()["state"], want["optimizer"]["state"])
    assert _same(runs[2][1]["ddp"]["optimizer"]["state"], want["optimizer"]["state"])


@pytest.mark.parametrize("layout", ["flat4 by hybrid", "hybrid by flat4"])
def test_as_many_processes_on_another_layout_load_the_same_state_bitwise(runs, layout):
    # 2 nodes x 2 and one flat group of 4: the same count of files, other slices in each.
    _assert_same(runs[4][0][layout], runs[4][0]["oracle"], layout)


def test_what_cannot_load_is_a_clear_error_on_every_rank(runs):
    ddp = [r["sharded by ddp"] for r in runs[2]]
    assert all(m is not None and "shards of a tandem.FullyShardedDataParallel" in m for m in ddp)


def test_export_of_the_hybrid_sharded_checkpoint_is_the_saved_model(runs, tmp_path):
    # Four files, two copies of every slice: export takes one copy (saved rank 0's node).
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    out = checkpoint.export_weights(runs["tmp"] / "hybrid.pt", tmp_path / "hybrid.safetensors")
    got = load_file(str(out))
    want = runs[4][0]["oracle"]["model"]
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
