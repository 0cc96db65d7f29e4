"""Hybrid tandem.DDP: each bucket reduce-scattered in the node, its slice all-reduced across the
nodes, all-gathered in the node; equal to one process, every byte on each group accounted for.

4 real ranks on Gloo, laid out as 2 "nodes" of 2 (``LOCAL_WORLD_SIZE=2``, ``LOCAL_RANK``,
``GROUP_RANK`` as a 2-node torchrun sets them), all cases in one launch. Proven:

- **One process on the full batch is the oracle** (float64, within 1e-10, every rank): after 3
  SGD-with-momentum steps, hybrid tandem.DDP's parameters equal those of the plain model trained
  on the mean of the 4 ranks' losses, for an MLP whose parameters (3, 30, 6, 18, 3, 15
  elements) the node's 2 ranks divide unevenly, in one bucket of 75 elements and in a bucket
  per parameter (the padding of every odd size), with ``gradient_as_bucket_view``; with
  ``find_unused_parameters`` (a branch used on rank 0 only, and on even steps on no rank: its
  ``.grad`` then stays None, as the oracle's); with ``no_sync`` accumulation (2 micro-batches a
  step); and inside ``model.join()`` with one rank running out a step early.
- **Flat tandem.DDP** over the 4 ranks gives the same parameters within 1e-6 (float32): only the
  order of the additions differs.
- **Three ways to say it**: ``hybrid=True``, ``shard_group=``/``replicate_group=`` from
  ``tandem.groups.partition`` / ``strided``, and a 2-D ``DeviceMesh``'s groups train
  bitwise alike (losses and parameters), and are hybrid (``model.grid``).
- **Bytes per group per step** (tandem.doctor's counter), to the byte, for 3 steps, against
  formulas from the plain model's parameter sizes: within the node, per bucket of ``n`` float32
  elements padded to ``p`` (a multiple of 2), the reduce-scatter's ``4p`` and the all-gather's
  ``4p/2``; across the nodes the all-reduce of the slice, ``4p/2``, nothing else; on the whole
  grid the 4-byte end-of-backward check (and rank 0's bucket-order broadcast when the buckets
  are rebuilt). Flat DDP for contrast: ``4 x 75`` bytes a step, all on the world group.
- **Errors** on every rank, naming the values: ``hybrid=True`` with ``comm_hook=`` or with
  ``process_group=``, ``replicate_group=`` without ``shard_group=``, groups that form no grid,
  ``register_comm_hook`` on a hybrid model; the ranks go on in step afterwards.

Mutants tried (each failed this module): the hybrid hook without its all-reduce across the
nodes; the reduce-scatter over the world instead of the node; the padding dropped (the
odd-sized buckets then raise in the reduce-scatter).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem
from tandem.doctor import records, step_clock
from tandem.parallel.ddp.comm_hooks import allreduce_hook
from tests.harness import run_ranks
from tests.parallel.fsdp.models import as_nodes, refused

WORLD, PER_NODE, PER_RANK, STEPS = 4, 2, 4, 3
F64, F32 = torch.float64, torch.float32
TINY = 1e-6  # bucket_cap_mb: one parameter per bucket once the buckets are rebuilt


class Net(nn.Module):
    """Parameters of 3, 30, 6, 18, 3 and 15 elements (75 in all): 2 divides few of them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.out = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.extra = nn.Linear(5, 3, bias=False)

    def forward(self, x: torch.Tensor, extra: bool = True) -> torch.Tensor:
        y = self.out(torch.tanh(self.inp(x))) * self.scale
        return y + self.extra(x) if extra else y


def _net(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(7)
    return Net().to(dtype)


def _data(step: int, micro: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's batch of this step and micro-step (any rank can compute any rank's)."""
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(WORLD * PER_RANK, 5, generator=g, dtype=F64).to(dtype)
    y = torch.randn(WORLD * PER_RANK, 3, generator=g, dtype=F64).to(dtype)
    cut = [slice(r * PER_RANK, (r + 1) * PER_RANK) for r in range(WORLD)]
    return [(x[mine], y[mine]) for mine in cut]


def _always(step: int, rank: int) -> bool:
    return True


def _rank0_odd_steps(step: int, rank: int) -> bool:
    return rank == 0 and step % 2 == 1  # even steps: the branch is used on no rank


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train_ddp(model, dtype, micro=1, extra=_always, steps=STEPS) -> list[torch.Tensor]:
    """``steps`` steps of this rank's data (``micro`` micro-batches, all but the last under
    no_sync); the parameters after them."""
    rank, opt, losses = dist.get_rank(), _sgd(model.parameters()), []
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = _data(step, m, dtype)[rank]
            with model.no_sync() if m < micro - 1 else nullcontext():
                loss = F.mse_loss(model(x, extra=extra(step, rank)), y)
                loss.backward()
            losses.append(loss.detach())
        opt.step()
    return [p.detach().clone() for p in model.parameters()] + losses


def _train_oracle(dtype, micro=1, extra=_always, batches=(STEPS,) * WORLD) -> list[torch.Tensor]:
    """The plain model, one process: each step the mean over the 4 ranks of their losses
    (a rank past its ``batches`` adds nothing, as a joined rank adds zeros)."""
    net = _net(dtype)
    opt = _sgd(net.parameters())
    for step in range(max(batches)):
        opt.zero_grad()
        for m in range(micro):
            pieces = [
                F.mse_loss(net(x, extra=extra(step, r)), y)
                for r, (x, y) in enumerate(_data(step, m, dtype))
                if step < batches[r]
            ]
            (sum(pieces) / WORLD).backward()  # type: ignore[union-attr]
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _max_diff(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, expected, strict=False))


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _oracle_cases() -> dict:
    rank, out = dist.get_rank(), {}
    ddp = tandem.DDP
    for name, kwargs in {
        "mlp, a bucket per parameter": {"bucket_cap_mb": TINY},
        "mlp, one bucket of 75": {"bucket_cap_mb": 25},
        "mlp, gradient_as_bucket_view": {"bucket_cap_mb": TINY, "gradient_as_bucket_view": True},
    }.items():
        model = ddp(_net(F64), hybrid=True, **kwargs)
        out[name] = (_max_diff(_train_ddp(model, F64), _train_oracle(F64)), model.grid is not None)
    model = ddp(_net(F64), hybrid=True, find_unused_parameters=True, bucket_cap_mb=TINY)
    got = _train_ddp(model, F64, extra=_rank0_odd_steps)
    # The last step (even): the branch is used on no rank; its .grad stays None (the oracle's
    # too).
    none_after = model.module.extra.weight.grad is None
    out["find_unused_parameters"] = (
        _max_diff(got, _train_oracle(F64, extra=_rank0_odd_steps)),
        none_after,
    )
    model = ddp(_net(F64), hybrid=True, bucket_cap_mb=TINY)
    out["no_sync"] = (_max_diff(_train_ddp(model, F64, micro=2), _train_oracle(F64, micro=2)), True)
    batches = (STEPS, STEPS, STEPS - 1, STEPS)  # rank 2 runs out one step early
    model = ddp(_net(F64), hybrid=True, bucket_cap_mb=TINY)
    with model.join():
        _train_ddp(model, F64, steps=batches[rank])
    # Read after the context: leaving it, every rank takes the last joiner's parameters.
    got = [p.detach().clone() for p in model.parameters()]
    out["join"] = (_max_diff(got, _train_oracle(F64, batches=batches)), True)
    return out


def _flat_and_three_ways() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    rows, columns = tandem.groups.partition(PER_NODE), tandem.groups.strided(PER_NODE)
    mesh = init_device_mesh("cpu", (WORLD // PER_NODE, PER_NODE))
    ways = {
        "hybrid=True": {"hybrid": True},
        "groups": {"shard_group": rows.group, "replicate_group": columns.group},
        # A 2-D mesh's groups (torch's DDP, and so tandem.DDP, refuse the mesh itself).
        "2-D mesh": {"shard_group": mesh.get_group(1), "replicate_group": mesh.get_group(0)},
    }
    runs, grids = {}, {}
    for name, kwargs in ways.items():
        model = tandem.DDP(_net(F32), bucket_cap_mb=TINY, **kwargs)
        grids[name] = None if model.grid is None else model.grid.describe()
        runs[name] = _train_ddp(model, F32)
    flat = _train_ddp(tandem.DDP(_net(F32), bucket_cap_mb=TINY), F32)
    first = runs["hybrid=True"]
    return {
        "grids": grids,
        "bitwise": {n: _bitwise(r, first) for n, r in runs.items()},
        "flat": _max_diff(first, flat),
        "flat is not bitwise": not _bitwise(first, flat),
    }


def _handed(model, steps: int = STEPS) -> list[dict[str, int]]:
    """Bytes this rank handed per group in each training step (the doctor's counter)."""
    rank, opt, per_step = dist.get_rank(), _sgd(model.parameters()), []
    for step in range(steps):
        before = step_clock.handed_so_far()
        opt.zero_grad()
        x, y = _data(step, 0, F32)[rank]
        F.mse_loss(model(x), y).backward()
        opt.step()
        after = step_clock.handed_so_far()
        per_step.append({g: n - before.get(g, 0) for g, n in after.items() if n != before.get(g)})
    return per_step


def _bytes() -> dict:
    hybrid = tandem.DDP(_net(F32), hybrid=True, bucket_cap_mb=TINY)
    flat = tandem.DDP(_net(F32), bucket_cap_mb=TINY)
    return {
        "names": {
            "world": records.group_name(None),
            "node": records.group_name(hybrid.shard_group),
            "across": records.group_name(hybrid.replicate_group),
        },
        "hybrid": _handed(hybrid),
        "flat": _handed(flat),
    }


def _errors() -> dict:
    rank = dist.get_rank()
    rows, columns = tandem.groups.partition(PER_NODE), tandem.groups.strided(PER_NODE)
    crossed = [dist.new_group(r) for r in ([0, 3], [1, 2])]  # not the same place of each row
    crossed_mine = crossed[0] if rank in (0, 3) else crossed[1]

    def build(**kwargs):
        return refused(lambda: tandem.DDP(_net(F32), **kwargs))

    hybrid = tandem.DDP(_net(F32), hybrid=True)
    out = {
        "hybrid + comm_hook": build(hybrid=True, comm_hook=allreduce_hook),
        "groups + comm_hook": build(
            shard_group=rows.group, replicate_group=columns.group, comm_hook=allreduce_hook
        ),
        "hybrid + process_group": build(hybrid=True, process_group=rows.group),
        "replicate alone": build(replicate_group=columns.group),
        "not a grid": build(shard_group=rows.group, replicate_group=crossed_mine),
        "register_comm_hook": refused(lambda: hybrid.register_comm_hook(None, allreduce_hook)),
    }
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank still in step after all of them
    out["after"] = t.item()
    return out


def _ranks() -> dict:
    as_nodes(PER_NODE)
    return {
        "oracle": _oracle_cases(),
        "ways": _flat_and_three_ways(),
        "bytes": _bytes(),
        "errors": _errors(),
    }


@pytest.fixture(scope="module")
def hybrid_ranks() -> list[dict]:
    return run_ranks(_ranks, WORLD, timeout=180)


ORACLE_CASES = [
    "mlp, a bucket per parameter",
    "mlp, one bucket of 75",
    "mlp, gradient_as_bucket_view",
    "find_unused_parameters",
    "no_sync",
    "join",
]


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ORACLE_CASES)
def test_hybrid_equals_one_process_on_the_full_batch(hybrid_ranks, case):
    for rank, r in enumerate(hybrid_ranks):
        diff, flag = r["oracle"][case]
        assert diff <= 1e-10, (rank, case, diff)
        assert flag, (rank, case)  # hybrid indeed; with unused parameters, None stayed None


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_hybrid_by_node_groups_and_mesh_are_bitwise_alike_and_near_flat(hybrid_ranks):
    for rank, r in enumerate(hybrid_ranks):
        w = r["ways"]
        assert set(w["grids"].values()) == {"2 x 2 ranks (replicate x shard)"}, (rank, w)
        assert all(w["bitwise"].values()), (rank, w["bitwise"])
        assert w["flat"] <= 1e-6, (rank, w["flat"])
        # Not vacuous: the hybrid sums really are other additions than the flat ones.
        assert w["flat is not bitwise"] or w["flat"] == 0.0, rank


def _expected(numels: list[int], names: dict, rank: int) -> tuple[list[dict], list[dict]]:
    """Per step, the bytes (hybrid, flat) this rank hands each group: buckets of float32
    gradients; the first backward reduces one bucket of everything, the second forward
    rebuilds them (one parameter each here) after rank 0 broadcasts the order (int64s)."""

    def padded(n: int) -> int:
        return -(-n // PER_NODE) * PER_NODE

    hybrid, flat = [], []
    for step in range(STEPS):
        buckets = [sum(numels)] if step == 0 else numels
        rebuild = 8 * len(numels) if step == 1 and rank == 0 else 0
        node = sum(F32_BYTES * (padded(n) + padded(n) // PER_NODE) for n in buckets)
        across = sum(F32_BYTES * padded(n) // PER_NODE for n in buckets)
        check = 4  # the end-of-backward check: one int32, over the whole grid
        hybrid.append(
            {names["node"]: node, names["across"]: across, names["world"]: check + rebuild}
        )
        # Flat: one all-reduce of every bucket; the check rides in the last bucket (CPU).
        flat.append({names["world"]: F32_BYTES * sum(numels) + rebuild})
    return hybrid, flat


F32_BYTES = 4


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_bytes_per_group_per_step_equal_the_formulas(hybrid_ranks):
    numels = [p.numel() for p in Net().parameters()]
    assert numels == [3, 30, 6, 18, 3, 15], numels
    for rank, r in enumerate(hybrid_ranks):
        b = r["bytes"]
        names = b["names"]
        assert len(set(names.values())) == 3 and "ddp shard" in names["node"], names
        assert "ddp replicate" in names["across"], names
        hybrid, flat = _expected(numels, names, rank)
        assert b["hybrid"] == hybrid, (rank, b["hybrid"], hybrid)
        assert b["flat"] == flat, (rank, b["flat"], flat)
        # The point of it: across the nodes, half (1/PER_NODE) of a flat all-reduce's bytes
        # (and the padding of the odd-sized buckets).
        across = hybrid[2][names["across"]]
        assert across == F32_BYTES * (2 + 15 + 3 + 9 + 2 + 8), across


EXPECTED = {
    "hybrid + comm_hook": ["comm_hook='allreduce_hook' with a hybrid grid"],
    "groups + comm_hook": ["comm_hook='allreduce_hook' with a hybrid grid"],
    "hybrid + process_group": ["process_group and hybrid=True both say which ranks"],
    "replicate alone": ["replicate_group= without shard_group="],
    "not a grid": ["do not form a grid", "holds different slices"],
    "register_comm_hook": ["register_comm_hook('allreduce_hook') on a hybrid model (2 x 2 ranks"],
}


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mistake", list(EXPECTED))
def test_bad_arguments_raise_on_every_rank_naming_them(hybrid_ranks, mistake):
    for rank, r in enumerate(h["errors"] for h in hybrid_ranks):
        message = r[mistake]
        assert message is not None, (rank, mistake)
        for words in EXPECTED[mistake]:
            assert words in message, (rank, message)
        assert "tandem.DDP" in message, (rank, message)
        assert r["after"] == 4.0, rank


def test_one_process_hybrid_is_plain_ddp():
    # No process group: hybrid=True is a plain model's gradient, nothing sent.
    model = tandem.DDP(_net(F64), hybrid=True)
    plain = _net(F64)
    x, y = _data(0, 0, F64)[0]
    F.mse_loss(model(x), y).backward()
    F.mse_loss(plain(x), y).backward()
    assert model.grid is None and model.shard_group is None
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
