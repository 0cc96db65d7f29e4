"""tandem's FSDP writes DCP checkpoints as each rank's own slices and reads only its slices back.

The oracle is torch: its own DCP reader and writer, FSDP2 ``fully_shard`` with its state-dict
helpers, and its one-process conversion ``dcp_to_torch_save``, over Gloo in real processes. The
model's tensors are cut by tandem's flat shards mid-row: sizes that no world size here divides,
a 3-d weight (a run of its elements is 5 boxes), and, in a second model, a 0-d parameter
(FSDP2 refuses those; tandem and torch's plain tools take them). AdamW after 3 steps. Proven,
``torch.equal`` everywhere:

- **tandem writes sharded**: tandem.FullyShardedDataParallel at 2 processes saves model and
  AdamW with no gather at all (every path by which tandem gathers a unit raises during the
  save), and each rank's file holds exactly the elements of its own flat slices (counted from
  the metadata's chunks and files against the sharding rule); the metadata lists the keys,
  shapes and dtypes of FSDP2's own checkpoint of the same model at 2 processes.
- **torch reads it**: in one process (``dcp.load`` into a plain module's state dict, and
  ``dcp_to_torch_save``, optimizer state by parameter name) and into FSDP2 at 3 processes
  (``get_state_dict`` / ``set_state_dict``): the state tandem had, gathered, bit for bit.
- **tandem reads by slices**: tandem FSDP at 3 processes loads FSDP2's checkpoint written at 2
  and tandem's own written at 2, each rank asking DCP's reader for exactly the elements of its
  own slices (model and AdamW moments; counted at the reader), bit for bit.
- errors: a model of another shape is a ValueError on every rank naming the path and key,
  before anything is read.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

import tandem
import tandem.checkpoint
from tandem.checkpoint.dcp import boxes
from tandem.parallel.sharding import flat_shard
from tests.harness import run_ranks

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:
    pytest.skip("this torch has no FSDP2 (fully_shard)", allow_module_level=True)

pytestmark = pytest.mark.distributed

STEPS = 3
UNITS = ("inp", "conv", "out")  # tandem's units and FSDP2's groups, the root besides
FULL = StateDictOptions(full_state_dict=True)


class Odd(nn.Module):
    """Tensors no world size here divides: (5, 7), (5, 3, 3), (3, 5), biases of 5 and 3, a
    scale of shape (1,) (FSDP2's) or () (``scalar=True``), and a buffer."""

    def __init__(self, scalar: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 5)
        self.conv = nn.Conv1d(3, 5, 3, padding=1)
        self.out = nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.tensor(1.5) if scalar else torch.tensor([1.5]))
        self.register_buffer("shift", torch.tensor([0.25, -0.5, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))  # (B, 5)
        c = self.conv(h.unsqueeze(1).expand(-1, 3, -1)).mean(-1)  # (B, 5)
        return self.out(c * self.scale) + self.shift


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    rank = dist.get_rank()
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _ours(seed: int, scalar: bool = False, net: nn.Module | None = None) -> Any:
    torch.manual_seed(seed)
    net = Odd(scalar) if net is None else net
    picked = {id(net.get_submodule(n)) for n in UNITS}
    return tandem.FullyShardedDataParallel(net, stage=3, auto_wrap=lambda m: id(m) in picked)


def _theirs(seed: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(seed)
    net = Odd()
    for name in UNITS:
        fully_shard(net.get_submodule(name), mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


# -- plain views of a state, to compare -----------------------------------------------------------


def _by_name(names: list[str], model: dict, optim: dict) -> dict:
    """A model state dict and a plain optimizer's (by position over ``names``), by name."""
    state = {names[i]: dict(s) for i, s in optim["state"].items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim["param_groups"]]
    return {"model": dict(model), "state": state, "groups": groups}


def _torch_full(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, opt, options=FULL)
    groups: Any = osd["param_groups"]
    return {
        "model": dict(msd),
        "state": {n: dict(s) for n, s in osd["state"].items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
    }


def _ours_full(model: Any, opt: torch.optim.Optimizer, scalar: bool = False) -> dict | None:
    """tandem FSDP's gathered state on rank 0 (None elsewhere), by name."""
    msd, osd = model.full_state_dict(), model.full_optim_state_dict(opt)
    names = [n for n, _ in Odd(scalar).named_parameters()]
    return None if msd is None or osd is None else _by_name(names, msd, osd)


def _differences(a: dict | None, b: dict | None) -> list[str]:
    """What differs between two states by name (bitwise); [] where rank 0's is None."""
    if a is None or b is None:
        return []
    out = [f"groups {a['groups']} != {b['groups']}"] if a["groups"] != b["groups"] else []
    if set(a["model"]) != set(b["model"]) or set(a["state"]) != set(b["state"]):
        return [*out, f"keys {sorted(a['model'])}/{sorted(a['state'])} vs {sorted(b['model'])}"]
    out += [f"model {k}" for k, v in a["model"].items() if not torch.equal(v, b["model"][k])]
    for name, s in a["state"].items():
        theirs = b["state"][name]
        if set(s) != set(theirs):
            out.append(f"state {name} keys {sorted(s)} vs {sorted(theirs)}")
            continue
        out += [f"state {name}.{k}" for k, v in s.items() if not torch.equal(v, theirs[k])]
    return out


def _owned(model: Any) -> int:
    """How many parameter elements this rank's flat slices hold (the sharding rule, padding
    left out): what it may write, and what it may read, of the model and of each moment."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    total = 0
    for unit in model.layout.units:
        start, stop = flat_shard(unit.numel, ws, rank)
        total += max(0, min(stop, unit.numel) - start)
    return total


# -- the proofs run by the ranks ------------------------------------------------------------------


def _refusing_gathers():
    """Every path by which tandem gathers a unit or an optimizer state, raising: a DCP save
    must need none of them."""
    from tandem.parallel.fsdp import state as fsdp_state
    from tandem.parallel.fsdp.flat import FlatUnit

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a DCP save gathered a whole unit")

    saved = {(FlatUnit, n): getattr(FlatUnit, n) for n in ("unshard", "gather", "gather_exact")}
    saved[(fsdp_state, "all_gather_flat")] = fsdp_state.all_gather_flat
    for owner, name in saved:
        setattr(owner, name, refuse)
    return saved


def _write_at_2(tmp: str) -> dict:
    rank = dist.get_rank()
    out: dict = {}
    for scalar, name in ((False, "tandem"), (True, "tandem-0d")):
        ours = _ours(seed=3, scalar=scalar)
        opt = _adamw(ours.parameters())
        _train(ours, opt)
        patched = _refusing_gathers()
        try:
            tandem.checkpoint.save({"model": ours, "optimizer": opt}, Path(tmp, name), format="dcp")
        finally:
            for (owner, attr), fn in patched.items():
                setattr(owner, attr, fn)
        full = _ours_full(ours, opt, scalar)
        if rank == 0:
            torch.save(full, Path(tmp, f"{name}.expected.pt"))
        out[f"owned-{name}"] = _owned(ours)
    # FSDP2 of the same model at 2: its metadata is the one to match; tandem reads it at 3.
    theirs = _theirs(seed=5)
    topt = _adamw(theirs.parameters())
    _train(theirs, topt)
    msd, osd = get_state_dict(theirs, topt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=Path(tmp, "fsdp2"))
    full = _torch_full(theirs, topt)
    if rank == 0:
        torch.save(full, Path(tmp, "fsdp2.expected.pt"))
    return out


def _counting_reads():
    """Record, per DCP key, how many elements this rank asks DCP's reader for."""
    from torch.distributed.checkpoint.planner import LoadItemType

    asked: dict[str, int] = {}
    original = dcp.FileSystemReader.read_data

    def read_data(self, plan, planner):
        for item in plan.items:
            if item.type == LoadItemType.TENSOR:
                fqn = item.dest_index.fqn
                asked[fqn] = asked.get(fqn, 0) + math.prod(item.lengths)
        return original(self, plan, planner)

    dcp.FileSystemReader.read_data = read_data
    return asked, original


def _read_at_3(tmp: str) -> dict:
    out: dict = {}
    # FSDP2 at 3 loads what tandem wrote at 2.
    theirs = _theirs(seed=11)
    topt = _adamw(theirs.parameters())
    msd, osd = get_state_dict(theirs, topt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=Path(tmp, "tandem"))
    set_state_dict(theirs, topt, model_state_dict=msd, optim_state_dict=osd)
    expected = torch.load(Path(tmp, "tandem.expected.pt"), weights_only=True)
    out["fsdp2_reads_tandem"] = _differences(_torch_full(theirs, topt), expected)
    # tandem FSDP at 3 loads FSDP2's checkpoint and tandem's own, both written at 2.
    for source, scalar in (("fsdp2", False), ("tandem", False), ("tandem-0d", True)):
        ours = _ours(seed=13, scalar=scalar)
        opt = _adamw(ours.parameters())
        asked, original = _counting_reads()
        try:
            tandem.checkpoint.load({"model": ours, "optimizer": opt}, Path(tmp, source))
        finally:
            dcp.FileSystemReader.read_data = original
        expected = torch.load(Path(tmp, f"{source}.expected.pt"), weights_only=True)
        out[f"tandem_reads_{source}"] = _differences(_ours_full(ours, opt, scalar), expected)
        params = {n for n, _ in Odd(scalar).named_parameters()}
        out[f"asked_{source}"] = {
            "model": sum(n for k, n in asked.items() if k.removeprefix("model.") in params),
            "exp_avg": sum(n for k, n in asked.items() if k.endswith(".exp_avg")),
            "owned": _owned(ours),
        }
    # A model of another shape: refused on every rank before anything is read.
    wide = Odd()
    wide.inp, wide.conv = nn.Linear(7, 6), nn.Conv1d(3, 6, 3, padding=1)
    try:
        tandem.checkpoint.load({"model": _ours(seed=1, net=wide)}, Path(tmp, "tandem"))
        out["shape_error"] = "no error"
    except ValueError as e:
        out["shape_error"] = str(e)
    return out


# -- the test --------------------------------------------------------------------------------------


def _files(path: Path) -> dict[str, int]:
    """Elements per file of the parameter tensors (``model.*`` but the buffer), from the
    metadata: which rank wrote what."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    storage = md.storage_data
    per_file: dict[str, int] = {}
    for index, info in storage.items():
        if index.fqn.startswith("model.") and index.fqn != "model.shift":
            item = md.state_dict_metadata[index.fqn]
            assert isinstance(item, TensorStorageMetadata)
            chunk = item.chunks[index.index]
            assert chunk.offsets == index.offset
            per_file[info.relative_path] = per_file.get(info.relative_path, 0) + math.prod(
                chunk.sizes
            )
    return per_file


def _layout(path: Path) -> dict[str, Any]:
    """Every key of a DCP checkpoint with its shape and dtype (tensors) or "bytes"."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    return {
        k: (tuple(v.size), v.properties.dtype) if isinstance(v, TensorStorageMetadata) else "bytes"
        for k, v in md.state_dict_metadata.items()
    }


@pytest.mark.timeout(300)
def test_sharded_dcp_both_ways(tmp_path: Path) -> None:
    at2 = run_ranks(_write_at_2, 2, args=(str(tmp_path),), timeout=140)
    at3 = run_ranks(_read_at_3, 3, args=(str(tmp_path),), timeout=140)
    # Each rank wrote its own slices: its file holds exactly the elements it owns.
    for name in ("tandem", "tandem-0d"):
        files = _files(tmp_path / name)
        owned = {f"__{r}_0.distcp": at2[r][f"owned-{name}"] for r in range(2)}
        assert files == owned, (name, files, owned)
    # The layout torch's FSDP2 writes for the same model.
    assert _layout(tmp_path / "tandem") == _layout(tmp_path / "fsdp2")
    # torch reads tandem's, in one process: into a plain module, and converted whole.
    for name, scalar in (("tandem", False), ("tandem-0d", True)):
        expected = torch.load(tmp_path / f"{name}.expected.pt", weights_only=True)
        plain = Odd(scalar)
        msd = plain.state_dict()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": msd}, checkpoint_id=tmp_path / name, no_dist=True)
        plain.load_state_dict(msd)
        assert set(msd) == set(expected["model"])
        assert all(torch.equal(v, expected["model"][k]) for k, v in msd.items()), name
        dcp_to_torch_save(tmp_path / name, tmp_path / f"{name}.pt")
        whole = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        converted = {
            "model": whole["model"],
            "state": whole["optimizer"]["state"],
            "groups": [
                {k: v for k, v in g.items() if k != "params"}
                for g in whole["optimizer"]["param_groups"]
            ],
        }
        assert _differences(converted, expected) == [], name
    # torch's FSDP2 at 3 reads it; tandem at 3 reads FSDP2's and its own, by slices.
    for rank, r in enumerate(at3):
        assert r["fsdp2_reads_tandem"] == [], (rank, r)
        for source in ("fsdp2", "tandem", "tandem-0d"):
            assert r[f"tandem_reads_{source}"] == [], (rank, source, r)
            asked = r[f"asked_{source}"]
            assert asked["model"] == asked["exp_avg"] == asked["owned"] > 0, (rank, source, asked)
    assert sum(r["asked_tandem"]["owned"] for r in at3) == sum(
        p.numel() for p in Odd().parameters()
    )
    message = at3[0]["shape_error"]
    assert all(r["shape_error"] == message for r in at3), at3
    assert str(tmp_path / "tandem") in message
    assert "inp.weight: checkpoint (5, 7), here (6, 7)" in message, message


@pytest.mark.parametrize(
    ("shape", "start", "stop", "expected"),
    [
        ((3, 4), 2, 11, [([0, 2], [1, 2]), ([1, 0], [1, 4]), ([2, 0], [1, 3])]),
        ((3, 4), 4, 12, [([1, 0], [2, 4])]),  # whole rows: one box
        ((3, 4), 5, 7, [([1, 1], [1, 2])]),  # within a row
        ((), 0, 1, [([], [])]),
        ((4,), 1, 1, []),
    ],
)
def test_boxes_examples(shape, start, stop, expected) -> None:
    assert boxes(shape, start, stop) == expected


def test_boxes_tile_every_run() -> None:
    """Every run of every small shape (up to 4-d) is tiled, in order, by at most 2*ndim - 1
    boxes: indexing the tensor by them gives exactly its flat elements start..stop."""
    for shape in [(5,), (5, 7), (5, 3, 3), (2, 3, 1, 4), (1, 1, 6)]:
        n = math.prod(shape)
        flat = torch.arange(n).view(shape)
        for start in range(n + 1):
            for stop in range(start, n + 1):
                got: list[int] = []
                found = boxes(shape, start, stop)
                for offsets, sizes in found:
                    index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
                    got += flat[index].reshape(-1).tolist()
                assert got == list(range(start, stop)), (shape, start, stop, found)
                assert len(found) <= 2 * len(shape) - 1
