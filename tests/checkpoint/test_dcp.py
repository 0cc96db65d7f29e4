"""tandem.checkpoint.dcp reads and writes torch's distributed checkpoints, checked by torch.

The oracle is torch's own DCP (``torch.distributed.checkpoint``) with its own state-dict helpers
(``get_state_dict`` / ``set_state_dict``) and engines (``nn.parallel.DistributedDataParallel``,
FSDP2 ``fully_shard``), over Gloo in real processes. AdamW after 3 steps (so every moment and
``step`` is non-trivial). Proven, ``torch.equal`` everywhere:

- tandem writes, torch reads: a tandem.DDP model and its AdamW saved by :func:`save_dcp` at 2
  and at 3 processes load through ``dcp.load`` + ``set_state_dict`` into a plain module and
  AdamW equal to tandem's model and optimizer state; a tandem.FullyShardedDataParallel model
  and its AdamW (3 units and a root parameter) saved at 2 processes (each rank its own slices:
  tests/checkpoint/test_dcp_sharded.py proves that part) load into a FSDP2 model at 3
  processes equal to the state tandem had gathered.
- torch writes, tandem reads: torch's DDP and FSDP2 (the same units), saved with
  ``dcp.save(get_state_dict(...))`` at 2 processes, load through :func:`load_dcp` into
  tandem.DDP and tandem FSDP at 2 and at 3 processes, parameters and optimizer state equal to
  torch's; then 2 more steps equal torch's engine continuing: DDP at 2 and 3 processes, FSDP at
  2 (where tandem's FSDP and FSDP2 step alike bit for bit: tests/parallel/fsdp/
  test_fsdp_torch_parity.py, which also says why 3 processes are not).
- ``read_dcp_weights`` (what ``tandem export`` reads), in one process, equals torch's own
  ``dcp_to_torch_save`` conversion of the same directories.
- errors: a state key the checkpoint lacks and a model of another shape are ValueErrors on
  every rank naming the path and the key; a directory without ``.metadata`` is not DCP;
  ``kind="sharded"`` with ``format="dcp"`` is refused before anything is written.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

import tandem
import tandem.checkpoint
from tandem.checkpoint.dcp import is_dcp, load_dcp, read_dcp_weights, save_dcp
from tests import models
from tests.harness import run_ranks
from tests.parallel.fsdp.models import FSDP, ScaledMLP, batch, mse, seeded

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:
    pytest.skip("this torch has no FSDP2 (fully_shard)", allow_module_level=True)

pytestmark = pytest.mark.distributed

STEPS = 3  # before the save
MORE = 2  # after the load, compared with torch continuing
UNITS = ("inp", "mid", "out")  # FSDP units, the same as FSDP2's fully_shard groups
FULL = StateDictOptions(full_state_dict=True)


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _ddp_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = models.batch(step, dist.get_rank(), 4, (10,))
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _fsdp_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    opt.zero_grad()
    mse(model, *batch(step, dist.get_rank(), dist.get_world_size())).backward()
    opt.step()


def _ours_fsdp(seed: int) -> FSDP:
    net = seeded(ScaledMLP, seed=seed)
    picked = {id(net.get_submodule(n)) for n in UNITS}
    return FSDP(net, stage=3, auto_wrap=lambda m: id(m) in picked)


def _theirs_fsdp(seed: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    net = seeded(ScaledMLP, seed=seed)
    for name in UNITS:
        fully_shard(net.get_submodule(name), mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """torch's view of a torch model and optimizer: whole tensors, optimizer keyed by name."""
    msd, osd = get_state_dict(model, opt, options=FULL)
    groups: Any = osd["param_groups"]
    return {"model": dict(msd), "state": osd["state"], "groups": _hyper(groups)}


def _named(module_names: list[str], model: dict, optim: dict) -> dict:
    """A plain optimizer state dict (by position over ``module_names``) in ``_full``'s form."""
    state = {module_names[i]: s for i, s in optim["state"].items()}
    return {"model": dict(model), "state": state, "groups": _hyper(optim["param_groups"])}


def _hyper(groups: list[dict]) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _equal(a: dict, b: dict) -> bool:
    """Bitwise equality of two ``_full`` dicts (same keys, tensors ``torch.equal``)."""
    if list(a["model"]) != list(b["model"]) or set(a["state"]) != set(b["state"]):
        return False
    if a["groups"] != b["groups"]:
        return False
    models_equal = all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())
    states_equal = all(
        set(s) == set(b["state"][n]) and all(torch.equal(v, b["state"][n][k]) for k, v in s.items())
        for n, s in a["state"].items()
    )
    return models_equal and states_equal


def _ddp_names() -> list[str]:
    return [n for n, _ in models.mlp().named_parameters()]


def _fsdp_names() -> list[str]:
    return [n for n, _ in ScaledMLP().named_parameters()]


def _ours_ddp_full(ddp: tandem.DDP, opt: torch.optim.Optimizer) -> dict:
    return _named(_ddp_names(), ddp.module.state_dict(), opt.state_dict())


def _ours_fsdp_full(model: FSDP, opt: torch.optim.Optimizer) -> dict | None:
    """tandem FSDP's gathered state on rank 0 (None elsewhere), in ``_full``'s form."""
    msd, osd = model.full_state_dict(), model.full_optim_state_dict(opt)
    return None if msd is None or osd is None else _named(_fsdp_names(), msd, osd)


def _same_on_rank0(value: dict | None, oracle: dict) -> bool:
    return value is None or _equal(value, oracle)


# -- tandem writes, torch reads -------------------------------------------------------------------


def _tandem_writes(tmp: str) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    # tandem.DDP + AdamW -> a plain module and AdamW through torch's own load.
    ddp = tandem.DDP(models.mlp(seed=0))
    opt = _adamw(ddp.parameters())
    for s in range(STEPS):
        _ddp_step(ddp, opt, s)
    path = Path(tmp, f"tandem-ddp-{ws}")
    state = {"model": ddp, "optimizer": opt, "step": STEPS}
    try:  # refused on every rank before anything is written
        tandem.checkpoint.save(state, path, format="dcp", kind="sharded")
    except ValueError as e:
        out["sharded_refused"] = "kind='sharded'" in str(e) and not path.exists()
    tandem.checkpoint.save(state, path, format="dcp")  # the public API: save_dcp
    out["is_dcp"] = is_dcp(path)
    plain = models.mlp(seed=7)
    plain_opt = _adamw(plain.parameters())
    msd, osd = get_state_dict(plain, plain_opt)
    loaded = {"model": msd, "optimizer": osd, "step": 0}
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(plain, plain_opt, model_state_dict=msd, optim_state_dict=osd)
    out["ddp_bitwise"] = _equal(_full(plain, plain_opt), _ours_ddp_full(ddp, opt))
    out["step"] = loaded["step"]
    if ws == 2:
        # tandem FSDP saved here; torch's FSDP2 loads it at 3 (below), against this state.
        fsdp = _ours_fsdp(seed=3)
        fopt = _adamw(fsdp.parameters())
        for s in range(STEPS):
            _fsdp_step(fsdp, fopt, s)
        save_dcp({"model": fsdp, "optimizer": fopt}, Path(tmp, "tandem-fsdp"))
        full = _ours_fsdp_full(fsdp, fopt)
        if rank == 0:
            torch.save(full, Path(tmp, "tandem-fsdp.expected.pt"))
    else:
        theirs = _theirs_fsdp(seed=11)
        topt = _adamw(theirs.parameters())
        msd, osd = get_state_dict(theirs, topt)
        dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=Path(tmp, "tandem-fsdp"))
        set_state_dict(theirs, topt, model_state_dict=msd, optim_state_dict=osd)
        expected = torch.load(Path(tmp, "tandem-fsdp.expected.pt"), weights_only=True)
        out["fsdp2_bitwise"] = _equal(_full(theirs, topt), expected)
    return out


def _at_2_then_3(fn, tmp: Path) -> tuple[list[dict], list[dict]]:
    """``fn(tmp)`` on 2 processes, then on 3 (which read what the 2 wrote)."""
    return run_ranks(fn, 2, args=(str(tmp),), timeout=140), run_ranks(
        fn, 3, args=(str(tmp),), timeout=140
    )


@pytest.mark.timeout(300)
def test_torch_reads_what_tandem_writes(tmp_path: Path) -> None:
    at2, at3 = _at_2_then_3(_tandem_writes, tmp_path)
    for r in at2 + at3:
        assert r["is_dcp"] and r["ddp_bitwise"] and r["step"] == STEPS, r
        assert r["sharded_refused"], r
    assert all(r["fsdp2_bitwise"] for r in at3), at3
    # What `tandem export` reads, in this process alone, against torch's own conversion.
    for name in ("tandem-ddp-3", "tandem-fsdp"):
        dcp_to_torch_save(tmp_path / name, tmp_path / f"{name}.torch.pt")
        oracle = torch.load(tmp_path / f"{name}.torch.pt", weights_only=True)["model"]
        ours = read_dcp_weights(tmp_path / name)
        assert set(ours) == set(oracle), (sorted(ours), sorted(oracle))
        assert all(torch.equal(v, oracle[k]) for k, v in ours.items())
    # `tandem export` takes a DCP directory as it takes a run directory.
    out = tmp_path / "fsdp.safetensors"
    cli = [sys.executable, "-m", "tandem.cli", "export", str(tmp_path / "tandem-fsdp"), str(out)]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    exported = safetensors.torch.load_file(out)
    assert set(exported) == set(oracle) and all(
        torch.equal(v, oracle[k]) for k, v in exported.items()
    )


# -- torch writes, tandem reads -------------------------------------------------------------------


def _torch_ddp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.parallel.DistributedDataParallel(models.mlp(seed=seed))
    return model, _adamw(model.parameters())


def _torch_load(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


def _tandem_reads(tmp: str) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    ddp_path, fsdp_path = Path(tmp, "torch-ddp"), Path(tmp, "torch-fsdp2")
    out: dict = {}
    if ws == 2:  # torch trains and saves
        theirs, topt = _torch_ddp(seed=0)
        ftheirs = _theirs_fsdp(seed=3)
        ftopt = _adamw(ftheirs.parameters())
        for s in range(STEPS):
            _ddp_step(theirs, topt, s)
            _fsdp_step(ftheirs, ftopt, s)
        for model, opt, path in ((theirs, topt, ddp_path), (ftheirs, ftopt, fsdp_path)):
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)
            full = _full(model, opt)
            if rank == 0:
                torch.save(full, path.with_suffix(".expected.pt"))
        dist.barrier()  # rank 0's files written before anyone reads them
    else:  # torch's DDP continues from the same checkpoint at this world size
        theirs, topt = _torch_ddp(seed=9)
        _torch_load(theirs, topt, ddp_path)
    ddp_expected = torch.load(ddp_path.with_suffix(".expected.pt"), weights_only=True)
    fsdp_expected = torch.load(fsdp_path.with_suffix(".expected.pt"), weights_only=True)

    ours = tandem.DDP(models.mlp(seed=5))
    opt = _adamw(ours.parameters())
    tandem.checkpoint.load({"model": ours, "optimizer": opt}, ddp_path)  # a DCP directory, seen
    out["ddp_loaded"] = _equal(_ours_ddp_full(ours, opt), ddp_expected)
    fours = _ours_fsdp(seed=6)
    fopt = _adamw(fours.parameters())
    tandem.checkpoint.load({"model": fours, "optimizer": fopt}, fsdp_path, format="dcp")
    out["fsdp_loaded"] = _same_on_rank0(_ours_fsdp_full(fours, fopt), fsdp_expected)

    for s in range(STEPS, STEPS + MORE):
        _ddp_step(ours, opt, s)
        _ddp_step(theirs, topt, s)
    out["ddp_continues"] = _equal(_ours_ddp_full(ours, opt), _full(theirs, topt))
    if ws == 2:  # FSDP2 and tandem's FSDP step bit for bit alike at 2 processes only
        for s in range(STEPS, STEPS + MORE):
            _fsdp_step(fours, fopt, s)
            _fsdp_step(ftheirs, ftopt, s)
        oracle = _full(ftheirs, ftopt)
        out["fsdp_continues"] = _same_on_rank0(_ours_fsdp_full(fours, fopt), oracle)
    else:
        out["errors"] = _errors(ddp_path, tmp)
    return out


def _other_widths() -> nn.Module:
    """``models.mlp``'s keys, with a first layer of 31 outputs: three tensors reshaped."""
    return nn.Sequential(
        nn.Linear(10, 31), nn.Tanh(), nn.Linear(31, 16), nn.Tanh(), nn.Linear(16, 3)
    ).double()


def _errors(path: Path, tmp: str) -> list[str]:
    """The messages of loads that do not fit (each must raise on every rank)."""
    messages = []
    cases: list[dict[str, Any]] = [
        {"model": tandem.DDP(models.mlp()), "scheduler": {"x": 1}},  # a key it lacks
        {"model": tandem.DDP(_other_widths())},  # other shapes
        {"model": tandem.DDP(models.mlp())},  # not a DCP directory
    ]
    paths = [path, path, Path(tmp)]
    for state, where in zip(cases, paths, strict=True):
        try:
            load_dcp(state, where)
            messages.append("no error")
        except ValueError as e:
            messages.append(f"ValueError: {e}")
        except tandem.checkpoint.CheckpointError as e:
            messages.append(f"CheckpointError: {e}")
    return messages


@pytest.mark.timeout(300)
def test_tandem_reads_what_torch_writes(tmp_path: Path) -> None:
    at2, at3 = _at_2_then_3(_tandem_reads, tmp_path)
    for r in at2 + at3:
        assert r["ddp_loaded"] and r["fsdp_loaded"] and r["ddp_continues"], r
    assert all(r["fsdp_continues"] for r in at2), at2
    missing, shapes, not_dcp = at3[0]["errors"]
    assert all(r["errors"] == at3[0]["errors"] for r in at3), at3  # the same on every rank
    path = str(tmp_path / "torch-ddp")
    assert missing.startswith("ValueError") and path in missing and "'scheduler'" in missing
    assert shapes.startswith("ValueError") and path in shapes
    assert "0.weight: checkpoint (32, 10), here (31, 10)" in shapes
    assert not_dcp.startswith("CheckpointError") and "not a DCP checkpoint" in not_dcp
