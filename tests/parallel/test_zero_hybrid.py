"""Hybrid tandem.ShardedOptimizer (ZeRO-1): the state sharded within the node, each node a full
copy; the updated parameters exchanged within the node only; checkpoints at any layout.

4 real ranks on Gloo as 2 "nodes" of 2 (the launcher's ``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``,
``GROUP_RANK``), one launch. Gradients come from hybrid tandem.DDP in every run, so every
optimizer sees the same gradients and the per-parameter update is the same arithmetic. Proven:

- **Bitwise** (3 steps, float32, SGD with momentum and AdamW): ``ShardedOptimizer(hybrid=True)``,
  the same with ``shard_group=``/``replicate_group=``, the flat ``ShardedOptimizer`` over the 4
  ranks and a plain optimizer end with the same parameters and losses on every rank.
- **State per rank**: a rank holds the state of the parameters it owns among its node's 2 ranks
  (the flat rule at the node's size, ``assign_owners(sizes, 2)``): the 2 ranks of a node
  together hold exactly the plain optimizer's state bytes (a whole copy per node, not half of
  one), and rank i of each node holds the same parameters' state.
- **Bytes per group in step()** (tandem.doctor's counter), to the byte: each rank broadcasts its
  own parameters' new values (``4 x`` their elements) in its node's group and hands nothing to
  any other group; a node's two ranks hand ``4 x`` every element once. The flat optimizer, for
  contrast, hands them in the world group.
- **Checkpoints**: ``state_dict()``/``load_state_dict()`` at the same layout, and
  ``full_state_dict()`` gathered to rank 0 then loaded into the hybrid, the flat and a plain
  optimizer, each resume 2 steps bitwise as the uninterrupted run. Through ``tandem.checkpoint``:
  ``kind="full"`` resumes bitwise at the same layout, and on 1 node of 4 (flat, its DDP flat too:
  within 1e-6); ``kind="sharded"`` at the same layout; the hybrid run's shard files read by the
  adapter at another world size (1 process here) give the full state exactly; read on one node
  of 4 (as many processes, another layout: regrouped as at another world size) they resume
  within 1e-6 (the DDP there is flat).
- **Errors** on every rank: ``hybrid=True`` with ``process_group=``, ``replicate_group=`` alone,
  groups that form no grid.

Mutants tried (each failed this module): owners over the world (``assign_owners`` of 4) instead
of the node; the exchange broadcast over the world group instead of the node's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem
from tandem import checkpoint
from tandem.doctor import records, step_clock
from tandem.parallel.adapters import ZeroOptimizer
from tandem.parallel.sharding import assign_owners
from tests.harness import run_ranks
from tests.parallel.fsdp.models import as_nodes, refused

WORLD, PER_NODE, PER_RANK, STEPS = 4, 2, 4, 3
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def _net() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))


SIZES = [p.numel() for p in _net().parameters()]  # 40, 8, 48, 6, 18, 3


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randn(WORLD * PER_RANK, 5, generator=g)
    y = torch.randn(WORLD * PER_RANK, 3, generator=g)
    mine = slice(PER_RANK * dist.get_rank(), PER_RANK * (dist.get_rank() + 1))
    return x[mine], y[mine]


def _build(optimizer: str, how: str):
    """Hybrid tandem.DDP and the optimizer ``how`` says."""
    model = tandem.DDP(_net(), hybrid=True)
    cls, kwargs = OPTIMIZERS[optimizer]
    if how == "plain":
        return model, cls(model.parameters(), **kwargs)
    if how == "groups":
        rows, columns = tandem.groups.partition(PER_NODE), tandem.groups.strided(PER_NODE)
        kwargs = {**kwargs, "shard_group": rows.group, "replicate_group": columns.group}
    elif how == "hybrid":
        kwargs = {**kwargs, "hybrid": True}
    return model, tandem.ShardedOptimizer(model.parameters(), cls, **kwargs)


def _steps(model, opt, first: int, count: int) -> list[torch.Tensor]:
    losses = []
    for step in range(first, first + count):
        opt.zero_grad()
        x, y = _data(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _result(model, losses) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + losses


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _parity() -> dict:
    out = {}
    for optimizer in OPTIMIZERS:
        runs, state = {}, {}
        for how in ("hybrid", "groups", "flat", "plain"):
            model, opt = _build(optimizer, how)
            runs[how] = _result(model, _steps(model, opt, 0, STEPS))
            if how != "plain":
                state[how] = opt.inner_state_bytes
            else:
                state[how] = sum(
                    t.numel() * t.element_size()
                    for s in opt.state.values()
                    for t in s.values()
                    if isinstance(t, torch.Tensor)
                )
        out[optimizer] = {
            "bitwise": {how: _same(r, runs["plain"]) for how, r in runs.items()},
            "state": state,
        }
    return out


def _bytes() -> dict:
    out = {}
    for how in ("hybrid", "flat"):
        model, opt = _build("sgd", how)
        per_step = []
        for step in range(2):
            opt.zero_grad()
            x, y = _data(step)
            F.mse_loss(model(x), y).backward()
            before = step_clock.handed_so_far()
            opt.step()  # only the optimizer's own collectives are counted
            after = step_clock.handed_so_far()
            per_step.append(
                {g: n - before.get(g, 0) for g, n in after.items() if n != before.get(g)}
            )
        out[how] = {"steps": per_step, "group": records.group_name(opt.process_group)}
    return out


def _from_rank0(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _checkpoints(tmp: str) -> dict:
    model, opt = _build("adamw", "hybrid")
    _steps(model, opt, 0, 2)
    model_state = copy.deepcopy(model.module.state_dict())
    shard = copy.deepcopy(opt.state_dict())
    full = copy.deepcopy(opt.full_state_dict(to=0))  # a copy: its tensors are the live state
    on_rank0 = full is not None
    full = _from_rank0(full)
    checkpoint.save({"model": model, "optimizer": opt}, Path(tmp, "full.pt"), kind="full")
    checkpoint.save({"model": model, "optimizer": opt}, Path(tmp, "sharded.pt"), kind="sharded")
    uninterrupted = _result(model, _steps(model, opt, 2, 2))

    def resumed(how: str, load) -> float:
        """The largest difference from the uninterrupted run after 2 more steps."""
        again, again_opt = _build("adamw", how)
        load(again, again_opt)
        got = _result(again, _steps(again, again_opt, 2, 2))
        return max((a - b).abs().max().item() for a, b in zip(got, uninterrupted, strict=True))

    # Each load gets copies: a loaded optimizer steps in the tensors of the dict it was given.
    def by_hand(state):
        def load(m, o):
            m.module.load_state_dict(model_state)
            mine = copy.deepcopy(state)
            o.load_state_dict(mine) if state is shard else o.load_full_state_dict(mine)

        return load

    def plain_full(m, o):
        m.module.load_state_dict(model_state)
        o.load_state_dict(copy.deepcopy(full))

    def through(name: str):
        return lambda m, o: checkpoint.load({"model": m, "optimizer": o}, Path(tmp, name))

    out = {
        "full on rank 0 only": on_rank0 == (dist.get_rank() == 0),
        "state_dict, same layout": resumed("hybrid", by_hand(shard)),
        "full_state_dict into hybrid": resumed("hybrid", by_hand(full)),
        "full_state_dict into flat": resumed("flat", by_hand(full)),
        "full_state_dict into plain": resumed("plain", plain_full),
        "checkpoint full, same layout": resumed("hybrid", through("full.pt")),
        "checkpoint sharded, same layout": resumed("hybrid", through("sharded.pt")),
        "full state": full,
        "shard": shard,
    }
    as_nodes(4)  # one node of 4: hybrid=True is the flat optimizer over the 4 ranks
    # (its DDP is flat too: other additions than the hybrid one's, so within rounding only)
    out["checkpoint full, one node of 4"] = resumed("hybrid", through("full.pt"))
    # As many processes on another layout: the state is regrouped as at another world size.
    out["checkpoint sharded, one node of 4"] = resumed("flat", through("sharded.pt"))
    as_nodes(PER_NODE)
    return out


def _errors() -> dict:
    rank = dist.get_rank()
    rows, columns = tandem.groups.partition(PER_NODE), tandem.groups.strided(PER_NODE)
    crossed = [dist.new_group(r) for r in ([0, 3], [1, 2])]
    crossed_mine = crossed[0] if rank in (0, 3) else crossed[1]
    params = list(_net().parameters())

    def build(**kwargs):
        return refused(lambda: tandem.ShardedOptimizer(params, torch.optim.SGD, lr=0.1, **kwargs))

    out = {
        "hybrid + process_group": build(hybrid=True, process_group=rows.group),
        "replicate alone": build(replicate_group=columns.group),
        "not a grid": build(shard_group=rows.group, replicate_group=crossed_mine),
    }
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = t.item()
    return out


def _ranks(tmp: str) -> dict:
    as_nodes(PER_NODE)
    return {
        "parity": _parity(),
        "bytes": _bytes(),
        "checkpoints": _checkpoints(tmp),
        "errors": _errors(),
    }


@pytest.fixture(scope="module")
def zero_ranks(tmp_path_factory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("zero-hybrid"))
    return run_ranks(_ranks, WORLD, args=(tmp,), timeout=180)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_hybrid_equals_flat_and_plain_bitwise(zero_ranks, optimizer):
    for rank, r in enumerate(zero_ranks):
        bitwise = r["parity"][optimizer]["bitwise"]
        assert set(bitwise) == {"hybrid", "groups", "flat", "plain"}, bitwise
        assert all(bitwise.values()), (rank, optimizer, bitwise)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_state_is_split_over_the_node_not_the_world(zero_ranks, optimizer):
    plain = zero_ranks[0]["parity"][optimizer]["state"]["plain"]
    owners = assign_owners([4 * n for n in SIZES], PER_NODE)  # the flat rule, at the node's size
    for rank, r in enumerate(zero_ranks):
        state = r["parity"][optimizer]["state"]
        mine = [i for i, o in enumerate(owners) if o == rank % PER_NODE]
        if optimizer == "sgd":  # one momentum buffer per parameter
            expected = sum(4 * SIZES[i] for i in mine)
        else:  # exp_avg, exp_avg_sq and a float32 step per parameter
            expected = sum(2 * 4 * SIZES[i] + 4 for i in mine)
        assert state["hybrid"] == state["groups"] == expected, (rank, state, expected)
    for node in range(WORLD // PER_NODE):
        ranks = range(node * PER_NODE, (node + 1) * PER_NODE)
        held = sum(zero_ranks[q]["parity"][optimizer]["state"]["hybrid"] for q in ranks)
        assert held == plain, (node, held, plain)  # a whole copy per node
    flat = sum(r["parity"][optimizer]["state"]["flat"] for r in zero_ranks)
    assert flat == plain  # the flat one: one copy over the world


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_step_exchanges_parameters_within_the_node_only(zero_ranks):
    owners = assign_owners([4 * n for n in SIZES], PER_NODE)
    for rank, r in enumerate(zero_ranks):
        hybrid, flat = r["bytes"]["hybrid"], r["bytes"]["flat"]
        assert "zero shard" in hybrid["group"], hybrid["group"]
        sent = 4 * sum(n for n, o in zip(SIZES, owners, strict=True) if o == rank % PER_NODE)
        assert hybrid["steps"] == [{hybrid["group"]: sent}] * 2, (rank, hybrid)
        assert all(set(s) == {"world"} for s in flat["steps"]), (rank, flat)
    for node in range(WORLD // PER_NODE):
        ranks = range(node * PER_NODE, (node + 1) * PER_NODE)
        per_node = sum(sum(zero_ranks[q]["bytes"]["hybrid"]["steps"][0].values()) for q in ranks)
        assert per_node == 4 * sum(SIZES), (node, per_node)  # every element once per node


CHECKPOINT_CASES = [
    "full on rank 0 only",
    "state_dict, same layout",
    "full_state_dict into hybrid",
    "full_state_dict into flat",
    "full_state_dict into plain",
    "checkpoint full, same layout",
    "checkpoint sharded, same layout",
    "checkpoint full, one node of 4",
    "checkpoint sharded, one node of 4",
]


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_checkpoints_resume_as_the_uninterrupted_run(zero_ranks, case):
    # Bitwise, except on one node of 4, where tandem.DDP(hybrid=True) is flat DDP too.
    tolerance = 1e-6 if case.endswith("one node of 4") else 0.0
    for rank, r in enumerate(zero_ranks):
        got = r["checkpoints"][case]
        if case == "full on rank 0 only":
            assert got is True, rank
        else:
            assert got <= tolerance, (rank, case, got)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_sharded_files_of_a_hybrid_run(zero_ranks):
    # At another world size (1 process): the adapter reads node 0's files and gets every slice.
    files = {q: {"optimizer": r["checkpoints"]["shard"]} for q, r in enumerate(zero_ranks)}
    read: list[int] = []

    def reader(q: int) -> dict:
        read.append(q)
        return files[q]

    opt = tandem.ShardedOptimizer(_net().parameters(), torch.optim.AdamW, lr=0.01)
    opt.load_state_dict(ZeroOptimizer(opt).reshard("optimizer", WORLD, reader))
    full = zero_ranks[0]["checkpoints"]["full state"]
    assert set(read) <= {0, 1}, read  # node 0's files hold every slice
    got = opt.full_state_dict()
    assert got is not None and got["state"].keys() == full["state"].keys()
    for i, s in full["state"].items():
        for k, v in s.items():
            assert torch.equal(got["state"][i][k], v), (i, k)


EXPECTED = {
    "hybrid + process_group": ["process_group and hybrid=True both say which ranks"],
    "replicate alone": ["replicate_group= without shard_group="],
    "not a grid": ["do not form a grid", "holds different slices"],
}


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mistake", list(EXPECTED))
def test_bad_arguments_raise_on_every_rank(zero_ranks, mistake):
    for rank, r in enumerate(h["errors"] for h in zero_ranks):
        message = r[mistake]
        assert message is not None and "tandem.ShardedOptimizer" in message, (rank, message)
        for words in EXPECTED[mistake]:
            assert words in message, (rank, message)
        assert r["after"] == 4.0, rank
