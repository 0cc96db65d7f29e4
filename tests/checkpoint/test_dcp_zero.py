"""A tandem.ShardedOptimizer (ZeRO-1) in a DCP checkpoint: each owner writes its parameters'
state and reads only theirs back, in the layout torch's own DCP writes for a plain optimizer.

The oracle is torch: a plain AdamW holding the same state (the ShardedOptimizer's gathered
``full_state_dict``, loaded into it), saved by torch's own ``dcp.save(get_state_dict(...))``,
and read back through ``dcp.load`` + ``set_state_dict``; over Gloo in real processes, at 2 and
3 ranks. AdamW in two parameter groups (weights with weight decay, biases without) after 3
steps. Proven, ``torch.equal`` everywhere:

- **written per owner, no gather**: while tandem saves, ``full_state_dict`` (the gather)
  raises; the metadata's storage places each parameter's state
  (``step``, ``exp_avg``, ``exp_avg_sq``) in its owner's file ``__<owner>_0.distcp`` and
  nowhere else; the metadata's entries (keys, shapes, dtypes, chunks) and the flattening map
  are those of torch's own save of the plain optimizer.
- **torch reads it**: ``dcp.load`` into a plain module and AdamW at 2 and at 3 ranks gives the
  gathered state bit for bit.
- **tandem reads per owner**: a ShardedOptimizer at 3 ranks loads the 2 ranks' checkpoint (and
  at 2 the one written at 2), each rank asking DCP's reader for the state of the parameters it
  owns and no other (counted at the reader), and its gathered state is the saved one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tandem
import tandem.checkpoint
from tandem.parallel.zero import ShardedOptimizer
from tests import models
from tests.harness import run_ranks
from tests.parallel.fsdp.models import as_nodes

pytestmark = pytest.mark.distributed

STEPS = 3
HYPER = {"lr": 0.01, "betas": (0.8, 0.95)}


def _groups(net: nn.Module) -> list[dict[str, Any]]:
    weights = [p for n, p in net.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in net.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]


def _names() -> list[str]:
    """The parameter names in the optimizer's order (the groups' order)."""
    net = models.mlp()
    by_id = {id(p): n for n, p in net.named_parameters()}
    return [by_id[id(p)] for g in _groups(net) for p in g["params"]]


def _trained(seed: int, hybrid: bool = False) -> tuple[tandem.DDP, ShardedOptimizer]:
    model = tandem.DDP(models.mlp(seed=seed))
    opt = ShardedOptimizer(_groups(model.module), torch.optim.AdamW, hybrid=hybrid, **HYPER)
    for step in range(STEPS):
        x, y = models.batch(step, dist.get_rank(), 4, (10,))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def _plain(model: nn.Module | None, full: dict | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A plain module and AdamW; with ``model`` and ``full``: holding their state."""
    net = models.mlp(seed=7)
    opt = torch.optim.AdamW(_groups(net), **HYPER)
    if model is not None and full is not None:
        net.load_state_dict(model.state_dict())
        opt.load_state_dict(full)
    return net, opt


def _equal(a: dict, b: dict) -> bool:
    """Two plain optimizer state dicts, bit for bit."""
    if a["param_groups"] != b["param_groups"] or set(a["state"]) != set(b["state"]):
        return False
    return all(
        set(s) == set(b["state"][i]) and all(torch.equal(v, b["state"][i][k]) for k, v in s.items())
        for i, s in a["state"].items()
    )


def _gathered(opt: ShardedOptimizer) -> dict:
    """The gathered state, on every rank."""
    box = [opt.full_state_dict(0)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _NoGather:
    """The gather of a ShardedOptimizer's state (``full_state_dict``) raises meanwhile."""

    def __enter__(self) -> None:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("the optimizer state was gathered during the save")

        self.full = ShardedOptimizer.full_state_dict
        ShardedOptimizer.full_state_dict = refuse  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        ShardedOptimizer.full_state_dict = self.full  # type: ignore[method-assign]


class _Reads:
    """The tensors DCP's reader puts into this process's state dict, by DCP key."""

    def __enter__(self) -> set[str]:
        self.fqns: set[str] = set()
        self.original = DefaultLoadPlanner.resolve_tensor

        def resolve(planner: Any, item: Any) -> torch.Tensor:
            self.fqns.add(item.dest_index.fqn)
            return self.original(planner, item)

        DefaultLoadPlanner.resolve_tensor = resolve  # type: ignore[method-assign]
        return self.fqns

    def __exit__(self, *exc: object) -> None:
        DefaultLoadPlanner.resolve_tensor = self.original  # type: ignore[method-assign]


def _owned_state_keys(opt: ShardedOptimizer) -> set[str]:
    names = _names()
    return {
        f"optimizer.state.{names[i]}.{k}"
        for i, owner in enumerate(opt.owners)
        if owner == opt.rank
        for k in ("step", "exp_avg", "exp_avg_sq")
    }


def _body(tmp: str, hybrid: bool = False) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    if hybrid:
        as_nodes(2)
    model, opt = _trained(seed=0, hybrid=hybrid)
    full = _gathered(opt)
    ours, theirs = Path(tmp, f"tandem-{ws}"), Path(tmp, f"torch-{ws}")
    state = {"model": model, "optimizer": opt, "step": STEPS}
    with _NoGather():
        tandem.checkpoint.save(state, ours, format="dcp")
    # torch's own save of the same state in a plain module and optimizer: what the gathered
    # version writes (rank 0 the whole state; DCP keeps one copy of what every rank passes).
    net, plain = _plain(model.module, full)
    msd, osd = get_state_dict(net, plain)
    dcp.save({"model": msd, "optimizer": osd, "step": STEPS}, checkpoint_id=theirs)
    if rank == 0:
        torch.save(full, Path(tmp, f"expected-{ws}.pt"))
    dist.barrier()
    mine = dcp.FileSystemReader(str(ours)).read_metadata()
    torch_md = dcp.FileSystemReader(str(theirs)).read_metadata()
    out["same_entries"] = mine.state_dict_metadata == torch_md.state_dict_metadata
    out["same_places"] = mine.planner_data == torch_md.planner_data
    # Hybrid: the row of global rank 0 writes (its group ranks are the global ones); every
    # other row holds the same state again and writes none of it.
    names = _names()
    files = {
        index.fqn: info.relative_path
        for index, info in (mine.storage_data or {}).items()
        if index.fqn.startswith("optimizer.state.")
    }
    out["files_by_owner"] = all(
        files[f"optimizer.state.{names[i]}.{k}"] == f"__{owner}_0.distcp"
        for i, owner in enumerate(opt.owners)
        for k in ("step", "exp_avg", "exp_avg_sq")
    ) and len(files) == 3 * len(names)

    # torch reads it into a plain module and optimizer, at this world size.
    net2, plain2 = _plain(None, None)
    msd, osd = get_state_dict(net2, plain2)
    loaded: dict = {"model": msd, "optimizer": osd, "step": 0}
    dcp.load(loaded, checkpoint_id=ours)
    set_state_dict(net2, plain2, model_state_dict=msd, optim_state_dict=osd)
    out["torch_reads"] = _equal(plain2.state_dict(), full) and loaded["step"] == STEPS
    out["torch_model"] = all(
        torch.equal(v, model.module.state_dict()[k]) for k, v in net2.state_dict().items()
    )

    # tandem reads per owner: here what 2 ranks wrote (at 2 and at 3 ranks).
    fresh_model, fresh = _trained(seed=5, hybrid=hybrid)  # another state, to be replaced
    with _Reads() as reads:
        back = {"model": fresh_model, "optimizer": fresh, "step": 0}
        tandem.checkpoint.load(back, Path(tmp, "tandem-2"))
    read_state = {f for f in reads if f.startswith("optimizer.state.")}
    out["reads_own_only"] = read_state == _owned_state_keys(fresh)
    expected = torch.load(Path(tmp, "expected-2.pt"), weights_only=True)
    out["tandem_reads"] = _equal(_gathered(fresh), expected) and back["step"] == STEPS
    return out


@pytest.mark.timeout(240)
def test_a_sharded_optimizer_is_written_and_read_by_its_owners(tmp_path: Path) -> None:
    at2 = run_ranks(_body, 2, args=(str(tmp_path),), timeout=100)
    at3 = run_ranks(_body, 3, args=(str(tmp_path),), timeout=100)
    for r in at2 + at3:
        assert all(r.values()), r


@pytest.mark.timeout(200)
def test_a_hybrid_sharded_optimizer_is_written_once_and_read_per_node(tmp_path: Path) -> None:
    run_ranks(_body, 2, args=(str(tmp_path),), timeout=100)  # the flat checkpoint it reads
    for r in run_ranks(_body, 4, args=(str(tmp_path), True), timeout=150):
        assert all(r.values()), r
